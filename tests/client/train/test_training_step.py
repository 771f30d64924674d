"""The client rules on any optimizer, the analytic Frobenius gradient, norm clipping, dict batches,
the finiteness check without per-step host reads, and torch.compile (against references)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from trainconf import with_

from fedshard.client.train import (
    ClientRules,
    TrainConfig,
    build_optimizer,
    evaluate,
    train,
)
from fedshard.client.train.fast import FastOptions, conv_form
from fedshard.settings import LocalTraining
from fedshard.spectral import SpectralConv2d, SpectralLinear


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _model(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    g = _gen(0)
    lin = SpectralLinear(
        torch.randn(8, 3, generator=g, dtype=dtype) / 2,
        torch.randn(6, 3, generator=g, dtype=dtype) / 2,
        torch.tensor([1.0, 12.0, 30.0], dtype=dtype),
        torch.zeros(8, dtype=dtype),
    )
    head = nn.Linear(8, 3).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(3, 8, generator=g, dtype=dtype))
        head.bias.zero_()
    return nn.Sequential(lin, nn.Tanh(), head)


def _data(n: int = 24, dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = _gen(1)
    return TensorDataset(
        torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)
    )


def _assert_same(a: nn.Module, b: nn.Module, rtol: float = 1e-12, atol: float = 1e-14) -> None:
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=key)


# -- the client rules on any torch optimizer ----------------------------------------------------


_SCALE = torch.tensor([1.0, 10 / 12, 10 / 30], dtype=torch.float64)  # min(1, τ/ω), τ = 10


def _rules(model: nn.Module, tau: float | None = 10.0, gamma: float = 0.0) -> ClientRules:
    return ClientRules.of(model, LocalTraining(frobenius_decay=gamma, clip_lr_tau=tau))


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer moves (ω is a frozen parameter: it has no gradient)."""
    return [p for p in model.parameters() if p.requires_grad]


def _by_hand(reference: nn.Module, lr: float) -> None:
    """One plain SGD step with the factor gradients scaled column by column."""
    with torch.no_grad():
        for p in _trainable(reference):
            factor = p is reference[0].u or p is reference[0].v
            p -= lr * p.grad * (_SCALE if factor else 1.0)


def test_cliplr_in_a_user_loop_matches_the_rule_applied_by_hand() -> None:
    model, reference = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rules = _rules(model)
    assert rules.attach(opt).attached
    x, t = _data()[:8]
    nn.functional.cross_entropy(model(x), t).backward()
    nn.functional.cross_entropy(reference(x), t).backward()
    opt.step()
    _by_hand(reference, 0.1)
    _assert_same(model, reference)
    assert rules.report().steps == 1 and rules.report().scaled_columns == 2
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


_OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
}


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_cliplr_scales_each_columns_move_under_any_optimizer(name: str) -> None:
    """ClipLR is a per-term learning-rate scale: at every step, from the same state, the move
    of factor column i with the rules is min(1, τ/ω_i) times the same optimizer's move
    without them (an adaptive optimizer ignores a scaled gradient: Adam's step would be the
    same). Dense parameters move as without the rules."""
    make = _OPTIMIZERS[name]
    model = _model()
    opt = make(model.parameters())
    rules = _rules(model)  # τ = 10, ω = (1, 12, 30): two of three columns scaled
    rules.attach(opt)
    for x, t in list(DataLoader(_data(), batch_size=8)):
        twin = copy.deepcopy(model)  # the same state, stepped without the rules
        twin_opt = make(twin.parameters())
        twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # not sharing buffers
        before = copy.deepcopy(model)
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), t).backward()
            o.step()
        for part in ("u", "v"):
            moved = getattr(model[0], part) - getattr(before[0], part)
            plain = getattr(twin[0], part) - getattr(before[0], part)
            torch.testing.assert_close(moved, plain * _SCALE, rtol=1e-9, atol=1e-15)
            assert plain[:, 2].abs().max() > 1e-6  # the scaled column did move
        torch.testing.assert_close(model[2].weight, twin[2].weight, rtol=0, atol=0)
    assert rules.report().steps == 3


