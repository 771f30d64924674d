"""SpectralLinear / SpectralConv2d against the dense nn.Linear / nn.Conv2d they factorize."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedshard.spectral import SpectralConv2d, SpectralLinear

# float32 tolerance: the factorized layer sums in a different order than the dense one
# (two skinny products instead of one), so outputs agree to a few float32 ulps of the output
# scale (~1); 1e-5 absolute / relative leaves a 10x margin over what we observe.
F32 = {"rtol": 1e-5, "atol": 1e-5}
F64 = {"rtol": 0.0, "atol": 1e-10}


def _randomize(module: nn.Module, seed: int) -> nn.Module:
    """Overwrite every parameter with N(0, 1/fan) values from a private generator."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            fan = p[0].numel() if p.ndim > 1 else 4
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / fan**0.5)
    return module


def _x(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 100) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize(("c_in", "c_out", "bias"), [(5, 7, True), (7, 5, False), (6, 6, True)])
def test_linear_all_terms_equals_dense(c_in: int, c_out: int, bias: bool) -> None:
    for dtype, tol in ((torch.float64, F64), (torch.float32, F32)):
        dense = _randomize(nn.Linear(c_in, c_out, bias=bias, dtype=dtype), 0)
        spectral = SpectralLinear.from_dense(dense)
        assert spectral.rank == min(c_in, c_out)
        x = _x((3, 4, c_in), dtype)  # extra leading dims as in a transformer
        torch.testing.assert_close(spectral(x), dense(x), **tol)


CONV_CASES = [
    {"stride": 1, "padding": 1, "dilation": 1, "padding_mode": "zeros"},
    {"stride": 2, "padding": 1, "dilation": 1, "padding_mode": "zeros"},
    {"stride": (2, 1), "padding": (2, 0), "dilation": (2, 1), "padding_mode": "zeros"},
    {"stride": 1, "padding": "same", "dilation": 2, "padding_mode": "zeros"},
    {"stride": 1, "padding": 0, "dilation": 1, "padding_mode": "zeros"},
    {"stride": 2, "padding": 1, "dilation": 1, "padding_mode": "reflect"},
    {"stride": 1, "padding": (1, 2), "dilation": 1, "padding_mode": "circular"},
    {"stride": 1, "padding": "same", "dilation": 1, "padding_mode": "replicate"},
]


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize(("c_in", "c_out", "kernel"), [(3, 8, 3), (8, 4, (3, 2)), (6, 6, 1)])
def test_conv_all_terms_equals_dense(
    case: dict[str, object], c_in: int, c_out: int, kernel: int | tuple[int, int]
) -> None:
    for dtype, tol in ((torch.float64, F64), (torch.float32, F32)):
        dense = nn.Conv2d(c_in, c_out, kernel, dtype=dtype, **case)  # type: ignore[arg-type]
        _randomize(dense, 1)
        spectral = SpectralConv2d.from_dense(dense)
        x = _x((2, c_in, 9, 8), dtype)
        torch.testing.assert_close(spectral(x), dense(x), **tol)


def test_conv_subset_of_terms_equals_conv_with_truncated_numpy_weight() -> None:
    dense = _randomize(nn.Conv2d(4, 6, 3, stride=2, padding=1, dtype=torch.float64), 2)
    indices, omega = [3, 0, 5], torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)
    spectral = SpectralConv2d.from_dense(dense, indices, omega)
    # Independent reference: numpy SVD, Σ_j ω_j λ_{I_j} u_{I_j} v_{I_j}^T.
    left, lam, right_h = np.linalg.svd(dense.weight.detach().reshape(6, -1).numpy())
    w_hat = sum(
        w * lam[i] * np.outer(left[:, i], right_h[i])
        for i, w in zip(indices, omega.tolist(), strict=True)
    )
    ref = nn.functional.conv2d(
        _x((2, 4, 7, 7), torch.float64),
        torch.from_numpy(w_hat).reshape(6, 4, 3, 3),
        dense.bias,
        stride=2,
        padding=1,
    )
    torch.testing.assert_close(spectral(_x((2, 4, 7, 7), torch.float64)), ref, **F64)


