"""``factor-step = "dense"``: each factor step moves ``W = U Ω Vᵀ`` as a dense SGD step would,
checked against references computed here (numpy projections, a dense layer, a numpy step),
with any torch optimizer the rules of ``receive()`` are attached to and fedshard's loop;
switched off, the paper's
step is unchanged; and at keep ratio 1 the dense model's lr no longer diverges."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flower_grid import InProcessGrid
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedshard import (
    Cohort,
    LocalTraining,
    NodePolicy,
    Sharding,
    SpectralSharding,
    handle_query,
    receive,
)
from fedshard.app.config import ConfigError, RunConfig
from fedshard.client.train import (
    ClientRules,
    TrainConfig,
    build_optimizer,
    dense_factor_gradient,
    train,
)
from fedshard.protocol import TrainSettings
from fedshard.settings import SettingsError
from fedshard.spectral import SpectralConv2d, SpectralLinear


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _orthonormal_step(w: np.ndarray, g: np.ndarray, rank: int) -> np.ndarray:
    """The dense step ``g`` projected onto the tangent space of rank-``rank`` matrices at
    ``w`` (from ``w``'s SVD, in numpy): ``P_U g + g P_V - P_U g P_V``."""
    left, _, right_t = np.linalg.svd(w)
    pu = left[:, :rank] @ left[:, :rank].T
    pv = right_t[:rank].T @ right_t[:rank]
    return pu @ g + g @ pv - pu @ g @ pv


def _layer(rows: int, cols: int, rank: int, seed: int, omega: bool = True) -> SpectralLinear:
    g = torch.Generator().manual_seed(seed)
    dense = nn.Linear(cols, rows).double()
    with torch.no_grad():  # singular values well above 1, as in a trained layer
        dense.weight.copy_(3 * torch.randn(rows, cols, generator=g, dtype=torch.float64))
        dense.bias.copy_(torch.randn(rows, generator=g, dtype=torch.float64))
    w = torch.rand(rank, generator=g, dtype=torch.float64) * 3 + 0.5 if omega else None
    return SpectralLinear.from_dense(dense, list(range(rank)), w)


def _dense_step(opt: torch.optim.Optimizer, model: nn.Module, damping: float = 1e-3
                ) -> ClientRules:
    """The dense factor step alone (no decay, no ClipLR) on ``opt``."""
    rules = ClientRules([m for m in model.modules() if hasattr(m, "omega")],
                        factor_step="dense", damping=damping)
    rules.attach(opt)
    return rules


def _w_change(layer: SpectralLinear, x: torch.Tensor, target: torch.Tensor, lr: float,
              dense_step: bool, damping: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """One SGD step on the factors; returns (ΔW, ∂L/∂W at the start)."""
    w0 = layer.dense_weight().numpy()
    # ∂L/∂W of the same loss on the dense layer with weight W (the reference gradient)
    wt = torch.tensor(w0, requires_grad=True)
    F.mse_loss(F.linear(x, wt, layer.bias.detach()), target, reduction="sum").backward()
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    if dense_step:
        _dense_step(opt, layer, damping=damping)
    opt.zero_grad()
    F.mse_loss(layer(x), target, reduction="sum").backward()
    opt.step()
    return layer.dense_weight().numpy() - w0, wt.grad.numpy()


def _data(cols: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(16, cols, generator=g, dtype=torch.float64),
            torch.randn(16, rows, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("rows,cols,rank", [(7, 5, 3), (5, 9, 2), (6, 6, 4)])
def test_w_step_is_the_projected_dense_step_to_first_order(rows: int, cols: int,
                                                           rank: int) -> None:
    lr = 1e-7
    layer = _layer(rows, cols, rank, seed=rows * cols)
    x, y = _data(cols, rows, seed=1)
    delta, grad = _w_change(layer, x, y, lr, dense_step=True)
    w0 = layer.dense_weight().numpy() - delta
    expected = -lr * _orthonormal_step(w0, grad, rank)  # independent of λ and ω
    np.testing.assert_allclose(delta, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    # the paper's step is not: its W step scales with λ and ω (here several times larger)
    layer = _layer(rows, cols, rank, seed=rows * cols)
    plain, _ = _w_change(layer, x, y, lr, dense_step=False)
    assert np.linalg.norm(plain) > 3 * np.linalg.norm(expected)


@pytest.mark.parametrize("rows,cols", [(7, 5), (5, 9), (6, 6)])
def test_with_every_term_the_w_step_is_the_dense_sgd_step(rows: int, cols: int) -> None:
    lr, rank = 1e-7, min(rows, cols)
    x, y = _data(cols, rows, seed=2)
    layer = _layer(rows, cols, rank, seed=3, omega=False)  # keep ratio 1, ω = 1
    delta, grad = _w_change(layer, x, y, lr, dense_step=True)
    np.testing.assert_allclose(delta, -lr * grad, rtol=1e-5, atol=1e-6 * lr * np.abs(grad).max())
    # with the default damping (δ = 1e-3) within a few δ of it
    layer = _layer(rows, cols, rank, seed=3, omega=False)
    delta, grad = _w_change(layer, x, y, lr, dense_step=True, damping=1e-3)
    assert np.linalg.norm(delta + lr * grad) < 5e-3 * np.linalg.norm(lr * grad)


def test_convolution_with_every_term_steps_as_the_dense_convolution() -> None:
    g = torch.Generator().manual_seed(4)
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    x = torch.randn(2, 3, 5, 5, generator=g, dtype=torch.float64)
    sub = SpectralConv2d.from_dense(conv, list(range(4)))
    ref = copy.deepcopy(conv)
    w0 = ref.weight.detach().reshape(4, -1).numpy().copy()
    lr = 1e-7
    for model, hook in ((sub, True), (ref, False)):
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        if hook:
            _dense_step(opt, model, damping=0.0)
        model(x).square().sum().backward()
        opt.step()
    dense_change = ref.weight.detach().reshape(4, -1).numpy() - w0
    np.testing.assert_allclose(sub.dense_weight().numpy() - w0, dense_change, rtol=1e-4,
                               atol=1e-5 * np.abs(dense_change).max())


def test_one_step_equals_the_formula_computed_with_numpy() -> None:
    """u' = u - lr·(I - ½P_A) g (BᵀB + εI)⁻¹ with A = UΩ, B = VΩ, P_A = A(AᵀA + εI)⁻¹Aᵀ,
    ε = δ·tr(·)/n; momentum and a finite lr: the optimizer's state sees the new gradient."""
    layer = _layer(6, 8, 3, seed=5)
    x, y = _data(8, 6, seed=6)
    u, v, w = (t.detach().numpy().copy() for t in (layer.u, layer.v, layer.omega))
    F.mse_loss(copy.deepcopy(layer)(x), y, reduction="sum").backward()
    bare = copy.deepcopy(layer)
    F.mse_loss(bare(x), y, reduction="sum").backward()
    gu, gv = bare.u.grad.numpy(), bare.v.grad.numpy()

    def inv(m: np.ndarray) -> np.ndarray:
        gram = m.T @ m
        return np.linalg.inv(gram + 1e-3 * np.trace(gram) / len(gram) * np.eye(len(gram)))

    a, b = u * w, v * w
    exp_u = (np.eye(6) - 0.5 * a @ inv(a) @ a.T) @ gu @ inv(b)
    exp_v = (np.eye(8) - 0.5 * b @ inv(b) @ b.T) @ gv @ inv(a)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05, momentum=0.9)
    _dense_step(opt, layer)
    F.mse_loss(layer(x), y, reduction="sum").backward()
    opt.step()
    np.testing.assert_allclose(layer.u.detach().numpy(), u - 0.05 * exp_u, rtol=1e-10)
    np.testing.assert_allclose(layer.v.detach().numpy(), v - 0.05 * exp_v, rtol=1e-10)
    np.testing.assert_allclose(opt.state[layer.u]["momentum_buffer"].numpy(), exp_u,
                               rtol=1e-10)
    np.testing.assert_allclose(dense_factor_gradient(torch.tensor(gu), bare.u, bare.v,
                                                     bare.omega).numpy(), exp_u, rtol=1e-10)


def test_step_with_a_closure_is_the_step_after_backward() -> None:
    """build_optimizer's SGD with the dense step and ClipLR: ``step(closure)`` moves the
    factors as ``backward(); step()`` does (the closure's gradients are the transformed ones)."""
    x, y = _data(8, 6, seed=7)
    cfg = TrainConfig(recipe=LocalTraining(lr=0.05, factor_step="dense", clip_lr_tau=1.5))
    ends = []
    for use_closure in (False, True):
        layer = _layer(6, 8, 3, seed=8)
        opt = build_optimizer(layer, cfg)

        def closure(model: nn.Module = layer, o: torch.optim.Optimizer = opt) -> torch.Tensor:
            o.zero_grad()
            loss = F.mse_loss(model(x), y, reduction="sum")
            loss.backward()
            return loss

        for _ in range(3):
            if use_closure:
                opt.step(closure)
            else:
                closure()
                opt.step()
        ends.append(layer.dense_weight().numpy())
    np.testing.assert_allclose(ends[1], ends[0], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- receive()
def net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                             nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (32,), generator=g)
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]


def message(factor_step: str, method: str = "unbiased", keep_ratio: float = 0.5,
            model: nn.Module | None = None, lr: float = 0.1, gamma: float = 0.05,
            tau: float | None = 2.0, config: ConfigRecord | None = None) -> Message:
    """A real train message from the strategy (Unbiased r = 0.5 by default: ω ≠ 1)."""
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: object) -> Message:
        return handle_query(msg, keep_ratio)

    model = model if model is not None else net()
    s = SpectralSharding(sharded_layers=["2", "4"], sharding=Sharding(method=method),
                         training=LocalTraining(lr=lr, momentum=0.9, frobenius_decay=gamma,
                                                clip_lr_tau=tau, factor_step=factor_step),
                         num_rounds=2, seed=3,
                         cohort=Cohort(min_train_nodes=1, min_available_nodes=1),
                         nodes=NodePolicy(query_timeout=5, node_wait_timeout=5))
    return next(iter(s.configure_train(1, ArrayRecord(model.float().state_dict()),
                                       config or ConfigRecord(), InProcessGrid(app, [{}]))))


def user_loop(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    for x, y in batches():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_plain_sgd_loop_after_receive_trains_as_fedshards_loop() -> None:
    msg = message("dense")
    hooked = receive(msg, net())
    assert hooked.settings.factor_step == "dense"
    opt = torch.optim.SGD(hooked.model.parameters(), lr=hooked.settings.lr, momentum=0.9)
    hooked.rules.attach(opt)
    mine = user_loop(hooked.model, opt)
    bare = receive(msg, net())
    loader = DataLoader(TensorDataset(torch.cat([x for x, _ in batches()]),
                                      torch.cat([y for _, y in batches()])), batch_size=8)
    cfg = bare.train_config()
    assert cfg.recipe.factor_step == "dense"
    train(bare.model, loader, cfg)  # fedshard's loop: FD, the dense step, ClipLR, SGD-m
    for key, value in bare.model.state_dict().items():
        torch.testing.assert_close(mine[key], value, rtol=1e-11, atol=1e-12, msg=key)
    # ... and the option did something: the paper's step ends elsewhere
    paper = receive(message("plain"), net())
    opt = torch.optim.SGD(paper.model.parameters(), lr=0.1, momentum=0.9)
    paper.rules.attach(opt)
    theirs = user_loop(paper.model, opt)
    assert not torch.allclose(theirs["2.u"], mine["2.u"], rtol=1e-4, atol=1e-6)


def _rule_gradient(layer: nn.Module, dense: bool, gamma: float = 0.05) -> np.ndarray:
    """u's gradient as the rules give it to the step (numpy, from ``layer.u.grad``): plus
    Frobenius decay, then the dense transform if asked."""
    u, v, w = (layer.u.detach().numpy(), layer.v.detach().numpy(), layer.omega.numpy())
    g = layer.u.grad.numpy() + 2 * gamma * u @ (np.outer(w, w) * (v.T @ v))
    if dense:
        g = dense_factor_gradient(torch.tensor(g), layer.u, layer.v, layer.omega).numpy()
    return g


def _clip(layer: nn.Module, tau: float = 2.0) -> np.ndarray:
    return np.minimum(1, tau / layer.omega.numpy())  # ClipLR's per-column scale of the move


def test_adam_steps_with_the_transformed_gradient() -> None:
    """Any optimizer the rules are attached to applies them: Adam's step on the received
    sub-model is Adam's step on the gradient the rules give (numpy: decay, the dense
    transform), each column's move scaled by ClipLR's min(1, τ/ω_i)."""
    msg = message("dense")
    hooked = receive(msg, net())
    bare = receive(msg, net())
    x, y = batches()[0]
    F.cross_entropy(bare.model(x), y).backward()
    g = _rule_gradient(bare.model[2], dense=True)
    opt = torch.optim.Adam(hooked.model.parameters(), lr=1e-3)
    hooked.rules.attach(opt)
    F.cross_entropy(hooked.model(x), y).backward()
    before = hooked.model[2].u.detach().clone()
    opt.step()
    start = before.clone()
    ref = torch.optim.Adam([before.requires_grad_()], lr=1e-3)
    before.grad = torch.tensor(g)
    ref.step()
    want = start + torch.tensor(_clip(bare.model[2])) * (before.detach() - start)
    torch.testing.assert_close(hooked.model[2].u.detach(), want, rtol=1e-12, atol=1e-14)
    assert hooked.rules.report().steps == 1


def test_switched_off_the_step_is_the_papers() -> None:
    """One plain SGD step (lr 1, no momentum): with the default recipe the rules move u by the
    paper's gradient (decay, ClipLR); with the rules not attached by the raw one."""
    x, y = batches()[0]
    plain = receive(message("plain"), net())  # the default recipe
    assert LocalTraining().factor_step == "plain"
    off = receive(message("dense"), net())  # its rules stay unattached: none at all
    moves = []
    for shard in (plain, off):
        before = shard.model[2].u.detach().clone()
        opt = torch.optim.SGD(shard.model.parameters(), lr=1.0)
        if shard is plain:
            shard.rules.attach(opt)
        F.cross_entropy(shard.model(x), y).backward()
        raw = shard.model[2].u.grad.clone()
        opt.step()
        moves.append((before - shard.model[2].u.detach(), raw))
    bare = receive(message("plain"), net())
    F.cross_entropy(bare.model(x), y).backward()
    paper = _rule_gradient(bare.model[2], dense=False) * _clip(bare.model[2])
    np.testing.assert_allclose(moves[0][0].numpy(), paper, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(moves[1][0].numpy(), moves[1][1].numpy(), rtol=0, atol=1e-15)
    # build_optimizer attaches one set of rules (a pre- and a post-hook) when there is
    # something to do, none when γ = 0, τ = None and the step is the paper's
    model = copy.deepcopy(off.model)
    opt = build_optimizer(model, TrainConfig())
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (1, 1)
    opt = build_optimizer(model, TrainConfig(recipe=LocalTraining(factor_step="dense")))
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (1, 1)
    none = LocalTraining(frobenius_decay=0.0, clip_lr_tau=None)
    assert not build_optimizer(model, TrainConfig(recipe=none))._optimizer_step_pre_hooks


def test_the_setting_is_validated_once_and_travels() -> None:
    with pytest.raises(SettingsError, match=r"factor_step='scaled': expected one of "
                                            r"\('plain', 'dense'\)"):
        LocalTraining(factor_step="scaled")
    with pytest.raises(ConfigError, match=r"factor-step='Dense': expected one of"):
        RunConfig.from_mapping({"factor-step": "Dense"})
    assert RunConfig.from_mapping({"factor-step": "dense"}).training.factor_step == "dense"
    with pytest.raises(ValueError, match=r"factor_step='x': expected one of"):
        TrainConfig(recipe=LocalTraining(factor_step="x"))
    settings = TrainSettings.of(LocalTraining(factor_step="dense"), lr=0.1, server_round=1,
                                keep_ratio=0.5, train_seed=1, method="collective")
    record = settings.to_record()
    assert record["factor-step"] == "dense"
    assert TrainSettings.from_record(record).factor_step == "dense"
    del record["factor-step"]  # a server from before the setting: the paper's step
    assert TrainSettings.from_record(record).factor_step == "plain"
    record["factor-step"] = "fast"
    with pytest.raises(ValueError, match=r"factor_step='fast': expected one of"):
        TrainSettings.from_record(record)
    # the user's round config wins over the strategy's recipe, as for lr
    user = message("plain", config=ConfigRecord({"factor-step": "dense"}))
    assert receive(user, net()).settings.factor_step == "dense"
    with pytest.raises(ValueError, match=r"factor-step='fast': expected one of"):
        message("plain", config=ConfigRecord({"factor-step": "fast"}))
    with pytest.raises(ValueError, match=r"damping=-1: expected a finite number ≥ 0"):
        ClientRules([], factor_step="dense", damping=-1)
    with pytest.raises(TypeError, match=r"attach to a torch.optim.Optimizer, got str"):
        ClientRules([], factor_step="dense").attach("sgd")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the dense lr
def test_keep_ratio_1_trains_at_the_dense_lr_with_the_dense_step_only() -> None:
    """A layer with top singular value 5 whose inputs lie along that direction (where a
    trained layer's large singular directions and the loss's curvature meet), trained with
    SGD (momentum 0.9) at a fifth of the dense layer's full-batch stability bound: the dense
    layer converges, its full-rank factorization (keep ratio 1, ω = 1) with the paper's step
    diverges (its step there is 2·5 = 10 times the dense one), and with the dense factor
    step it follows the dense layer."""
    g = torch.Generator().manual_seed(0)
    q_out = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    q_in = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    sigma = torch.tensor([5.0, 1.0, 0.5, 0.3, 0.2, 0.1], dtype=torch.float64)
    teacher = torch.randn(6, 6, generator=g, dtype=torch.float64)
    x = (torch.randn(64, 1, generator=g, dtype=torch.float64) * q_in[:, 0]
         + 0.1 * torch.randn(64, 6, generator=g, dtype=torch.float64))  # (64, 6)
    y = x @ teacher.T
    # MSE's curvature in W: (2 / (B·out)) XᵀX; heavy-ball SGD is stable below 2(1+β)/L
    curvature = torch.linalg.eigvalsh(2 * x.T @ x / x.numel())[-1].item()
    lr = 0.2 * 2 * 1.9 / curvature  # a fifth of the bound (mini-batches curve more)

    def dense() -> nn.Linear:
        layer = nn.Linear(6, 6).double()
        with torch.no_grad():
            layer.weight.copy_(q_out @ torch.diag(sigma) @ q_in.T)
            layer.bias.zero_()
        return layer

    def final_loss(model: nn.Module, dense_step: bool = False) -> float:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)  # a user's loop
        if dense_step:
            _dense_step(opt, model)
        for i in range(100):
            batch = slice(16 * (i % 4), 16 * (i % 4) + 16)
            loss = F.mse_loss(model(x[batch]), y[batch])
            if not torch.isfinite(loss) or loss.item() > 1e8:
                return float("inf")
            opt.zero_grad()
            loss.backward()
            opt.step()
        return F.mse_loss(model(x), y).item()

    reference = final_loss(dense())
    assert reference < 1e-2 * F.mse_loss(dense()(x), y).item()  # the dense lr trains
    assert final_loss(SpectralLinear.from_dense(dense())) == float("inf")  # the paper's step
    ours = final_loss(SpectralLinear.from_dense(dense()), dense_step=True)
    assert ours == pytest.approx(reference, rel=0.2, abs=1e-3)