def test_cliplr_follows_omega_written_in_place() -> None:
    """The scales come from the layers' current ω at each step: ω overwritten with
    load_state_dict after the optimizer was built gives min(1, τ/ω_new)."""
    model, reference = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _rules(model).attach(opt)
    new_omega = torch.tensor([20.0, 1.0, 40.0], dtype=torch.float64)
    for m in (model, reference):
        m.load_state_dict({**m.state_dict(), "0.omega": new_omega})
    x, t = _data()[:8]
    nn.functional.cross_entropy(model(x), t).backward()
    nn.functional.cross_entropy(reference(x), t).backward()
    opt.step()
    scale = torch.tensor([0.5, 1.0, 0.25], dtype=torch.float64)
    with torch.no_grad():
        for p in _trainable(reference):
            factor = p is reference[0].u or p is reference[0].v
            p -= 0.1 * p.grad * (scale if factor else 1.0)
    _assert_same(model, reference)


def test_cliplr_with_a_closure_clips_the_closures_gradients() -> None:
    model, reference = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _rules(model).attach(opt)
    x, t = _data()[:8]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), t)
        loss.backward()
        return loss

    loss = opt.step(closure)
    want = nn.functional.cross_entropy(reference(x), t)
    want.backward()
    _by_hand(reference, 0.1)
    assert torch.equal(loss, want)
    _assert_same(model, reference)


def test_rules_without_anything_to_do_or_removed_leave_the_plain_optimizer() -> None:
    model, removed, reference = _model(), _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert not _rules(model, tau=None).attach(opt).attached  # γ = 0, τ = None: nothing to do
    dense = nn.Linear(4, 3)  # no spectral layer: nothing to scale, no hook on the optimizer
    dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    assert not _rules(dense, tau=1.0).attach(dense_opt).attached
    assert not dense_opt._optimizer_step_pre_hooks
    opt_removed = torch.optim.SGD(removed.parameters(), lr=0.1, momentum=0.9)
    _rules(removed, tau=1.0).attach(opt_removed).remove()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, t in DataLoader(_data(), batch_size=8):
        for m, o in ((model, opt), (removed, opt_removed), (reference, plain)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), t).backward()
            o.step()
    _assert_same(model, reference, rtol=0, atol=0)
    _assert_same(removed, reference, rtol=0, atol=0)


def test_a_handle_detaches_and_a_builder_gets_the_rules_attached() -> None:
    """attach() returns a handle: inside ``with`` the optimizer's steps apply the rules, after
    it they are plain again (the same state as a reference optimizer without rules);
    attaching() attaches to every optimizer a builder returns, in a list or dict as
    Lightning's configure_optimizers may, and refuses a builder that returns none."""
    model, reference = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    rules = _rules(model)
    x, t = _data()[:8]
    with rules.attach(opt) as handle:
        assert handle.attached and handle.layers == 1 and handle.optimizer is opt
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), t).backward()
        opt.step()
        _by_hand(reference, 0.1)  # the clipped step, by hand
    assert not handle.attached and not opt._optimizer_step_pre_hooks
    assert not opt._optimizer_step_post_hooks
    _assert_same(model, reference)
    for m, o in ((model, opt), (reference, ref_opt)):  # detached: a plain step on both
        o.zero_grad()
        nn.functional.cross_entropy(m(x), t).backward()
        o.step()
    _assert_same(model, reference)
    assert rules.report().steps == 1
    rules.attach(opt).remove()  # removed: it may be attached again

    other = _model()
    made: list[torch.optim.Optimizer] = []

    def configure_optimizers() -> dict:
        made.append(torch.optim.SGD(other.parameters(), lr=0.1))
        return {"optimizer": made[-1], "lr_scheduler": None}

    built = _rules(other).attaching(configure_optimizers)
    result = built()
    assert result["optimizer"] is made[0] and len(made[0]._optimizer_step_post_hooks) == 1
    assert built.__name__ == "configure_optimizers"
    listed = _rules(other).attaching(lambda: ([torch.optim.Adam(other.parameters())], []))
    (adam,), _ = listed()
    assert len(adam._optimizer_step_pre_hooks) == 1
    with pytest.raises(TypeError, match=r"returned NoneType, with no torch\.optim\.Optimizer "
                                        r"in it; expected an optimizer"):
        _rules(other).attaching(lambda: None)()


