"""DP-SGD with Opacus on a received sub-model: per-example gradients of the factorized layers
against a per-example loop of plain autograd, ``make_private`` and a step on a received shard,
the client rules acting on the privatized gradient, the receipt, and copies of the sub-model
(pickle, ``copy.deepcopy``, ``torch.save``, ``ModuleValidator.fix``) that compute the same.

Opacus is the ``dp`` extra (also in the ``test`` extra); without it these tests skip."""

from __future__ import annotations

import copy
import io
import logging
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from flower_grid import InProcessGrid
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.clientapp import ClientApp
from torch import nn

from fedshard import (
    Cohort,
    LocalTraining,
    NodePolicy,
    Sharding,
    ShardingClientApp,
    SpectralSharding,
    handle_query,
    receive,
)
from fedshard import protocol as P
from fedshard.client.train import ClientRules, parameter_groups
from fedshard.spectral import (
    SpectralConv2d,
    SpectralLinear,
    per_sample_gradients,
    register_grad_samplers,
)
from fedshard.spectral.surgery import shard_model

opacus = pytest.importorskip("opacus")
from opacus import GradSampleModule, PrivacyEngine  # noqa: E402
from opacus.grad_sample.functorch import (  # noqa: E402
    ft_compute_per_sample_gradient,
    prepare_layer,
)
from opacus.optimizers import DPOptimizer  # noqa: E402
from opacus.validators import ModuleValidator  # noqa: E402


