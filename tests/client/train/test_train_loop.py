"""Local training: Frobenius decay, ClipLR, momentum, determinism, metrics (vs numpy by hand)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainconf import with_

from fedshard.client.train import TrainConfig, build_optimizer, evaluate, frobenius_penalty, train
from fedshard.models import resnet18
from fedshard.settings import LocalTraining
from fedshard.spectral import SpectralConv2d, SpectralLayer, SpectralLinear, shard_model


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spectral_linear(c_in: int, c_out: int, omega: list[float], seed: int, bias: bool = True):
    g = _gen(seed)
    n = len(omega)
    return SpectralLinear(
        torch.randn(c_out, n, generator=g, dtype=torch.float64) / 2,
        torch.randn(c_in, n, generator=g, dtype=torch.float64) / 2,
        torch.tensor(omega, dtype=torch.float64),
        torch.randn(c_out, generator=g, dtype=torch.float64) if bias else None,
    )


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _reference_steps(
    u: np.ndarray,
    v: np.ndarray,
    b: np.ndarray,
    omega: np.ndarray,
    x: np.ndarray,
    t: np.ndarray,
    cfg: TrainConfig,
    steps: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SGD + momentum + Frobenius decay + ClipLR + weight decay on b, written out by hand."""
    u, v, b = u.copy(), v.copy(), b.copy()
    bufs: dict[str, np.ndarray] = {}
    r = cfg.recipe
    tau = np.inf if r.clip_lr_tau is None else r.clip_lr_tau
    scale = np.minimum(1.0, tau / omega)  # (n,)
    for _ in range(steps):
        y = x @ v @ np.diag(omega) @ u.T + b  # (B, out)
        d = _softmax(y)
        d[np.arange(len(t)), t] -= 1.0
        d /= len(t)  # dL/dy of the mean cross-entropy
        g_w = d.T @ x  # dL/dŴ, (out, in)
        w_hat = u @ np.diag(omega) @ v.T
        # ∂/∂U γ‖UΩVᵀ‖² = 2γ (UΩVᵀ) V Ω ; ∂/∂V = 2γ (UΩVᵀ)ᵀ U Ω
        g_u = (g_w @ v + 2 * r.frobenius_decay * w_hat @ v) * omega
        g_v = (g_w.T @ u + 2 * r.frobenius_decay * w_hat.T @ u) * omega
        grads = {"u": g_u * scale, "v": g_v * scale, "b": d.sum(0) + r.weight_decay * b}
        params = {"u": u, "v": v, "b": b}
        for key, grad in grads.items():
            bufs[key] = grad if key not in bufs else r.momentum * bufs[key] + grad
            params[key] -= cfg.lr * bufs[key]
    return u, v, b


@pytest.mark.parametrize("clip_lr_tau", [10.0, None])
def test_two_training_steps_match_hand_computation(clip_lr_tau: float | None) -> None:
    # ω = 50 > τ = 10 clips column 1 by 0.2; ω = 1 and ω = 4 are left alone.
    omega = [1.0, 50.0, 4.0]
    layer = _spectral_linear(5, 4, omega, seed=0)
    g = _gen(1)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    t = torch.randint(0, 4, (6,), generator=g)
    cfg = TrainConfig(recipe=LocalTraining(local_epochs=2, lr=0.1, momentum=0.9,
                                           frobenius_decay=0.05, clip_lr_tau=clip_lr_tau,
                                           weight_decay=0.3), log_every_epoch=False)
    start = [p.detach().numpy().copy() for p in (layer.u, layer.v,
                                                 layer.bias)]  # type: ignore[union-attr]
    expected = _reference_steps(*start, np.array(omega), x.numpy(), t.numpy(), cfg, steps=2)
    loader = DataLoader(TensorDataset(x, t), batch_size=6, shuffle=False)
    result = train(layer, loader, cfg)
    for got, want in zip((layer.u, layer.v, layer.bias), expected, strict=True):
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-10, atol=1e-12)
    assert result.num_examples == 6


def test_frobenius_penalty_equals_explicit_norm() -> None:
    g = _gen(2)
    conv = SpectralConv2d(
        torch.randn(6, 3, generator=g, dtype=torch.float64),
        torch.randn(4 * 9, 3, generator=g, dtype=torch.float64),
        torch.tensor([1.0, 7.0, 0.5], dtype=torch.float64),
        in_channels=4,
        kernel_size=3,
    )
    lin = _spectral_linear(8, 5, [2.0, 3.0], seed=3)
    model = nn.Sequential(conv, nn.Flatten(), nn.Linear(6, 8).double(), lin)
    explicit = 0.0
    for layer in (conv, lin):
        u, v, w = (t.detach().numpy() for t in (layer.u, layer.v, layer.omega))
        explicit += float(np.sum((u @ np.diag(w) @ v.T) ** 2))
    penalty = frobenius_penalty(model)
    assert penalty.requires_grad
    np.testing.assert_allclose(penalty.item(), explicit, rtol=1e-12)
    assert frobenius_penalty(nn.Linear(3, 3)).item() == 0.0