def test_cliplr_state_dict_round_trip_and_lr_scheduler() -> None:
    cfg = TrainConfig(recipe=LocalTraining(lr=0.2, momentum=0.9), log_every_epoch=False)
    batches = list(DataLoader(_data(32), batch_size=8))

    def run(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: list[Any]) -> None:
        for x, t in steps:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), t).backward()
            opt.step()
            sched.step()

    straight = _model()
    opt = build_optimizer(straight, cfg)
    assert isinstance(opt, torch.optim.SGD)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    run(straight, opt, sched, batches)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2 / 16)

    first = _model()
    opt1 = build_optimizer(first, cfg)
    sched1 = torch.optim.lr_scheduler.StepLR(opt1, step_size=1, gamma=0.5)
    run(first, opt1, sched1, batches[:2])
    saved = (copy.deepcopy(first.state_dict()), opt1.state_dict(), sched1.state_dict())
    resumed = _model()
    resumed.load_state_dict(saved[0])
    opt2 = build_optimizer(resumed, cfg)
    opt2.load_state_dict(saved[1])
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    sched2.load_state_dict(saved[2])
    assert "momentum_buffer" in opt2.state[resumed[0].u]
    run(resumed, opt2, sched2, batches[2:])
    _assert_same(resumed, straight, rtol=0, atol=0)


def test_build_optimizer_applies_cliplr() -> None:
    """build_optimizer's SGD (what Shard.optimizer returns) clips: one step against the rule
    by hand."""
    model, reference = _model(), _model()
    opt = build_optimizer(model, TrainConfig(recipe=LocalTraining(
        lr=0.1, momentum=0.9, clip_lr_tau=10.0, frobenius_decay=0.0)))
    x, t = _data()[:8]
    nn.functional.cross_entropy(model(x), t).backward()
    nn.functional.cross_entropy(reference(x), t).backward()
    opt.step()  # the first momentum step is a plain step
    _by_hand(reference, 0.1)
    _assert_same(model, reference)


def test_rules_errors_name_the_setting_and_the_servers_rule() -> None:
    with pytest.raises(TypeError,
                       match=r"ClientRules attach to a torch\.optim\.Optimizer, got list"):
        _rules(_model()).attach([])  # type: ignore[arg-type]
    # the same τ rule as the server's (fedshard.settings): τ ≥ 1
    with pytest.raises(ValueError, match=r"clip_lr_tau=0\.5: expected τ ≥ 1"):
        ClientRules([], clip_lr_tau=0.5)
    with pytest.raises(ValueError, match=r"frobenius_decay=-1\.0: expected a finite number ≥ 0"):
        ClientRules([], frobenius_decay=-1.0)


# -- Frobenius decay and norm clipping ----------------------------------------------------------


def test_frobenius_gradient_equals_autograd_of_the_explicit_dense_norm() -> None:
    model = _model()
    layer = model[0]
    gamma = 0.3
    w = (layer.u * layer.omega) @ layer.v.mT  # the dense (8, 6) weight, formed explicitly
    (gamma * (w**2).sum()).backward()
    want_u, want_v = layer.u.grad.clone(), layer.v.grad.clone()
    layer.u.grad = None  # None grads are created
    layer.v.grad = torch.ones_like(layer.v)  # existing grads are added to
    _rules(model, tau=None, gamma=gamma).before_step()
    torch.testing.assert_close(layer.u.grad, want_u, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(layer.v.grad, want_v + 1, rtol=1e-13, atol=1e-15)


def test_max_grad_norm_clips_the_global_norm_before_the_step() -> None:
    model, reference = _model(), _model()
    cfg = TrainConfig(recipe=LocalTraining(lr=0.5, momentum=0.0, frobenius_decay=0.0,
                                           clip_lr_tau=None), max_grad_norm=0.05,
                      log_every_epoch=False)
    x, t = _data()[:8]
    train(model, DataLoader(TensorDataset(x, t), batch_size=8), cfg)
    nn.functional.cross_entropy(reference(x), t).backward()
    grads = [p.grad for p in _trainable(reference)]
    norm = torch.sqrt(sum((g**2).sum() for g in grads))  # type: ignore[misc]
    assert norm > 0.05  # the clipping is active
    with torch.no_grad():
        for p in _trainable(reference):
            p -= 0.5 * p.grad * (0.05 / (norm + 1e-6))  # torch adds 1e-6 to the norm
    _assert_same(model, reference, rtol=1e-10, atol=1e-12)


# -- batches ----------------------------------------------------------------------------------


class _DictData(Dataset[dict[str, Any]]):
    def __init__(self, base: TensorDataset, x_key: str, y_key: str, extra: dict[str, Any]) -> None:
        self.base, self.x_key, self.y_key, self.extra = base, x_key, y_key, extra

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, Any]:
        x, y = self.base[i]
        return {self.x_key: x, self.y_key: y, **self.extra}