def cnn() -> nn.Module:
    """Conv, conv, linear, linear on 1x12x12 inputs; the middle two are sharded."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1),
                             nn.ReLU(), nn.Flatten(), nn.Linear(6 * 10 * 10, 12), nn.ReLU(),
                             nn.Linear(12, 3))


def batch(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 12, 12, generator=g), torch.randint(0, 3, (n,), generator=g)


def train_message(keep: float = 0.5, **training: Any) -> Message:
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: object) -> Message:
        return handle_query(msg, keep)

    s = SpectralSharding(sharded_layers=["2", "5"], sharding=Sharding(method="unbiased"),
                         training=LocalTraining(lr=0.05, **training), seed=3,
                         cohort=Cohort(min_train_nodes=1, min_available_nodes=1),
                         nodes=NodePolicy(query_timeout=5, node_wait_timeout=5))
    s.num_rounds = 2
    return next(iter(s.configure_train(1, ArrayRecord(cnn().state_dict()), ConfigRecord(),
                                       InProcessGrid(app, [{}]))))


# ---------------------------------------------------------------------------- per-example gradients
def _spectral(kind: str) -> nn.Module:
    """One factorized layer (float64) of the geometry ``kind``."""
    g = torch.Generator().manual_seed(7)
    if kind == "linear":
        dense: nn.Module = nn.Linear(6, 5)
    elif kind == "linear-no-bias":
        dense = nn.Linear(6, 5, bias=False)
    else:
        conv = {"conv": dict(kernel_size=3),
                "conv-strided": dict(kernel_size=3, stride=2, padding=1, dilation=1),
                "conv-dilated-reflect": dict(kernel_size=3, padding=2, dilation=2,
                                             padding_mode="reflect"),
                "conv-same-no-bias": dict(kernel_size=(2, 3), padding="same", bias=False),
                "conv-merged": dict(kernel_size=3, padding=1),
                "conv-padded-terms": dict(kernel_size=3, padding=1)}[kind]
        dense = nn.Conv2d(3, 5, **conv)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in dense.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    dense = dense.double()
    cls = SpectralLinear if isinstance(dense, nn.Linear) else SpectralConv2d
    layer = cls.from_dense(dense, indices=[2, 0, 1],
                           omega=torch.tensor([0.5, 2.0, 1.3], dtype=torch.float64))
    if kind == "conv-merged":
        layer.merge_terms = True
    if kind == "conv-padded-terms":
        layer.pad_terms_to = 8
    return layer


def _inputs(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    shape = (n, 4, 6) if kind.startswith("linear") else (n, 3, 7, 9)  # a token axis for linear
    return torch.randn(shape, generator=g, dtype=torch.float64)


KINDS = ["linear", "linear-no-bias", "conv", "conv-strided", "conv-dilated-reflect",
         "conv-same-no-bias", "conv-merged", "conv-padded-terms"]


@pytest.mark.parametrize("functorch", [False, True], ids=["fedshard-sampler", "functorch"])
@pytest.mark.parametrize("kind", KINDS)
def test_per_example_gradients_equal_a_per_example_autograd_loop(kind: str,
                                                                  functorch: bool) -> None:
    register_grad_samplers()
    layer = _spectral(kind)
    x = _inputs(kind, 5)
    weights = torch.randn(layer(x[:1]).shape[1:], generator=torch.Generator().manual_seed(4),
                          dtype=torch.float64)

    def loss_of(out: torch.Tensor) -> torch.Tensor:  # a different loss per example
        return (torch.tanh(out) * weights).sum()

    trainable = [p for p in layer.parameters() if p.requires_grad]
    expected = []  # the oracle: plain autograd, one example at a time
    for i in range(x.shape[0]):
        expected.append(torch.autograd.grad(loss_of(layer(x[i:i + 1])), trainable))

    wrapped = GradSampleModule(copy.deepcopy(layer), loss_reduction="sum",
                               force_functorch=functorch)
    loss_of(wrapped(x)).backward()
    inner = wrapped._module
    got = [p.grad_sample for p in inner.parameters() if p.requires_grad]
    for j, per_example in enumerate(got):
        oracle = torch.stack([e[j] for e in expected])
        torch.testing.assert_close(per_example, oracle, rtol=1e-10, atol=1e-10)
    assert not inner.omega.requires_grad and getattr(inner.omega, "grad_sample", None) is None
    assert len(got) == (3 if inner.bias is not None else 2)


def test_per_example_gradients_refuse_another_layer() -> None:
    with pytest.raises(TypeError, match=r"expects a SpectralLinear or SpectralConv2d, got "
                                        r"Linear; no gradient was computed"):
        per_sample_gradients(nn.Linear(2, 2), [torch.zeros(1, 2)],  # type: ignore[arg-type]
                             torch.zeros(1, 2))


# ---------------------------------------------------------------------------- a received shard
def test_make_private_and_a_dp_sgd_step_on_a_received_sub_model() -> None:
    msg = train_message(frobenius_decay=1e-3, clip_lr_tau=2.0)
    shard = receive(msg, cnn())
    model = shard.model
    assert ModuleValidator.validate(model, strict=False) == []  # as received, no fix needed
    omega = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("omega")}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch(16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=shard.settings.lr, momentum=0.9)
    private, dp_optimizer, dp_loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.1,
        max_grad_norm=1.0)
    handle = shard.rules.attach(dp_optimizer)
    assert handle.attached and handle.layers == 2
    steps = 0
    for xb, yb in dp_loader:
        if len(yb) == 0:  # Poisson sampling may draw an empty batch
            continue
        dp_optimizer.zero_grad()
        F.cross_entropy(private(xb), yb).backward()
        dp_optimizer.step()
        steps += 1
    assert steps > 0
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert {n for n in moved if n.endswith((".u", ".v"))} == {"2.u", "2.v", "5.u", "5.v"}
    for name, value in omega.items():  # ω is frozen
        assert torch.equal(dict(model.named_parameters())[name], value)
    report = shard.rules.report()
    assert report.steps == steps and report.optimizer == "SGD"
    assert (report.dp_sgd, report.noise_multiplier, report.max_grad_norm) == (True, 1.1, 1.0)
    reply = shard.reply(num_examples=16)
    config = reply.content["config"]
    assert config["trained-dp-sgd"] is True and config["trained-noise-multiplier"] == 1.1
    assert config["trained-max-grad-norm"] == 1.0 and config["trained-optimizer"] == "SGD"
    receipt = P.read_receipt(config)
    assert isinstance(receipt, P.Receipt) and receipt.dp_sgd
    assert (receipt.noise_multiplier, receipt.max_grad_norm, receipt.steps) == (1.1, 1.0, steps)


def test_the_rules_act_on_the_privatized_gradient() -> None:
    """σ = 0 and no clipping: DP-SGD's gradient is the batch's mean gradient, so a DPOptimizer
    with the rules attached steps exactly as the plain optimizer with the rules (Frobenius
    decay, the dense factor step and ClipLR); a rule applied before Opacus rebuilt the
    gradients would have been lost."""
    dense = cnn().double()
    sub, _ = shard_model(dense, {"2": [0, 2, 4], "5": [1, 3, 5, 7]},
                         {"2": torch.tensor([1.0, 3.0, 1.5]),
                          "5": torch.tensor([0.7, 1.0, 2.5, 1.2])})
    recipe = LocalTraining(lr=0.05, frobenius_decay=1e-2, clip_lr_tau=2.0, factor_step="dense")
    x, y = batch(8)
    x = x.double()
    plain = copy.deepcopy(sub)
    rules = ClientRules.of(plain, recipe)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    rules.attach(sgd)
    private = GradSampleModule(copy.deepcopy(sub))
    dp_rules = ClientRules.of(private._module, recipe)
    dp = DPOptimizer(torch.optim.SGD(private.parameters(), lr=0.05, momentum=0.9),
                     noise_multiplier=0.0, max_grad_norm=1e9, expected_batch_size=len(y))
    dp_rules.attach(dp)
    for _ in range(3):
        for model, opt in ((plain, sgd), (private, dp)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    for (name, a), b in zip(plain.state_dict().items(), private._module.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)
    assert rules.report().steps == dp_rules.report().steps == 3
    assert dp_rules.report().dp_sgd and not rules.report().dp_sgd
    assert not torch.equal(plain.state_dict()["2.u"], sub.state_dict()["2.u"])


def test_attaching_to_a_dp_optimizer_and_to_the_optimizer_it_wraps_is_refused() -> None:
    shard = receive(train_message(frobenius_decay=1e-3), cnn())
    sgd = torch.optim.SGD(shard.model.parameters(), lr=0.05)
    private = GradSampleModule(shard.model)
    dp = DPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
    shard.rules.attach(sgd)
    with pytest.raises(ValueError, match=r"already attached to this DPOptimizer optimizer "
                                         r"\(the SGD that this DPOptimizer wraps\)"):
        shard.rules.attach(dp)
    del private


def test_the_rules_attached_to_the_wrapped_optimizer_still_say_dp_sgd() -> None:
    shard = receive(train_message(frobenius_decay=1e-3), cnn())
    sgd = torch.optim.SGD(shard.model.parameters(), lr=0.05)
    shard.rules.attach(sgd)  # before make_private: the hooks see the privatized gradient
    private = GradSampleModule(shard.model)
    dp = DPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
    x, y = batch(4)
    dp.zero_grad()
    F.cross_entropy(private(x), y).backward()
    dp.step()
    report = shard.rules.report()
    assert report.steps == 1 and report.dp_sgd and report.noise_multiplier is None


@pytest.mark.parametrize("sigma,clip,problem", [
    (0.8, 2.0, None),
    (0.0, 2.0, "noise multiplier 0 adds no noise (below 1e-06): the updates are released as "
               "trained and the run is not private"),
    (1e-300, 2.0, "noise multiplier 1e-300 adds no noise (below 1e-06): the updates are "
                  "released as trained and the run is not private"),
    (0.8, 0.0, "clipping norm 0 clips every per-example gradient to zero: nothing trains"),
])
def test_a_run_of_dp_sgd_nodes_is_logged_by_the_server(
        sigma: float, clip: float, problem: str | None,
        caplog: pytest.LogCaptureFixture) -> None:
    """INFO for DP-SGD with noise and clipping; a WARNING on the node and on the server
    (from the node's receipt) when the noise is nil or the clipping leaves nothing."""
    app = ShardingClientApp(default_keep_ratio=0.5)

    @app.train()
    def _train(msg: Message, context: object) -> Message:
        shard = receive(msg, cnn())
        x, y = batch(8)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                             batch_size=4)
        optimizer = torch.optim.SGD(shard.model.parameters(), lr=shard.settings.lr)
        model, dp, loader = PrivacyEngine().make_private(
            module=shard.model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma,
            max_grad_norm=clip, poisson_sampling=False)
        shard.rules.attach(dp)
        for xb, yb in loader:
            dp.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            dp.step()
        return shard.reply(num_examples=8)

    s = SpectralSharding(sharded_layers=["2", "5"], num_rounds=1,
                         cohort=Cohort(min_train_nodes=2, min_available_nodes=2,
                                       fraction_evaluate=0.0),
                         training=LocalTraining(lr=0.05, frobenius_decay=1e-4),
                         nodes=NodePolicy(query_timeout=5, node_wait_timeout=5))
    caplog.set_level(logging.INFO, logger="fedshard")
    s.start(grid=InProcessGrid(app, [{}, {}]), initial_arrays=ArrayRecord(cnn().state_dict()),
            num_rounds=1, timeout=5)
    assert s.rounds_trained == 1
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "DP-SGD" in r.getMessage()]
    if problem is None:
        assert said == [("INFO", "Round 1: 2 of 2 nodes trained with DP-SGD (Opacus), noise "
                                 "multiplier 0.8, clipping norm 2.")]
        return
    node = [m for level, m in said if m.startswith("DP-SGD (Opacus) is attached")]
    assert len(node) == 2 and all(f"but its {problem}." in m for m in node)
    assert ("WARNING", f"Round 1: 2 of 2 nodes trained with DP-SGD (Opacus), but their receipts "
                       f"say its {problem}.") in said