def test_factors_get_no_weight_decay_dense_parameters_do() -> None:
    lin = _spectral_linear(4, 4, [1.0, 2.0], seed=4)
    model = nn.Sequential(nn.Linear(3, 4).double(), lin)
    opt = build_optimizer(model, TrainConfig(recipe=LocalTraining(weight_decay=0.01),
                                             log_every_epoch=False))
    factor_group, dense_group = opt.param_groups
    assert factor_group["weight_decay"] == 0.0
    assert {id(p) for p in factor_group["params"]} == {id(lin.u), id(lin.v)}
    assert dense_group["weight_decay"] == 0.01
    assert len(dense_group["params"]) == 3  # Linear weight + bias, the spectral layer's bias


def _two_layer(omega: list[float], perm: list[int] | None = None) -> nn.Module:
    layer = _spectral_linear(4, 6, omega, seed=5)
    if perm is not None:
        layer = SpectralLinear(
            layer.u.detach()[:, perm],
            layer.v.detach()[:, perm],
            layer.omega[perm],
            layer.bias.detach() if layer.bias is not None else None,
        )
    head = nn.Linear(6, 3).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(3, 6, generator=_gen(6), dtype=torch.float64))
        head.bias.copy_(torch.randn(3, generator=_gen(7), dtype=torch.float64))
    return nn.Sequential(layer, nn.Tanh(), head)


def _data(n: int = 16, seed: int = 7) -> TensorDataset:
    g = _gen(seed)
    return TensorDataset(
        torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    )


def test_momentum_and_clipping_are_per_term_permutation_equivariant() -> None:
    """Permuting the terms before training permutes the trained factors the same way."""
    omega, perm = [30.0, 1.0, 12.0, 2.0], [2, 0, 3, 1]
    cfg = TrainConfig(recipe=LocalTraining(local_epochs=3, lr=0.05, frobenius_decay=0.01),
                      log_every_epoch=False)
    loader = DataLoader(_data(), batch_size=4, shuffle=False)
    plain, permuted = _two_layer(omega), _two_layer(omega, perm)
    train(plain, loader, cfg)
    train(permuted, loader, cfg)
    for key in ("u", "v"):
        got = getattr(permuted[0], key).detach()
        want = getattr(plain[0], key).detach()[:, perm]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_term_with_zero_gradient_never_moves_and_keeps_zero_momentum() -> None:
    model = _two_layer([1.0, 30.0, 3.0])
    with torch.no_grad():  # term 1 contributes nothing, so its gradient is exactly zero
        model[0].u[:, 1] = 0.0
        model[0].v[:, 1] = 0.0
    cfg = TrainConfig(recipe=LocalTraining(local_epochs=2, lr=0.1, frobenius_decay=0.01),
                      log_every_epoch=False)
    opt = build_optimizer(model, cfg)
    for x, t in DataLoader(_data(), batch_size=4):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), t) + 0.01 * frobenius_penalty(model)
        loss.backward()
        opt.step()
    layer = model[0]
    assert isinstance(layer, SpectralLayer)
    for factor in (layer.u, layer.v):
        buf = opt.state[factor]["momentum_buffer"]
        assert torch.all(buf[:, 1] == 0) and torch.all(factor[:, 1] == 0)
        assert buf[:, [0, 2]].abs().min() > 0


class _Dropper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _two_layer([1.0, 2.0, 3.0])
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.drop(x))


def test_training_is_deterministic_given_seed_and_leaves_global_rng_alone() -> None:
    dataset = _data(24)
    cfg = TrainConfig(recipe=LocalTraining(local_epochs=2, lr=0.05), torch_seed=11,
                      log_every_epoch=False)

    def run(config: TrainConfig) -> dict[str, torch.Tensor]:
        model = _Dropper()
        loader = DataLoader(dataset, batch_size=5, shuffle=True)  # global-RNG shuffling
        rng_before = torch.get_rng_state()
        train(model, loader, config)
        assert torch.equal(torch.get_rng_state(), rng_before)
        return model.state_dict()

    first, second = run(cfg), run(cfg)
    other = run(dataclasses.replace(cfg, torch_seed=12))
    for key in first:
        assert torch.equal(first[key], second[key]), key
    assert not torch.equal(first["body.0.u"], other["body.0.u"])


def test_metrics_match_manual_computation_for_sequence_outputs() -> None:
    """(B, T, C) logits with (B, T) targets; -100 targets are ignored."""
    vocab = 5
    model = nn.Sequential(nn.Embedding(vocab, 6), nn.Linear(6, vocab)).double()
    g = _gen(8)
    tokens = torch.randint(0, vocab, (7, 4), generator=g)
    targets = torch.randint(0, vocab, (7, 4), generator=g)
    targets[0, :2] = -100
    result = evaluate(model, DataLoader(TensorDataset(tokens, targets), batch_size=3))
    with torch.no_grad():
        logits = model(tokens).numpy().reshape(-1, vocab)
    flat = targets.reshape(-1).numpy()
    keep = flat != -100
    logp = np.log(_softmax(logits))
    np.testing.assert_allclose(result.loss, -logp[keep, flat[keep]].mean(), rtol=1e-12)
    assert result.accuracy == pytest.approx((logits.argmax(1) == flat)[keep].mean())
    assert result.num_examples == 7