@pytest.mark.parametrize(
    ("x_key", "y_key", "cfg_keys"),
    [
        ("img", "label", {}),
        ("pixel_values", "fine_label", {}),
        ("input_ids", "labels", {}),
        ("features", "target", {"input_key": "features", "target_key": "target"}),
    ],
)
def test_dict_batches_train_like_pairs(x_key: str, y_key: str, cfg_keys: dict[str, str]) -> None:
    base = _data()
    cfg = TrainConfig(recipe=LocalTraining(local_epochs=2), log_every_epoch=False, **cfg_keys)
    pairs, dicts = _model(), _model()
    want = train(pairs, DataLoader(base, batch_size=8), cfg)
    extra = {"coarse_label": 0, "id": "a"}  # unrelated keys are ignored
    got = train(dicts, DataLoader(_DictData(base, x_key, y_key, extra), batch_size=8), cfg)
    assert got == want
    _assert_same(dicts, pairs, rtol=0, atol=0)
    ev = evaluate(
        dicts,
        DataLoader(_DictData(base, x_key, y_key, extra), batch_size=8),
        input_key=cfg.input_key,
        target_key=cfg.target_key,
    )
    assert ev == evaluate(pairs, DataLoader(base, batch_size=8))


def test_dict_batch_errors_name_the_keys_and_the_setting() -> None:
    base = _data(8)
    cfg = TrainConfig(log_every_epoch=False)

    def run(x_key: str, y_key: str, config: TrainConfig, **extra: Any) -> None:
        train(_model(), DataLoader(_DictData(base, x_key, y_key, extra), batch_size=8), config)

    with pytest.raises(
        ValueError,
        match=r"several of the known keys .*'label', 'labels'.*"
        r"Set TrainConfig\.target_key",
    ):
        run("img", "label", cfg, labels=torch.zeros(()))
    with pytest.raises(
        ValueError,
        match=r"cannot tell the input key .* none of the known keys.*"
        r"batch has keys \['feat', 'label'\]\. Set TrainConfig\.input_key",
    ):
        run("feat", "label", cfg)
    with pytest.raises(
        ValueError,
        match=r"TrainConfig\.input_key='pixels' is not a key of the "
        r"batch; found keys \['img', 'label'\]",
    ):
        run("img", "label", with_(cfg, input_key="pixels"))
    with pytest.raises(ValueError, match=r"pairs or dicts, got list of length 3"):
        train(_model(), DataLoader(TensorDataset(*base[:], base[:][1]), batch_size=8), cfg)
    with pytest.raises(ValueError, match=r"TrainConfig\.max_grad_norm=0\.0: expected a finite"):
        TrainConfig(max_grad_norm=0.0)


# -- finiteness without per-step host reads ------------------------------------------------------


class _HostReads:
    """Counts Tensor.item / __bool__ / __int__ / __float__ / tolist calls (host syncs)."""

    names = ("item", "__bool__", "__int__", "__float__", "tolist")

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> _HostReads:
        self.saved = {n: getattr(torch.Tensor, n) for n in self.names}
        for name, fn in self.saved.items():

            def counted(t: torch.Tensor, *a: Any, _fn: Any = fn, **k: Any) -> Any:
                self.count += 1
                return _fn(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)


def test_training_reads_the_device_only_every_32_steps() -> None:
    model, loader = _model(), DataLoader(_data(96), batch_size=1)  # 96 steps
    with _HostReads() as reads:
        train(model, loader, TrainConfig(log_every_epoch=False))
    # checks after steps 32, 64, 96 and at the epoch end, 3 reads for the TrainResult, one
    # for the client rules' report (ω above τ in the one sharded layer), one for whether
    # ClipLR scales any column of that ω (once per value of ω, and only where ω is in host
    # memory: no device wait), and the DataLoader's own base seed (a CPU generator)
    assert reads.count == 96 // 32 + 1 + 3 + 1 + 1 + 1


def _broken() -> nn.Module:
    model = _model()
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    return model


