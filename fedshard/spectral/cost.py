"""What an array and a sharded layer cost on the wire, from shapes alone.

Every array of a ``train`` message and of its reply travels as ``np.save``'s bytes (a Flower
``Array``): an ``.npy`` header (magic, version and a dict of dtype, order and shape, padded to
a multiple of 64 bytes: 128 bytes for any weight of a usual model) followed by the raw data.
A sharded layer ``W`` (``c_out × fan_in``, ``fan_in = c_in·k·k`` for a convolution) is sent as
its ``n = ⌈rN⌉`` terms (:mod:`fedshard.protocol.shards`): ``u`` (``c_out × n``) and ``v``
(``fan_in × n``) in the weight's dtype, ``omega`` (``n``, the weight's dtype) and ``indices``
(``n``, int64); the reply returns the same arrays but ``omega``. Its bias, if any, stays a
dense entry of both messages. Nothing here reads values: the counts are what the shapes and
dtypes make them, so they can be known before the first round.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.lib import format as npy_format

from fedshard.sampling.plan import num_terms

__all__ = ["LayerCost", "array_bytes", "layer_cost", "numpy_dtype"]

# (dtype, shape) -> header length; a model has a few dozen distinct ones
_HEADERS: dict[tuple[np.dtype[Any], tuple[int, ...]], int] = {}


def numpy_dtype(dtype: Any) -> np.dtype[Any]:
    """The numpy dtype an array of ``dtype`` travels as (a torch dtype, a numpy dtype, or a
    Flower ``Array``'s dtype string).

    Raises
    ------
    ValueError
        For a torch dtype numpy has no equivalent of (``bfloat16``, ...): Flower cannot send
        such a tensor either; convert the model (e.g. ``model.float()``) first.
    """
    if isinstance(dtype, torch.dtype):
        try:
            return torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError as err:
            raise ValueError(
                f"dtype {dtype} has no numpy equivalent, so Flower cannot send it ({err}); "
                "expected float16/32/64 or an integer dtype: convert the model (e.g. "
                "model.float()) before counting its bytes."
            ) from err
    return np.dtype(dtype)


def array_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of one array on the wire: ``np.save``'s header plus its data.

    Parameters
    ----------
    shape : tuple of int
        The array's shape (``()`` for a scalar such as BatchNorm's ``num_batches_tracked``).
    dtype : numpy dtype, torch dtype or str
        Its dtype (see :func:`numpy_dtype`).

    Returns
    -------
    int
        ``len(flwr.app.Array(x).data)`` for a C-contiguous ``x`` of that shape and dtype.
    """
    dt, shape = numpy_dtype(dtype), tuple(int(s) for s in shape)
    header = _HEADERS.get((dt, shape))
    if header is None:
        fields = {"descr": npy_format.dtype_to_descr(dt), "fortran_order": False,
                  "shape": shape}
        buffer = io.BytesIO()
        try:  # np.save writes version 1.0 unless the header needs more than 65535 bytes
            npy_format.write_array_header_1_0(buffer, fields)
        except ValueError:
            buffer = io.BytesIO()
            npy_format.write_array_header_2_0(buffer, fields)
        header = len(buffer.getvalue())
        _HEADERS[(dt, shape)] = header
    return header + math.prod(shape) * dt.itemsize


@dataclass(frozen=True)
class LayerCost:
    """One layer at one keep ratio: its dense weight against its ``n`` factored terms.

    Attributes
    ----------
    name : str
        Module name.
    weight_shape : tuple of int
        ``(c_out, c_in)`` or ``(c_out, c_in, k_h, k_w)``.
    keep_ratio : float
        ``r``.
    terms : int
        ``N = min(c_out, fan_in)``.
    kept : int
        ``n = ⌈rN⌉``.
    dense_params : int
        ``c_out · fan_in``, the weight's entries.
    factor_params : int
        ``n (c_out + fan_in)``, the entries of ``u`` and ``v``.
    dense_bytes : int
        The weight array on the wire (header included).
    received_bytes : int
        ``u``, ``v``, ``omega`` and ``indices`` on the wire: what a node receives instead.
    sent_bytes : int
        ``u``, ``v`` and ``indices``: what it returns instead.
    """

    name: str
    weight_shape: tuple[int, ...]
    keep_ratio: float
    terms: int
    kept: int
    dense_params: int
    factor_params: int
    dense_bytes: int
    received_bytes: int
    sent_bytes: int

    @property
    def costs_more(self) -> bool:
        """Whether the factors a node receives cost more bytes than the dense weight."""
        return self.received_bytes > self.dense_bytes


def layer_cost(name: str, weight_shape: tuple[int, ...], dtype: Any,
               keep_ratio: float) -> LayerCost:
    """What layer ``name`` costs on the wire when sharded at ``keep_ratio``.

    Parameters
    ----------
    name : str
        Module name (carried into the result).
    weight_shape : tuple of int
        The weight's shape, at least 2-D (trailing dimensions are the fan-in).
    dtype : numpy dtype, torch dtype or str
        The weight's dtype (``u``, ``v`` and ``omega`` travel in it).
    keep_ratio : float
        ``r`` in ``(0, 1]``.

    Returns
    -------
    LayerCost

    Raises
    ------
    ValueError
        If the weight is not at least 2-D or ``keep_ratio`` is outside ``(0, 1]``.

    Notes
    -----
    ``n = ⌈rN⌉`` (paper, Sec. 3.1); the conv layer becomes a ``k×k`` conv with ``n`` outputs
    and a ``1×1`` conv (Sec. 4.1), whose weights are ``v`` and ``u``.
    """
    shape = tuple(int(s) for s in weight_shape)
    if len(shape) < 2:
        raise ValueError(f"layer {name!r}: expected a weight of 2 or more dimensions, got "
                         f"shape {shape}; only the weights of affine layers (Linear, convolutions, "
                         "transposed convolutions) can be sharded.")
    rows, cols = shape[0], math.prod(shape[1:])
    total = min(rows, cols)
    n = num_terms(total, keep_ratio)
    u, v = array_bytes((rows, n), dtype), array_bytes((cols, n), dtype)
    omega, indices = array_bytes((n,), dtype), array_bytes((n,), np.int64)
    return LayerCost(name, shape, float(keep_ratio), total, n, rows * cols, n * (rows + cols),
                     array_bytes(shape, dtype), u + v + omega + indices, u + v + indices)
