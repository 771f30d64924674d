"""The factorized 2-D convolution: a ``k x k`` conv to ``n`` channels, then a ``1 x 1`` conv.

The same function in two other forms, which the fast path of local training selects
(:func:`fedshard.client.train.fast.configure_convolutions`): the ``n`` channels padded with
zero terms (:attr:`SpectralConv2d.pad_terms_to`), or one dense convolution of
``U diag(ω) Vᵀ`` (:attr:`SpectralConv2d.merge_terms`), as PEFT's LoRA layers keep a merged
and an unmerged form of one layer.

State-dict names as every :class:`~fedshard.spectral.layers.SpectralLayer`: ``<layer>.u``
``(c_out, n)``, ``<layer>.v`` ``(c_in*k_h*k_w, n)``, ``<layer>.omega`` ``(n,)`` (a frozen
parameter) and ``<layer>.bias`` ``(c_out,)`` or absent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedshard.spectral.layers import SpectralLayer
from fedshard.spectral.recompute import TAPE, conv_product

__all__ = ["SpectralConv2d"]

PaddingMode = Literal["zeros", "reflect", "replicate", "circular"]


def _pair(value: int | Sequence[int], what: str) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    pair = tuple(int(x) for x in value)
    if len(pair) != 2:
        raise ValueError(f"{what} must be an int or a pair of ints, got {value!r}.")
    return (pair[0], pair[1])


class SpectralConv2d(SpectralLayer):
    """2-D convolution factorized as a ``k x k`` conv to ``n`` channels and a ``1 x 1`` conv.

    Parameters
    ----------
    u : torch.Tensor
        ``(out_channels, n)``, trainable; with ``ω`` it forms the ``1 x 1`` conv.
    v : torch.Tensor
        ``(in_channels * k_h * k_w, n)``, trainable; column ``j`` reshaped to
        ``(in_channels, k_h, k_w)`` is the kernel of the ``j``-th intermediate channel.
    omega : torch.Tensor
        ``(n,)`` auxiliary multipliers, a frozen parameter.
    bias : torch.Tensor, optional
        ``(out_channels,)``, added by the ``1 x 1`` conv.
    in_channels : int
        Input channels ``c_in``.
    kernel_size, stride, padding, dilation, padding_mode
        As in ``nn.Conv2d``; the first conv uses them, the ``1 x 1`` conv has stride 1 and no
        padding. ``groups`` is always 1.

    Attributes
    ----------
    pad_terms_to : int
        The form of the forward pass: pad the ``n`` intermediate channels with zero terms to
        a multiple of this (1, the default: no padding). Exact: zero terms add nothing to the
        output and get zero gradients; only the ``n`` real columns are parameters, so what is
        trained and sent is unchanged. cuDNN runs thin convolutions whose channel count is not
        a multiple of 8 on slower kernels (``benchmarks/README.md``).
    merge_terms : bool
        The form of the forward pass: one dense ``k x k`` convolution with the kernel
        ``U diag(ω) Vᵀ`` built at each call instead of the two thin ones (``False``, the
        default): the same map and gradients of ``u``, ``v`` up to rounding (autograd through
        the product), fewer and larger kernels for the dense FLOPs.

    Notes
    -----
    Decomposing a convolution into a regular convolution with ``n`` output channels followed by
    a ``1 x 1`` convolution follows the paper (Sec. 4.1, after Niu et al. 2023 and Wang et al.
    2023). Costs ``O(HW n (c_in k_h k_w + c_out))`` instead of ``O(HW c_in k_h k_w c_out)``.
    """

    def __init__(
        self,
        u: torch.Tensor,
        v: torch.Tensor,
        omega: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        in_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] | str = 0,
        dilation: int | Sequence[int] = 1,
        padding_mode: PaddingMode = "zeros",
    ) -> None:
        super().__init__(u, v, omega, bias)
        self.in_channels = int(in_channels)
        self.out_channels = int(u.shape[0])
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride = _pair(stride, "stride")
        self.dilation = _pair(dilation, "dilation")
        self.padding: tuple[int, int] | str
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"padding must be 'same', 'valid' or ints, got {padding!r}.")
            self.padding = padding
        else:
            self.padding = _pair(padding, "padding")
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(
                f"padding_mode must be 'zeros', 'reflect', 'replicate' or 'circular', got "
                f"{padding_mode!r}; the layer was not built."
            )
        self.padding_mode = padding_mode
        fan_in = self.in_channels * self.kernel_size[0] * self.kernel_size[1]
        if v.shape[0] != fan_in:
            raise ValueError(
                f"SpectralConv2d expects v with in_channels*k_h*k_w = {self.in_channels}*"
                f"{self.kernel_size[0]}*{self.kernel_size[1]} = {fan_in} rows, got "
                f"{v.shape[0]}; the layer was not built."
            )
        # Explicit padding for non-"zeros" modes, in F.pad order (left, right, top, bottom),
        # computed exactly as nn.Conv2d does.
        self._pad: tuple[int, int, int, int]
        if self.padding == "valid":
            self._pad = (0, 0, 0, 0)
        elif self.padding == "same":
            total_h = self.dilation[0] * (self.kernel_size[0] - 1)
            total_w = self.dilation[1] * (self.kernel_size[1] - 1)
            self._pad = (total_w // 2, total_w - total_w // 2, total_h // 2, total_h - total_h // 2)
        else:
            assert isinstance(self.padding, tuple)
            self._pad = (self.padding[1], self.padding[1], self.padding[0], self.padding[0])

    pad_terms_to: int = 1
    merge_terms: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``x`` of shape ``(B, in_channels, H, W)`` (in the form
        :attr:`pad_terms_to` and :attr:`merge_terms` select: the same function)."""
        v: torch.Tensor = self.v
        u = self.u * self.omega  # ω folded into the 1x1 conv's (c_out, n) weight
        if self.merge_terms:
            # (c_out, n) @ (n, c_in·k_h·k_w), reshaped as decompose() flattens W
            weight = (u @ v.mT).reshape(u.shape[0], self.in_channels, *self.kernel_size)
            return self._spatial_conv(x, weight, self.bias)
        rank = self.rank
        pad = -rank % self.pad_terms_to
        if pad:
            v, u = F.pad(v, (0, pad)), F.pad(u, (0, pad))  # zero columns n .. n+pad-1
            rank += pad
        # (n, c_in, k_h, k_w): row-major reshape matches W.reshape(c_out, -1) in decompose().
        kernel = v.mT.reshape(rank, self.in_channels, *self.kernel_size)
        hidden = self._bottleneck(x, kernel)  # (B, n, H', W')
        # hidden: (B, n, H', W'); 1x1 conv with U diag(ω): (c_out, n, 1, 1).
        return F.conv2d(hidden, u[:, :, None, None], self.bias)

    def _bottleneck(self, x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        """The k×k convolution to the n channels: kept by low-memory training inside one of
        its blocks (:func:`fedshard.spectral.recompute.conv_product`), else plain."""
        if isinstance(self.padding, tuple) and self.padding_mode == "zeros":
            kept = conv_product(x, kernel, self.stride, self.padding, self.dilation)
        else:  # the padding written out, as _spatial_conv does for other modes
            padded = x if torch.compiler.is_compiling() or TAPE.get() is None else F.pad(
                x, self._pad, mode="constant" if self.padding_mode == "zeros"
                else self.padding_mode)
            kept = conv_product(padded, kernel, self.stride, (0, 0), self.dilation)
        return self._spatial_conv(x, kernel, None) if kept is None else kept

    def _spatial_conv(self, x: torch.Tensor, kernel: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's k×k convolution (stride, padding and its mode, dilation) with ``kernel``."""
        if self.padding_mode == "zeros":
            return F.conv2d(x, kernel, bias, self.stride, self.padding, self.dilation)
        padded = F.pad(x, self._pad, mode=self.padding_mode)
        return F.conv2d(padded, kernel, bias, self.stride, 0, self.dilation)

    dense_type = nn.Conv2d
    _other_types_hint = ("use SpectralConvTranspose2d.from_dense() for nn.ConvTranspose2d; "
                         "1-D/3-D convolutions are not supported.")

    @classmethod
    def _geometry(cls, layer: nn.Module) -> dict[str, Any]:
        assert isinstance(layer, nn.Conv2d)
        if layer.groups != 1:
            raise TypeError(
                f"SpectralConv2d supports groups=1 only, got a Conv2d with "
                f"groups={layer.groups}; leave this layer dense."
            )
        padding = layer.padding if isinstance(layer.padding, str) else tuple(layer.padding)
        return {
            "in_channels": layer.in_channels,
            "kernel_size": tuple(layer.kernel_size),
            "stride": tuple(layer.stride),
            "padding": padding,
            "dilation": tuple(layer.dilation),
            "padding_mode": layer.padding_mode,
        }

    def _empty_dense(self) -> nn.Conv2d:
        return nn.Conv2d(
            self.in_channels,
            self.out_channels,
            self.kernel_size,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            bias=self.bias is not None,
            padding_mode=self.padding_mode,
            device=self.u.device,
            dtype=self.u.dtype,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
            f"padding_mode={self.padding_mode}, rank={self.rank}, bias={self.bias is not None}"
            + (f", pad_terms_to={self.pad_terms_to}" if self.pad_terms_to != 1 else "")
            + (", merge_terms=True" if self.merge_terms else "")
        )