def test_train_reports_mean_loss_over_all_examples_and_learns() -> None:
    g = _gen(9)
    x = torch.randn(64, 4, generator=g, dtype=torch.float64)
    t = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # 3 classes, learnable
    dataset = TensorDataset(x, t)
    model = _two_layer([1.0, 2.0, 4.0])
    before = evaluate(model, DataLoader(dataset, batch_size=64))
    cfg = TrainConfig(recipe=LocalTraining(local_epochs=20, lr=0.05), log_every_epoch=False)
    result = train(model, DataLoader(dataset, batch_size=8, shuffle=False), cfg)
    after = evaluate(model, DataLoader(dataset, batch_size=64))
    assert result.num_examples == 64
    assert after.loss < 0.7 * before.loss
    assert after.accuracy > 0.8
    assert model.training  # train() leaves train mode; evaluate() restores it


def test_channels_last_training_matches_default_layout() -> None:
    dense = resnet18(num_classes=3, width=8, seed=0).double()
    layers = {"layer1.0.conv1": [0, 2, 4], "layer3.0.downsample.0": [1, 5]}
    omegas = {name: torch.full((len(i),), 12.0, dtype=torch.float64) for name, i in layers.items()}
    g = _gen(10)
    images = torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64)
    data = TensorDataset(images, torch.randint(0, 3, (8,), generator=g))
    results = []
    for channels_last in (False, True):
        sub, _ = shard_model(dense, layers, omegas)
        cfg = TrainConfig(recipe=LocalTraining(local_epochs=2, lr=0.05),
                          channels_last=channels_last, log_every_epoch=False)
        train(sub, DataLoader(data, batch_size=4), cfg)
        results.append(sub.state_dict())
    for key, value in results[0].items():
        torch.testing.assert_close(results[1][key], value, rtol=1e-9, atol=1e-11)


def test_train_logs_each_epoch(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="fedshard.client.train.loop")
    train(_two_layer([1.0]), DataLoader(_data(8), batch_size=4),
          TrainConfig(recipe=LocalTraining(local_epochs=2)))
    assert [r.getMessage()[:9] for r in caplog.records] == ["epoch 1/2", "epoch 2/2"]


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("local_epochs", 0, r"LocalTraining.*\n  - local_epochs=0: expected an integer ≥ 1"),
        ("lr", -0.1, r"lr=-0\.1: expected a finite number ≥ 1\.2e-38"),
        ("momentum", 1.0, r"momentum=1\.0: expected in \[0, 1\)"),
        ("frobenius_decay", -1.0, r"frobenius_decay=-1\.0: expected a finite number ≥ 0"),
        ("clip_lr_tau", 0.0, r"clip_lr_tau=0\.0: expected τ ≥ 1 \(the paper uses 10\), or None"),
        ("clip_lr_tau", 0.5, r"clip_lr_tau=0\.5: expected τ ≥ 1"),
        ("weight_decay", float("nan"), r"weight_decay=nan"),
        ("device", "warp-drive", r"device='warp-drive': expected a torch device"),
        ("torch_seed", 1.5, r"torch_seed=1\.5: expected an int"),
    ],
)
def test_train_config_validation(field: str, value: object, pattern: str) -> None:
    """The recipe's fields by the server's rules (fedshard.settings), the node's own here."""
    with pytest.raises(ValueError, match=pattern):
        with_(TrainConfig(), **{field: value})


def test_training_errors() -> None:
    cfg = TrainConfig(log_every_epoch=False)
    empty = DataLoader(TensorDataset(torch.ones(0, 4), torch.ones(0)), batch_size=2)
    with pytest.raises(ValueError, match="yielded no batches; nothing was trained"):
        train(_two_layer([1.0]), empty, cfg)
    broken = _two_layer([1.0])
    with torch.no_grad():
        broken[2].weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="training loss became nan in epoch 1"):
        train(broken, DataLoader(_data(4), batch_size=4), cfg)
    bad_targets = TensorDataset(torch.ones(4, 4, dtype=torch.float64), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"logits of shape \(4, 3\) do not match targets"):
        evaluate(_two_layer([1.0]), DataLoader(bad_targets, batch_size=4))


def test_on_device_leaves_a_model_already_there_alone() -> None:
    """``on_device``: a model whose tensors are all on the device is returned as it is (no
    ``Module.to``); one with a tensor elsewhere is moved by ``to``."""
    from unittest import mock

    from torch import nn

    from fedshard.client.train.loop import on_device

    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    params = [id(p) for p in model.parameters()]
    with mock.patch.object(nn.Module, "to", side_effect=AssertionError("moved")):
        assert on_device(model, torch.device("cpu")) is model
    assert [id(p) for p in model.parameters()] == params
    with mock.patch.object(nn.Module, "to", return_value="moved") as to:
        assert on_device(model, torch.device("meta")) == "moved"
    to.assert_called_once_with(torch.device("meta"))
