"""The factorized transposed convolution (1-D, 2-D, 3-D): a ``1 x 1`` conv to ``n`` channels,
then a transposed ``k x k`` conv from them.

A transposed convolution's weight is ``(c_in, c_out, *k)`` (torch's layout: the input
channels first). Viewed as the matrix ``W.reshape(c_in, -1)``, ``(c_in, c_out·∏k)``, as every
weight is in :func:`~fedshard.spectral.decompose.decompose`, its terms ``W = U Ω Vᵀ`` factor
the layer into two:

``conv_transpose(x, W)[o] = Σ_t V_t[o] ⋆ᵀ (Σ_i U[i, t] ω_t x[i])``

a ``1 x 1`` convolution ``c_in → n`` with ``(U Ω)ᵀ``, then the transposed convolution
``n → c_out`` whose kernel of channel ``t`` is column ``t`` of ``V`` reshaped to
``(c_out, *k)``, with the layer's stride, padding, output padding and dilation, and the bias.
This is the adjoint of the paper's factorized convolution (a ``k x k`` conv to ``n``
channels, then a ``1 x 1`` conv, Sec. 4.1): a transposed convolution is the adjoint of the
convolution with the same weight, so the same matrix and the same terms serve both.

State-dict names as every :class:`~fedshard.spectral.layers.SpectralLayer`: ``<layer>.u``
``(c_in, n)``, ``<layer>.v`` ``(c_out·∏k, n)``, ``<layer>.bias`` ``(c_out,)`` or absent,
``<layer>.omega`` ``(n,)`` (a frozen parameter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fedshard.spectral.layers import SpectralLayer, _like

__all__ = ["SpectralConvTranspose1d", "SpectralConvTranspose2d", "SpectralConvTranspose3d"]


def _tuple(value: int | Sequence[int], dims: int, what: str) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * dims
    out = tuple(int(x) for x in value)
    if len(out) != dims:
        raise ValueError(f"{what} must be an int or {dims} ints, got {value!r}; the layer was "
                         "not built.")
    return out


class _SpectralConvTransposeNd(SpectralLayer):
    """A transposed convolution in ``dims`` spatial dimensions, factorized (module
    docstring). Subclasses name ``dims`` and their dense type.

    Parameters
    ----------
    u : torch.Tensor
        ``(in_channels, n)``, trainable; with ``ω`` it forms the ``1 x 1`` conv.
    v : torch.Tensor
        ``(out_channels·∏kernel_size, n)``, trainable; column ``t`` reshaped to
        ``(out_channels, *kernel_size)`` is the transposed kernel of hidden channel ``t``.
    omega : torch.Tensor
        ``(n,)`` auxiliary multipliers, a frozen parameter.
    bias : torch.Tensor, optional
        ``(out_channels,)``, added by the transposed conv.
    out_channels : int
        Output channels ``c_out``.
    kernel_size, stride, padding, output_padding, dilation
        As in the dense layer; the transposed conv uses them. ``groups`` is always 1 and the
        padding mode ``"zeros"`` (the only one torch's transposed convolutions take).
    """

    dims: ClassVar[int]

    def __init__(
        self,
        u: torch.Tensor,
        v: torch.Tensor,
        omega: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        output_padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
    ) -> None:
        super().__init__(u, v, omega, None)  # the bias has c_out entries, not u's c_in rows
        name, d = type(self).__name__, self.dims
        self.in_channels = int(u.shape[0])
        self.out_channels = int(out_channels)
        self.kernel_size = _tuple(kernel_size, d, "kernel_size")
        self.stride = _tuple(stride, d, "stride")
        self.padding = _tuple(padding, d, "padding")
        self.output_padding = _tuple(output_padding, d, "output_padding")
        self.dilation = _tuple(dilation, d, "dilation")
        fan = self.out_channels
        for k in self.kernel_size:
            fan *= k
        if v.shape[0] != fan:
            raise ValueError(
                f"{name} expects v with out_channels*prod(kernel_size) = {self.out_channels}*"
                f"{'*'.join(map(str, self.kernel_size))} = {fan} rows, got {v.shape[0]}; the "
                "layer was not built.")
        if bias is not None:
            if bias.shape != (self.out_channels,):
                raise ValueError(f"{name} expects bias of shape ({self.out_channels},), got "
                                 f"{tuple(bias.shape)}; the layer was not built.")
            self.bias = nn.Parameter(_like(bias, u, copy=True))  # its slot is before omega

    def forward(self, x: torch.Tensor, output_size: Sequence[int] | None = None) -> torch.Tensor:
        """Apply the layer to ``x`` of shape ``(B, in_channels, *spatial)``; ``output_size``
        as the dense layer takes it (it picks the output padding)."""
        d = self.dims
        # (n, c_in, 1, ...): the 1x1 conv with (U Ω)ᵀ, ω folded into the (c_in, n) factor
        pointwise = (self.u * self.omega).mT.reshape(self.rank, self.in_channels, *(1,) * d)
        hidden = _CONV[d](x, pointwise)  # (B, n, *spatial)
        # (n, c_out, *k): row-major reshape matches W.reshape(c_in, -1) in decompose()
        kernel = self.v.mT.reshape(self.rank, self.out_channels, *self.kernel_size)
        extra = self._extra_padding(x, output_size)
        return _CONV_T[d](hidden, kernel, self.bias, self.stride, self.padding, extra, 1,
                          self.dilation)

    def _extra_padding(self, x: torch.Tensor, output_size: Sequence[int] | None) -> tuple[int, ...]:
        """The output padding: the layer's, or the one ``output_size`` asks for (computed as
        torch's dense layer does)."""
        if output_size is None:
            return self.output_padding
        dense: Any = _DENSE[self.dims]
        return tuple(dense._output_padding(self, x, list(output_size), list(self.stride),
                                           list(self.padding), list(self.kernel_size),
                                           self.dims, list(self.dilation)))

    _other_types_hint = "use SpectralLinear / SpectralConv2d for the other affine layers."

    @classmethod
    def _geometry(cls, module: nn.Module) -> dict[str, Any]:
        assert isinstance(module, cls.dense_type)
        layer: Any = module  # an nn.ConvTranspose{1,2,3}d
        if layer.groups != 1 or layer.padding_mode != "zeros":
            raise TypeError(
                f"{cls.__name__} supports groups=1 and padding_mode='zeros' only, got a "
                f"{type(layer).__name__} with groups={layer.groups}, padding_mode="
                f"{layer.padding_mode!r}; leave this layer dense.")
        return {"out_channels": layer.out_channels, "kernel_size": tuple(layer.kernel_size),
                "stride": tuple(layer.stride), "padding": tuple(layer.padding),
                "output_padding": tuple(layer.output_padding),
                "dilation": tuple(layer.dilation)}

    def _empty_dense(self) -> nn.Module:
        return self.dense_type(
            self.in_channels, self.out_channels, self.kernel_size, stride=self.stride,
            padding=self.padding, output_padding=self.output_padding, dilation=self.dilation,
            bias=self.bias is not None, device=self.u.device, dtype=self.u.dtype)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, output_padding="
                f"{self.output_padding}, dilation={self.dilation}, rank={self.rank}, "
                f"bias={self.bias is not None}")


class SpectralConvTranspose1d(_SpectralConvTransposeNd):
    """``nn.ConvTranspose1d`` factorized: a ``1 x 1`` conv to ``n`` channels, then the
    transposed conv (:mod:`fedshard.spectral.transposed`)."""

    dims = 1
    dense_type = nn.ConvTranspose1d


class SpectralConvTranspose2d(_SpectralConvTransposeNd):
    """``nn.ConvTranspose2d`` factorized: a ``1 x 1`` conv to ``n`` channels, then the
    transposed ``k x k`` conv (:mod:`fedshard.spectral.transposed`).

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> dense = nn.ConvTranspose2d(8, 4, 3, stride=2).double()
    >>> layer = SpectralConvTranspose2d.from_dense(dense)
    >>> x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    >>> bool(torch.allclose(layer(x), dense(x)))
    True
    """

    dims = 2
    dense_type = nn.ConvTranspose2d


class SpectralConvTranspose3d(_SpectralConvTransposeNd):
    """``nn.ConvTranspose3d`` factorized: a ``1 x 1 x 1`` conv to ``n`` channels, then the
    transposed conv (:mod:`fedshard.spectral.transposed`)."""

    dims = 3
    dense_type = nn.ConvTranspose3d


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_DENSE = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
