"""The sharded convolutions in the fast path's forms (SpectralConv2d's pad_terms_to and
merge_terms, set by configure_convolutions on the same module): zero-term padding and the
merged kernel compute the plain layer, against the dense convolution built by autograd (an
independent path), in float64."""

from __future__ import annotations

import pytest
import torch

from fedshard.client.train import TrainConfig
from fedshard.client.train.fast import FastOptions, configure_convolutions, conv_form
from fedshard.spectral import SpectralConv2d


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _thin_conv(n: int = 7) -> SpectralConv2d:
    g = torch.Generator().manual_seed(3)
    d = torch.float64
    return SpectralConv2d(
        torch.randn(5, n, generator=g, dtype=d), torch.randn(4 * 9, n, generator=g, dtype=d),
        torch.linspace(1.0, 20.0, n, dtype=d), torch.randn(5, generator=g, dtype=d),
        in_channels=4, kernel_size=3, stride=2, padding=1,
    )


def test_zero_term_padding_is_exact_for_output_and_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thin conv padded with zero terms to 8 channels (what TrainStep asks for under a CUDA
    graph, for cuDNN's fast kernels), here on the CPU. Output and gradients against the dense
    convolution with weight U Ω V^T built by autograd (an independent path), and the
    intermediate really is 8 wide."""
    layer = _thin_conv()
    layer.pad_terms_to = 8
    x = torch.randn(2, 4, 9, 9, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    widths: list[int] = []
    conv2d = torch.nn.functional.conv2d

    def spy(inp: torch.Tensor, weight: torch.Tensor, *args: object) -> torch.Tensor:
        widths.append(int(weight.shape[0]))
        return conv2d(inp, weight, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "conv2d", spy)
    out = layer(x)
    monkeypatch.undo()
    assert widths == [8, 5]  # n = 7 terms + 1 zero term, then the 1x1 conv to c_out
    u = layer.u.detach().clone().requires_grad_(True)
    v = layer.v.detach().clone().requires_grad_(True)
    weight = ((u * layer.omega) @ v.mT).reshape(5, 4, 3, 3)
    want = torch.nn.functional.conv2d(x, weight, layer.bias.detach(), stride=2, padding=1)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    (out * probe).sum().backward()
    (want * probe).sum().backward()
    assert layer.u.grad is not None and layer.v.grad is not None
    assert layer.u.grad.shape == (5, 7) and layer.v.grad.shape == (36, 7)
    torch.testing.assert_close(layer.u.grad, u.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.v.grad, v.grad, rtol=1e-12, atol=1e-12)


def test_zero_term_padding_only_where_asked() -> None:
    layer = _thin_conv(8)  # already a multiple of 8: nothing to pad
    layer.pad_terms_to = 8
    assert layer(torch.zeros(1, 4, 5, 5, dtype=torch.float64)).shape == (1, 5, 3, 3)
    assert SpectralConv2d.pad_terms_to == 1  # off unless a TrainStep turns it on


def test_configure_convolutions_sets_the_form_on_the_same_module() -> None:
    """The fast path's switch keeps the module (its class, identity and hooks) and only sets
    its form; the plain form is the default and comes back by setting it back."""
    conv = _thin_conv()
    model = torch.nn.Sequential(conv)
    seen: list[int] = []
    conv.register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    configure_convolutions(model, TrainConfig(fast=FastOptions(pad_terms=8, merge_terms=True)))
    assert model[0] is conv and type(conv) is SpectralConv2d
    assert conv_form(conv) == (8, True) and "merge_terms=True" in repr(conv)
    model(torch.zeros(1, 4, 5, 5, dtype=torch.float64))
    assert seen == [5]  # the hook still runs
    configure_convolutions(model, TrainConfig(fast=FastOptions()))
    assert conv_form(conv) == (1, False) and "pad_terms_to" not in repr(conv)


@pytest.mark.parametrize("padding_mode, stride, dilation", [("zeros", 1, 1), ("reflect", 2, 1),
                                                            ("zeros", 1, 2)])
def test_merged_terms_compute_the_dense_layer(padding_mode: str, stride: int,
                                              dilation: int) -> None:
    """``merge_terms`` (one convolution with U diag(ω) Vᵀ) against the dense layer it stands
    for (``to_dense``) and against the two thin convolutions, in float64."""
    g = _gen(9)
    d = torch.float64
    conv = SpectralConv2d(
        torch.randn(4, 5, generator=g, dtype=d), torch.randn(3 * 9, 5, generator=g, dtype=d),
        torch.tensor([1.0, 3.0, 8.0, 15.0, 30.0], dtype=d), torch.randn(4, generator=g, dtype=d),
        in_channels=3, kernel_size=3, padding=1, stride=stride, dilation=dilation,
        padding_mode=padding_mode,
    )
    x = torch.randn(2, 3, 9, 9, generator=g, dtype=d)
    two = conv(x)
    conv.merge_terms = True
    merged = conv(x)
    torch.testing.assert_close(merged, conv.to_dense()(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged, two, rtol=1e-12, atol=1e-12)