def test_receipt_dp_entries_are_bounded() -> None:
    base = {"trained-optimizer": "SGD", "trained-steps": 3, "trained-clip-lr": False,
            "trained-frobenius-decay": False}
    assert P.read_receipt(base) == P.Receipt("SGD", None, 3, False, False)
    assert "trained-dp-sgd" not in P.Receipt("SGD", None, 3, False, False).entries()
    assert P.read_receipt({**base, "trained-dp-sgd": "yes"}) == \
        "trained-dp-sgd='yes': expected True or False"
    assert P.read_receipt({**base, "trained-noise-multiplier": 1.0}) == (
        "trained-noise-multiplier=1.0: expected a finite number ≥ 0, with trained-dp-sgd=True")
    assert P.read_receipt({**base, "trained-dp-sgd": True, "trained-max-grad-norm": -1.0}) \
        == "trained-max-grad-norm=-1.0: expected a finite number ≥ 0, with trained-dp-sgd=True"


# ---------------------------------------------------------------------------- copies
def _same_outputs(a: nn.Module, b: nn.Module) -> None:
    x, _ = batch(4, seed=9)
    a.eval()
    b.eval()
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def _copies(model: nn.Module) -> dict[str, nn.Module]:
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    return {"deepcopy": copy.deepcopy(model), "pickle": pickle.loads(pickle.dumps(model)),
            "torch.save": torch.load(saved, weights_only=False),
            "ModuleValidator.fix": ModuleValidator.fix(model)}


