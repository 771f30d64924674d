"""Factorized affine layers ``W_hat = U Ω V^T`` applied without forming ``W_hat``: the base
class and the linear layer (the convolution is in :mod:`fedshard.spectral.conv`).

Modelled on PEFT's ``SVDLinear``: the forward pass applies the factors, and
``from_dense`` / ``to_dense`` are an exact (float64) or float32-round-off round trip.
State-dict names: ``<layer>.u`` ``(c_out, n)``, ``<layer>.v`` ``(c_in*k_h*k_w, n)``,
``<layer>.bias`` ``(c_out,)`` or absent, and ``<layer>.omega`` ``(n,)`` (a frozen parameter).

**Why ω is a frozen parameter, not a buffer.** ω is part of the layer's function but never
trained, as a frozen base weight is in PEFT's LoRA layers: ``nn.Parameter(requires_grad=False)``.
As a buffer it made every sharded layer "a trainable layer with buffers", which Opacus refuses
(``GradSampleModule.validate``: a buffer is state that per-sample gradients would not account
for, as BatchNorm's statistics). A frozen parameter keeps everything a buffer gave: the
state-dict key and its place (registered after the bias), ``.to()``/``.double()``, copies,
``torch.func.functional_call``; no optimizer moves it (it never has a gradient), and fedshard's
optimizer groups leave it out explicitly. Per-sample gradients of ``u``, ``v`` and ``bias`` are
:mod:`fedshard.spectral.per_sample` (registered with Opacus when it is imported).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from fedshard.spectral.decompose import decompose, take_terms
from fedshard.spectral.recompute import linear_product

__all__ = ["SpectralLayer", "SpectralLinear"]

_Layer = TypeVar("_Layer", bound="SpectralLayer")


class SpectralLayer(nn.Module):
    """Common base of :class:`SpectralLinear` and :class:`SpectralConv2d`.

    Holds the trainable factors ``u`` ``(c_out, n)`` and ``v`` ``(fan_in, n)``, the frozen
    auxiliary multipliers ``omega`` ``(n,)`` (a parameter with ``requires_grad=False``: no
    optimizer step moves it, and Opacus takes the layer, see the module docstring) and the
    optional dense ``bias`` ``(c_out,)``. Use ``isinstance(m, SpectralLayer)`` to find the
    factorized layers of a sub-model.

    :meth:`from_dense`, :meth:`from_factors` and :meth:`to_dense` live here once; a subclass
    names its :attr:`dense_type` and supplies the geometry hooks ``_geometry`` (dense layer to
    constructor keywords) and ``_empty_dense`` (the inverse), as PEFT's ``_ConvNd`` does.

    Parameters
    ----------
    u, v, omega, bias : torch.Tensor
        See above. They are copied; ``omega`` and ``bias`` are cast to ``u``'s dtype and device.

    Raises
    ------
    ValueError
        On inconsistent shapes, a non-floating ``u``, or ``omega`` entries that are not finite
        and positive.
    """

    u: nn.Parameter
    v: nn.Parameter
    omega: nn.Parameter
    bias: nn.Parameter | None

    def __init__(
        self,
        u: torch.Tensor,
        v: torch.Tensor,
        omega: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if u.ndim != 2 or v.ndim != 2 or u.shape[1] != v.shape[1]:
            raise ValueError(
                f"{name} expects u of shape (c_out, n) and v of shape (fan_in, n) with the same "
                f"n, got u {tuple(u.shape)} and v {tuple(v.shape)}; the layer was not built."
            )
        if not u.is_floating_point():
            raise ValueError(f"{name} expects floating-point factors, got dtype {u.dtype}.")
        rank = u.shape[1]
        if rank < 1:
            raise ValueError(f"{name} needs at least one term (n >= 1), got n = 0.")
        if omega.shape != (rank,):
            raise ValueError(
                f"{name} expects omega of shape ({rank},) (one multiplier per term), got "
                f"{tuple(omega.shape)}; the layer was not built."
            )
        if not bool(torch.isfinite(omega).all()) or not bool((omega > 0).all()):
            raise ValueError(
                f"{name} expects finite positive multipliers omega, got {omega.tolist()}; "
                "ω_i = 1/π_i or C/(1+π_i(C-1)) is always > 0. The layer was not built."
            )
        if bias is not None and bias.shape != (u.shape[0],):
            raise ValueError(
                f"{name} expects bias of shape ({u.shape[0]},), got {tuple(bias.shape)}; "
                "the layer was not built."
            )
        self.u = nn.Parameter(u.detach().clone())
        self.v = nn.Parameter(_like(v, u, copy=True))
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(_like(bias, u, copy=True))
        # frozen, and after the bias: the state dict keeps the order it had as a buffer
        self.omega = nn.Parameter(_like(omega, u, copy=True), requires_grad=False)

    @property
    def rank(self) -> int:
        """Number of terms ``n`` of this sub-layer."""
        return int(self.u.shape[1])

    #: What a copy or a pickle of the layer leaves out: caches that their owner rebuilds when
    #: they are missing. Opacus's ``torch.func`` fallback (a layer type without a registered
    #: grad sampler) keeps a local function here, which cannot be pickled, so that
    #: ``torch.save(model)`` and ``ModuleValidator.fix(model)`` (which clones through
    #: ``torch.save``) failed with "Can't pickle local object"; Opacus recreates it when it is
    #: missing. (torch's own ``Module.__getstate__`` drops its compiled call the same way.)
    _TRANSIENT: ClassVar[tuple[str, ...]] = ("ft_compute_sample_grad",)

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()
        for key in self._TRANSIENT:
            state.pop(key, None)
        return state

    def dense_weight(self) -> torch.Tensor:
        """Effective weight ``U Ω V^T`` as a ``(c_out, fan_in)`` float64 matrix (for checks)."""
        u = self.u.detach().to(torch.float64)
        v = self.v.detach().to(torch.float64)
        return (u * self.omega.to(torch.float64)) @ v.mT

    def frobenius_norm_sq(self) -> torch.Tensor:
        """Differentiable ``‖U Ω V^T‖_F^2`` computed from ``n x n`` Gram matrices.

        Returns
        -------
        torch.Tensor
            Scalar in the factors' dtype.

        Notes
        -----
        ``‖U Ω V^T‖_F^2 = tr(Ω U^T U Ω V^T V) = Σ_ij (U^T U)_ij (V^T V)_ij ω_i ω_j``, which
        costs ``O((c_out + fan_in) n^2)`` instead of ``O(c_out fan_in n)`` and never builds the
        ``(c_out, fan_in)`` matrix. This is the Frobenius decay term of the paper (Sec. 3.3).
        """
        gram_u = self.u.mT @ self.u  # (n, n)
        gram_v = self.v.mT @ self.v  # (n, n)
        return (gram_u * gram_v * torch.outer(self.omega, self.omega)).sum()

    # --- the dense pair: one generic implementation, two geometry hooks per subclass -------
    #: The dense module this class factorizes (``nn.Linear``, ``nn.Conv2d``).
    dense_type: ClassVar[type[nn.Module]]
    #: Appended to the ``TypeError`` of :meth:`from_dense` for a module of another type.
    _other_types_hint: ClassVar[str] = ""

    @classmethod
    def _geometry(cls, layer: nn.Module) -> dict[str, Any]:
        """Keyword arguments of ``cls(u, v, omega, bias, **kw)`` read off the dense ``layer``.

        The one per-subclass hook of :meth:`from_factors` (PEFT's ``_ConvNd`` pattern);
        raises ``TypeError`` for a configuration the subclass cannot represent.
        """
        raise NotImplementedError

    def _empty_dense(self) -> nn.Module:
        """A dense ``dense_type`` module with this layer's geometry (weights to be filled)."""
        raise NotImplementedError

    @classmethod
    def from_dense(
        cls: type[_Layer],
        layer: nn.Module,
        indices: Sequence[int] | None = None,
        omega: torch.Tensor | None = None,
    ) -> _Layer:
        """Factorize a dense layer of type :attr:`dense_type`, keeping the terms ``indices``.

        Parameters
        ----------
        layer : nn.Module
            The dense layer (not modified): ``nn.Linear`` for :class:`SpectralLinear`,
            ``nn.Conv2d`` with ``groups == 1`` for :class:`SpectralConv2d`.
        indices : sequence of int, optional
            Term indices in ``[0, N)``, ``N = min(c_out, fan_in)``, in the order they become
            columns; ``None`` keeps all ``N`` terms in order of decreasing singular value.
        omega : torch.Tensor, optional
            ``(n,)`` multipliers; default ones.

        Returns
        -------
        SpectralLayer
            An instance of ``cls``: factors and bias in ``layer.weight``'s dtype and device,
            the same geometry (stride, padding, ...) as ``layer``.

        Raises
        ------
        TypeError
            If ``layer`` is not a :attr:`dense_type` or has a configuration the class cannot
            represent (a grouped convolution).
        """
        if not isinstance(layer, cls.dense_type):
            raise TypeError(
                f"{cls.__name__}.from_dense() expects an nn.{cls.dense_type.__name__}, got "
                f"{type(layer).__name__}; {cls._other_types_hint}"
            )
        cls._geometry(layer)  # reject unsupported configurations before the SVD
        weight = layer.weight
        assert isinstance(weight, torch.Tensor)
        u, v, omega = _factors_of(weight, indices, omega)
        return cls.from_factors(layer, u, v, omega)

    @classmethod
    def from_factors(
        cls: type[_Layer],
        layer: nn.Module,
        u: torch.Tensor,
        v: torch.Tensor,
        omega: torch.Tensor,
    ) -> _Layer:
        """Replacement for ``layer`` with the given factors, its geometry and a copy of its bias.

        Parameters
        ----------
        layer : nn.Module
            A :attr:`dense_type` module: source of the geometry and the bias; not modified.
        u, v, omega : torch.Tensor
            ``(c_out, n)``, ``(fan_in, n)``, ``(n,)`` with ``fan_in = c_in`` (linear) or
            ``c_in k_h k_w`` (convolution); cast to ``layer.weight``'s dtype and device.

        Returns
        -------
        SpectralLayer
            An instance of ``cls``, in ``layer``'s train/eval mode.

        Raises
        ------
        TypeError
            If ``layer`` has a configuration the class cannot represent.
        ValueError
            If the factor shapes do not match ``layer``.
        """
        geometry = cls._geometry(layer)
        w = layer.weight
        assert isinstance(w, torch.Tensor)
        rows, fan_in = int(w.shape[0]), int(w[0].numel())  # W.reshape(c_out, -1): (rows, fan_in)
        if u.shape[0] != rows or v.shape[0] != fan_in:
            raise ValueError(
                f"factors u {tuple(u.shape)}, v {tuple(v.shape)} do not fit {layer}: expected "
                f"u ({rows}, n) and v ({fan_in}, n); the layer was not replaced."
            )
        b = getattr(layer, "bias", None)
        bias = None if b is None else b.detach()
        out = cls(_like(u, w), _like(v, w), _like(omega, w), bias, **geometry)
        out.train(layer.training)
        return out

    def to_dense(self) -> nn.Module:
        """Equivalent dense :attr:`dense_type` module with weight ``U Ω V^T``.

        Returns
        -------
        nn.Module
            The weight is computed in float64 and cast to the factors' dtype (reshaped to
            ``(c_out, c_in, k_h, k_w)`` for a convolution); the bias is copied.
        """
        layer = self._empty_dense()
        with torch.no_grad():
            weight = layer.weight
            assert isinstance(weight, torch.Tensor)
            weight.copy_(self.dense_weight().reshape(weight.shape))
            dense_bias = getattr(layer, "bias", None)
            if self.bias is not None and dense_bias is not None:
                dense_bias.copy_(self.bias)
        return layer


class SpectralLinear(SpectralLayer):
    """Linear layer ``y = ((x V) ⊙ ω) U^T + b`` with ``n`` terms.

    Parameters
    ----------
    u : torch.Tensor
        ``(out_features, n)``, trainable.
    v : torch.Tensor
        ``(in_features, n)``, trainable.
    omega : torch.Tensor
        ``(n,)`` auxiliary multipliers, a frozen parameter.
    bias : torch.Tensor, optional
        ``(out_features,)``.

    Notes
    -----
    Applies ``W_hat = U Ω V^T`` (paper Eq. 1 restricted to the selected terms) as two skinny
    matrix products, ``O(B n (in + out))`` instead of ``O(B in out)``.
    """

    def __init__(
        self,
        u: torch.Tensor,
        v: torch.Tensor,
        omega: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__(u, v, omega, bias)
        self.in_features = int(v.shape[0])
        self.out_features = int(u.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``x`` of shape ``(..., in_features)``."""
        hidden = linear_product(x, self.v)  # (..., n), kept by low-memory training
        # ω folded into U: (out, n) is cheaper to scale than the (..., n) activations.
        return F.linear(hidden, self.u * self.omega, self.bias)  # (..., out)

    dense_type = nn.Linear
    _other_types_hint = "use SpectralConv2d.from_dense() for nn.Conv2d."

    @classmethod
    def _geometry(cls, layer: nn.Module) -> dict[str, Any]:
        return {}  # fully given by the factor shapes

    def _empty_dense(self) -> nn.Linear:
        return nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.u.device,
            dtype=self.u.dtype,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rank={self.rank}, bias={self.bias is not None}"
        )


def _factors_of(
    weight: torch.Tensor, indices: Sequence[int] | None, omega: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Selected ``(u, v, omega)`` of ``weight`` in ``weight``'s dtype and device."""
    u, v, _ = decompose(weight)  # float64, (c_out, N), (fan_in, N)
    if indices is not None:
        u, v = take_terms(u, v, indices)
    if omega is None:
        omega = torch.ones(u.shape[1], dtype=weight.dtype, device=weight.device)
    return _like(u, weight), _like(v, weight), _like(omega, weight)


def _like(t: torch.Tensor, ref: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """``t`` detached, in ``ref``'s dtype and device (a fresh copy if ``copy``)."""
    return t.detach().to(device=ref.device, dtype=ref.dtype, copy=copy)