def test_linear_subset_of_terms_equals_truncated_numpy_weight() -> None:
    dense = _randomize(nn.Linear(8, 5, dtype=torch.float64), 3)
    indices, omega = [4, 1], torch.tensor([3.0, 1.5], dtype=torch.float64)
    spectral = SpectralLinear.from_dense(dense, indices, omega)
    left, lam, right_h = np.linalg.svd(dense.weight.detach().numpy())
    w_hat = 3.0 * lam[4] * np.outer(left[:, 4], right_h[4]) + 1.5 * lam[1] * np.outer(
        left[:, 1], right_h[1]
    )
    x = _x((6, 8), torch.float64)
    ref = x @ torch.from_numpy(w_hat).T + dense.bias
    torch.testing.assert_close(spectral(x), ref, **F64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_to_dense_round_trips(dtype: torch.dtype) -> None:
    tol = F64 if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-6}
    conv = _randomize(
        nn.Conv2d(3, 5, (3, 1), stride=(1, 2), padding=(1, 0), padding_mode="reflect", dtype=dtype),
        4,
    )
    back = SpectralConv2d.from_dense(conv).to_dense()
    assert type(back) is nn.Conv2d
    for attr in ("stride", "padding", "dilation", "padding_mode", "kernel_size", "groups"):
        assert getattr(back, attr) == getattr(conv, attr)
    torch.testing.assert_close(back.weight, conv.weight, **tol)
    torch.testing.assert_close(back.bias, conv.bias)
    linear = _randomize(nn.Linear(4, 6, bias=False, dtype=dtype), 5)
    back_lin = SpectralLinear.from_dense(linear).to_dense()
    assert back_lin.bias is None
    torch.testing.assert_close(back_lin.weight, linear.weight, **tol)


def test_to_dense_includes_omega_and_matches_forward() -> None:
    omega = torch.tensor([4.0, 0.25, 1.0], dtype=torch.float64)
    layer = SpectralLinear.from_dense(
        _randomize(nn.Linear(3, 4, dtype=torch.float64), 6), omega=omega
    )
    x = _x((5, 3), torch.float64)
    torch.testing.assert_close(layer.to_dense()(x), layer(x), **F64)


def test_state_dict_names_and_trainable_set() -> None:
    layer = SpectralConv2d.from_dense(nn.Conv2d(2, 3, 3))
    assert list(layer.state_dict()) == ["u", "v", "bias", "omega"]
    assert {n for n, p in layer.named_parameters() if p.requires_grad} == {"u", "v", "bias"}
    # ω: a frozen parameter, not a buffer (Opacus refuses trainable layers with buffers)
    assert not layer.omega.requires_grad and not list(layer.buffers())
    assert layer.u.shape == (3, 3) and layer.v.shape == (18, 3)
    assert SpectralLinear.from_dense(nn.Linear(2, 3, bias=False)).bias is None


def test_gradients_flow_only_to_u_v_and_bias() -> None:
    layer = SpectralLinear.from_dense(nn.Linear(4, 3))
    layer(torch.ones(2, 4)).sum().backward()
    assert layer.u.grad is not None and layer.v.grad is not None and layer.bias is not None
    assert layer.bias.grad is not None
    assert not layer.omega.requires_grad


def test_from_dense_does_not_alias_or_modify_the_dense_layer() -> None:
    dense = nn.Linear(4, 4)
    before = dense.weight.detach().clone()
    layer = SpectralLinear.from_dense(dense)
    with torch.no_grad():
        assert layer.bias is not None
        layer.bias.add_(1.0)
        layer.u.mul_(2.0)
    torch.testing.assert_close(dense.weight, before, rtol=0, atol=0)
    assert not torch.equal(layer.bias, dense.bias)


def test_errors_are_specific() -> None:
    with pytest.raises(TypeError, match="supports groups=1 only, got a Conv2d with groups=2"):
        SpectralConv2d.from_dense(nn.Conv2d(4, 4, 3, groups=2))
    with pytest.raises(TypeError, match=r"expects an nn\.Conv2d, got ConvTranspose2d"):
        SpectralConv2d.from_dense(nn.ConvTranspose2d(4, 4, 3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expects an nn\.Linear, got Conv2d"):
        SpectralLinear.from_dense(nn.Conv2d(4, 4, 3))  # type: ignore[arg-type]
    u, v = torch.ones(3, 2), torch.ones(4, 2)
    with pytest.raises(ValueError, match=r"omega of shape \(2,\).*got \(3,\)"):
        SpectralLinear(u, v, torch.ones(3))
    with pytest.raises(ValueError, match=r"finite positive multipliers omega, got \[1.0, 0.0\]"):
        SpectralLinear(u, v, torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"same n, got u \(3, 2\) and v \(4, 3\)"):
        SpectralLinear(u, torch.ones(4, 3), torch.ones(2))
    with pytest.raises(ValueError, match=r"in_channels\*k_h\*k_w = 2\*3\*3 = 18 rows, got 4"):
        SpectralConv2d(u, v, torch.ones(2), in_channels=2, kernel_size=3)
    with pytest.raises(ValueError, match=r"bias of shape \(3,\), got \(4,\)"):
        SpectralLinear(u, v, torch.ones(2), torch.ones(4))
    with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
        SpectralLinear.from_dense(nn.Linear(3, 4), indices=[0, 5])


def _thin_conv(n: int = 7) -> SpectralConv2d:
    g = torch.Generator().manual_seed(3)
    d = torch.float64
    return SpectralConv2d(
        torch.randn(5, n, generator=g, dtype=d), torch.randn(4 * 9, n, generator=g, dtype=d),
        torch.linspace(1.0, 20.0, n, dtype=d), torch.randn(5, generator=g, dtype=d),
        in_channels=4, kernel_size=3, stride=2, padding=1,
    )