def test_non_finite_loss_raises_with_remedies_that_apply() -> None:
    loader = DataLoader(_data(40), batch_size=1)
    on = TrainConfig(recipe=LocalTraining(clip_lr_tau=10.0), log_every_epoch=False)
    with pytest.raises(
        FloatingPointError,
        match=r"became nan in epoch 1 \(found after step 32; "
        r"checked every 32 steps\).*lower the learning rate \(lr\), add "
        r"normalization layers to the model, take the dense model's steps on the factors "
        r"\(factor_step='dense'\) or set TrainConfig\.max_grad_norm",
    ) as info:
        train(_broken(), loader, on)
    assert str(info.value).startswith("Training diverged: ")  # how the server counts it
    assert "ClipLR" not in str(info.value)  # already on: not a remedy
    with pytest.raises(FloatingPointError) as info:
        train(_broken(), loader, with_(on, factor_step="dense"))
    assert "factor_step" not in str(info.value)  # already on: not a remedy
    off = with_(on, clip_lr_tau=None, max_grad_norm=1.0)
    with pytest.raises(
        FloatingPointError,
        match=r"lower max_grad_norm \(now 1\.0\) or enable "
        r"ClipLR \(clip_lr_tau\)\.",
    ):
        train(_broken(), DataLoader(_data(4), batch_size=4), off)


# -- torch.compile -----------------------------------------------------------------------------


class _Stream(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(zip(*self.base[:], strict=True))


def test_compiled_training_matches_eager_on_cpu() -> None:
    try:
        import torch._inductor
    except ImportError as err:  # pragma: no cover - inductor ships with torch
        pytest.skip(f"torch.compile's inductor backend cannot be imported here: {err}")
    # lr 0.02: at 0.05 this model (ω up to 30) is near divergence, where float32 rounding grows
    cfg = TrainConfig(recipe=LocalTraining(local_epochs=2, lr=0.02, frobenius_decay=1e-2),
                      max_grad_norm=5.0, log_every_epoch=False)
    eager, compiled = _model(torch.float32), _model(torch.float32)
    loader = DataLoader(_data(32, torch.float32), batch_size=8)
    want = train(eager, loader, cfg)
    got = train(compiled, loader, with_(cfg, compile=True))
    _assert_same(compiled, eager, rtol=1e-5, atol=1e-6)  # float32 rounding
    assert got.loss == pytest.approx(want.loss, rel=1e-5)
    assert got.accuracy == want.accuracy


def test_compiled_training_of_several_models_in_one_process_matches_eager() -> None:
    """A simulation trains many sub-models of one structure in one process (clients, rounds):
    every compiled call after the first reuses the compiled code and still matches eager.
    (Compiling the optimizer step made Dynamo raise on the second model, torch 2.14.)"""
    try:
        import torch._inductor
    except ImportError as err:  # pragma: no cover - inductor ships with torch
        pytest.skip(f"torch.compile's inductor backend cannot be imported here: {err}")
    loader = DataLoader(_data(20, torch.float32), batch_size=8)  # batches of 8, 8 and 4
    for round_, lr in enumerate((0.05, 0.02, 0.08)):
        eager, compiled = _model(torch.float32), _model(torch.float32)
        with torch.no_grad():  # another client's weights each time
            for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
                a.add_(0.1 * round_)
                b.add_(0.1 * round_)
        cfg = TrainConfig(recipe=LocalTraining(local_epochs=2, lr=lr, frobenius_decay=1e-2),
                          log_every_epoch=False)
        want = train(eager, loader, cfg)
        got = train(compiled, loader, with_(cfg, compile=True))
        # float32 rounding of inductor's fused kernels: up to 2e-6 on entries of size ~3
        # after six steps (an AVX-512 Intel Xeon), under 1e-6 elsewhere
        _assert_same(compiled, eager, rtol=1e-5, atol=1e-5)
        assert got.loss == pytest.approx(want.loss, rel=1e-5), round_


def test_cuda_graph_needs_a_cuda_device() -> None:
    from fedshard.client.train import TrainConfig as _Cfg
    from fedshard.client.train.fast import FastOptions
    from fedshard.client.train.fast import TrainStep as _Step

    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"cuda_graph=True needs the model on a CUDA device"):
        _Step(model, _Cfg(fast=FastOptions(cuda_graph=True)))


def _conv_model() -> nn.Sequential:
    g = _gen(7)
    d = torch.float64
    conv = SpectralConv2d(
        torch.randn(4, 5, generator=g, dtype=d) / 2,
        torch.randn(3 * 9, 5, generator=g, dtype=d) / 3,
        torch.tensor([1.0, 3.0, 8.0, 15.0, 30.0], dtype=d), torch.zeros(4, dtype=d),
        in_channels=3, kernel_size=3, padding=1,
    )
    head = nn.Linear(4 * 6 * 6, 3).to(d)
    with torch.no_grad():
        head.weight.copy_(torch.randn(3, 144, generator=g, dtype=d) / 12)
        head.bias.zero_()
    return nn.Sequential(conv, nn.ReLU(), nn.Flatten(), head)