def test_a_received_sub_model_copies_pickles_and_saves() -> None:
    model = receive(train_message(), cnn()).model
    for name, clone in _copies(model).items():
        _same_outputs(model, clone)
        assert isinstance(clone[2], SpectralConv2d) and isinstance(clone[5], SpectralLinear), name
        assert not clone[2].omega.requires_grad, name


def test_after_opacus_fallback_the_sub_model_still_pickles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Opacus's torch.func fallback (a layer type without a grad sampler: here fedshard's
    two, as if Opacus had been imported after the shard was received) leaves a local function
    on the layer, which made ``ModuleValidator.fix`` fail with "Can't pickle local object";
    the layer's copies leave it out (Opacus rebuilds it)."""
    samplers = dict(GradSampleModule.GRAD_SAMPLERS)
    for cls in (SpectralLinear, SpectralConv2d):
        samplers.pop(cls, None)
    monkeypatch.setattr(GradSampleModule, "GRAD_SAMPLERS", samplers)
    model = receive(train_message(), cnn()).model
    private = GradSampleModule(model)
    x, y = batch(4)
    F.cross_entropy(private(x), y).backward()
    assert hasattr(model[2], "ft_compute_sample_grad")
    copies = _copies(model)
    for name, clone in copies.items():
        _same_outputs(model, clone)
        assert not hasattr(clone[2], "ft_compute_sample_grad"), name
    # a layer that is not wrapped: its copy computes Opacus's fallback again, rebuilt
    layer = receive(train_message(), cnn()).model[2]
    prepare_layer(layer)
    clone = pickle.loads(pickle.dumps(layer))
    assert not hasattr(clone, "ft_compute_sample_grad")
    hidden, back = torch.randn(4, 4, 10, 10), torch.randn(4, 6, 10, 10)
    rebuilt = ft_compute_per_sample_gradient(clone, [hidden], back)
    assert hasattr(clone, "ft_compute_sample_grad")
    for param, per_example in per_sample_gradients(clone, [hidden], back).items():
        torch.testing.assert_close(rebuilt[param], per_example, rtol=1e-4, atol=1e-5)


def test_omega_is_a_frozen_parameter_in_its_state_dict_place() -> None:
    model = receive(train_message(), cnn()).model
    layer = model[5]
    assert [k for k in layer.state_dict()] == ["u", "v", "bias", "omega"]
    assert "omega" not in dict(layer.named_buffers()) and not layer.omega.requires_grad
    layer.omega.requires_grad_(True)  # even unfrozen, fedshard's optimizer leaves it out
    grouped = {id(p) for g in parameter_groups(model, 0.0) for p in g["params"]}
    assert id(layer.omega) not in grouped and id(layer.u) in grouped
