"""Flower ``Array`` ⇄ numpy with the same bytes and values as Flower's own, without parsing the
same ``.npy`` header again for every array: :func:`encode_array`, :func:`decode_array`, and
:func:`array_record` (an ``ArrayRecord`` of them, each Array built once).

A Flower :class:`~flwr.app.Array` holds ``np.save``'s bytes: a header (magic, version, a
Python-literal dict of dtype, order and shape) and the raw data. ``Array(ndarray)`` writes that
header and ``Array.numpy()`` parses it with ``np.load`` for every array, every time: about
0.1 ms an array on a 2-core EPYC (``benchmarks/bench_wire_arrays.py``). A round moves
each array of each node's shard four times (server → node, node → server), with the same few
shapes every round. Here a header is made (or read) by numpy once per ``(dtype, shape)`` and
remembered; encoding copies the data once, after the header, and decoding reads them with
``frombuffer``. Anything else (a non-contiguous or object array, a header seen for the first
time, data whose length does not match its header) goes through numpy as Flower would, so the
results, and the errors on malformed bytes, are Flower's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

__all__ = ["array_record", "decode_array", "encode_array"]

#: The ``stype`` of an ``np.save`` Array (``flwr.common.constant.SType.NUMPY``).
_NUMPY = "numpy.ndarray"
#: At most this many headers are remembered each way (a node cannot grow the memory).
_MAX_HEADERS = 4096
#: Headers longer than this are parsed by numpy every time (``np.save`` writes 64–128 bytes).
_MAX_HEADER_BYTES = 1024

# (dtype, shape) -> the header np.save writes for a C-contiguous array of them, and the
# dtype's name as Array holds it (``str(dtype)`` is slow enough to count, per array sent)
_written: dict[tuple[np.dtype, tuple[int, ...]], tuple[bytes, str]] = {}
# header bytes -> (dtype, shape) np.load read from them (C order only)
_read: dict[bytes, tuple[np.dtype, tuple[int, ...]]] = {}


def encode_array(x: np.ndarray) -> Array:
    """``Array(x)``, the same ``dtype``, ``shape`` and bytes.

    Parameters
    ----------
    x : numpy.ndarray
        Any array Flower accepts (no object dtype: ``np.save`` runs without pickling).

    Returns
    -------
    flwr.app.Array
        Equal, field by field, to ``flwr.app.Array(x)``.
    """
    # exact ndarrays only: a subclass may write other bytes than its buffer (a masked array's
    # tobytes fills the masked entries)
    if type(x) is not np.ndarray or not x.flags.c_contiguous or x.dtype.hasobject:
        return Array(x)
    key = (x.dtype, x.shape)
    known = _written.get(key)
    if known is None:
        reference = Array(x)
        header = reference.data[:len(reference.data) - x.nbytes]
        if len(_written) < _MAX_HEADERS and reference.data[len(header):] == x.tobytes():
            _written[key] = (header, reference.dtype)
        return reference
    header, dtype = known
    # one copy of the data (``header + x.tobytes()`` would copy them twice)
    return Array(dtype, tuple(x.shape), _NUMPY, b"".join((header, x.data)))


def array_record(arrays: Mapping[str, Array]) -> ArrayRecord:
    """``ArrayRecord(dict(arrays))``, the same keys, order and Arrays.

    ``ArrayRecord(dict)`` builds a second ``Array`` around the data of each one it is given;
    this record holds the given Arrays themselves (an ``Array`` is not changed once sent, so
    one may sit in several records).

    Raises
    ------
    TypeError
        What ``ArrayRecord`` raises for a key that is not a ``str`` or a value that is not an
        ``Array``.
    """
    record = ArrayRecord()
    for key, value in arrays.items():
        record[key] = value
    return record


def decode_array(array: Array) -> np.ndarray:
    """``array.numpy()``: a new, writable array, the same values, dtype and shape.

    Raises
    ------
    TypeError, ValueError
        What ``array.numpy()`` raises for an Array that is not ``np.save``'s bytes of an array.
    """
    view, offset = _known_view(array)
    if view is not None:
        return view.copy()
    out = array.numpy()
    data = array.data
    if offset is not None and len(_read) < _MAX_HEADERS and out.flags.c_contiguous \
            and not out.dtype.hasobject and len(data) - offset == out.nbytes:
        _read[data[:offset]] = (out.dtype, out.shape)
    return out


def array_view(array: Array) -> np.ndarray:
    """``array``'s values without a copy where its header is a known one: a read-only view
    of the Array's own bytes (valid while the Array lives); else :func:`decode_array`'s new
    array. For a reader that copies the values elsewhere at once (into a model's tensors)."""
    view, _ = _known_view(array)
    return view if view is not None else decode_array(array)


def _known_view(array: Array) -> tuple[np.ndarray | None, int | None]:
    """A read-only view of ``array``'s bytes when its ``.npy`` header is one read before
    (else ``None``), and where its data start (``None``: not ``np.save``'s bytes, or a header
    too long to look up)."""
    data = array.data
    offset = _header_end(data) if array.stype == _NUMPY and isinstance(data, bytes) else None
    if offset is None or offset > _MAX_HEADER_BYTES:  # (a long header is not looked up)
        return None, None
    known = _read.get(data[:offset])
    if known is not None:
        dtype, shape = known
        count = math.prod(shape)
        if len(data) - offset == count * dtype.itemsize:
            return np.frombuffer(data, dtype, count, offset).reshape(shape), offset
    return None, offset


def _header_end(data: bytes) -> int | None:
    """Where the data start after an ``.npy`` header (versions 1–3), or ``None``."""
    if len(data) < 10 or data[:6] != b"\x93NUMPY":
        return None
    major = data[6]
    if major == 1:
        return 10 + int.from_bytes(data[8:10], "little")
    if major in (2, 3) and len(data) >= 12:
        return 12 + int.from_bytes(data[8:12], "little")
    return None