@pytest.mark.parametrize("option, value, error", [
    ("pad_terms", 8, r"pad_terms=0: expected an int ≥ 1"),
    ("merge_terms", True, r"merge_terms=0: expected True or False"),
])
def test_conv_layout_options_train_the_same_factors(option: str, value: object,
                                                    error: str) -> None:
    """FastOptions.pad_terms=8 (the 5-term conv padded to 8 channels) and merge_terms (one
    convolution with U diag(ω) Vᵀ) for a whole local training (Frobenius decay, ClipLR with ω
    up to 30, momentum): float64 factors as the plain two thin convolutions give."""
    g = _gen(8)
    data = TensorDataset(torch.randn(20, 3, 6, 6, generator=g, dtype=torch.float64),
                         torch.randint(0, 3, (20,), generator=g))
    cfg = TrainConfig(recipe=LocalTraining(local_epochs=2, lr=0.01, frobenius_decay=1e-2),
                      log_every_epoch=False)
    plain, other = _conv_model(), _conv_model()
    want = train(plain, DataLoader(data, batch_size=8), cfg)
    got = train(other, DataLoader(data, batch_size=8), with_(cfg, **{option: value}))
    attribute = {"pad_terms": "pad_terms_to", "merge_terms": "merge_terms"}[option]
    assert getattr(other[0], attribute) == value
    assert conv_form(plain[0]) == (1, False)  # CPU default: off
    assert other[0].u.shape == (4, 5)  # the parameters keep their n columns
    _assert_same(other, plain)
    assert got.loss == pytest.approx(want.loss, rel=1e-12)
    with pytest.raises(ValueError, match=error):
        FastOptions(**{option: 0})  # type: ignore[arg-type]


def test_the_cpu_optimizer_is_fused_and_steps_as_torchs_default_sgd() -> None:
    """On a CPU build_optimizer's SGD is torch's fused kernel; over 30 steps, with weight
    decay on the dense group and a parameter whose first gradient comes at step 10 (the
    fused kernel alone would find no momentum buffer for it), it moves every parameter as
    torch's default SGD does, to float64 rounding."""
    def two_layers() -> nn.Sequential:
        g = _gen(3)
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        return model

    model, reference = two_layers(), two_layers()
    cfg = TrainConfig(recipe=LocalTraining(lr=0.05, momentum=0.9, weight_decay=1e-3))
    opt = build_optimizer(model, cfg)
    assert all(group["fused"] for group in opt.param_groups)
    plain = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    assert not plain.param_groups[0]["fused"]
    g = _gen(4)
    for step in range(30):
        x = torch.randn(6, 5, generator=g, dtype=torch.float64)
        t = torch.randint(0, 3, (6,), generator=g)
        for net, optimizer in ((model, opt), (reference, plain)):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(x), t).backward()
            if step < 10:  # the last layer's bias gets its first gradient at step 10
                net[2].bias.grad = None
            optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    assert not torch.equal(model[2].bias, two_layers()[2].bias)  # it did move


def test_fused_and_default_sgd_train_the_same_sharded_model_in_float64(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The proof that the fused kernel only moved rounding: fedshard's own loop (Frobenius
    decay and ClipLR on, momentum, weight decay, two epochs) trains a float64 sharded model
    with the fused kernel and with torch's default to the same parameters to 1e-12."""
    import fedshard.client.train.optim as optim

    x, t = _data()[:]
    cfg = TrainConfig(recipe=LocalTraining(local_epochs=2, lr=0.05, momentum=0.9,
                                           weight_decay=1e-3, frobenius_decay=1e-2,
                                           clip_lr_tau=2.0),
                      torch_seed=5, log_every_epoch=False)
    fused = _model()
    train(fused, DataLoader(TensorDataset(x, t), batch_size=8), cfg)
    monkeypatch.setattr(optim, "sgd_kernel", lambda params: {})
    default = _model()
    opt = build_optimizer(default, cfg)
    assert not any(group["fused"] for group in opt.param_groups)
    train(default, DataLoader(TensorDataset(x, t), batch_size=8), cfg)
    worst = 0.0
    for (name, a), (_, b) in zip(fused.state_dict().items(), default.state_dict().items(),
                                 strict=True):
        assert a.dtype == torch.float64, name
        worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)))
    assert worst < 1e-12, worst  # rounding moved, nothing else
