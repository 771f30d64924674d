"""fedshard's Array codec against Flower's own (``np.save`` / ``np.load``): the same bytes and
the same values, first time (header not yet seen) and every time after, and the same errors
for malformed bytes."""

from __future__ import annotations

from io import BytesIO

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard.protocol import array_record, decode_array, encode_array
from fedshard.protocol import arrays as codec

DTYPES = ["float32", "float64", "float16", "int64", "int8", "uint8", "bool", "complex64",
          ">f4", "<i2"]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (4, 1, 3, 3)]


def _fields(a: Array) -> tuple[object, ...]:
    return a.dtype, tuple(a.shape), a.stype, a.data


def _same(x: np.ndarray, y: np.ndarray) -> None:
    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def _npy(x: np.ndarray, version: tuple[int, int] | None = None) -> Array:
    """An Array holding ``np.save``'s bytes of ``x`` (or a given format version)."""
    buffer = BytesIO()
    np.lib.format.write_array(buffer, x, version=version, allow_pickle=False)
    return Array(str(x.dtype), tuple(x.shape), "numpy.ndarray", buffer.getvalue())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_encode_gives_flowers_bytes_and_decode_numpys_values(dtype: str, shape: tuple) -> None:
    rng = np.random.default_rng([len(shape), len(dtype)])
    x = np.asarray(rng.standard_normal(shape) * 50).astype(dtype)
    for _ in range(3):  # the first call meets the header, the later ones reuse it
        assert _fields(encode_array(x)) == _fields(Array(x))
        got = decode_array(Array(x))
        _same(got, np.load(BytesIO(Array(x).data)))
        assert got.flags.writeable


def test_arrays_that_are_not_c_contiguous_are_encoded_as_flower_does() -> None:
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    for view in (x.T, x[:, ::2], np.asfortranarray(x)):
        for _ in range(2):
            a = encode_array(view)
            assert _fields(a) == _fields(Array(view))
            _same(decode_array(a), a.numpy())
            np.testing.assert_array_equal(decode_array(a), view)


def test_a_masked_array_is_encoded_as_flower_does_after_a_plain_one_of_its_shape() -> None:
    # Flower saves a masked array's data as they are; its tobytes() would fill the masked
    # entries. The plain array first puts the (dtype, shape) header in the cache.
    plain = np.arange(4.0)
    masked = np.ma.masked_array(np.arange(4.0), mask=[0, 1, 0, 0])
    encode_array(plain)
    assert _fields(encode_array(masked)) == _fields(Array(masked))
    assert masked.tobytes() != plain.tobytes()  # the case the cache must not take


def test_array_record_is_flowers_record_of_the_same_arrays() -> None:
    rng = np.random.default_rng(7)
    arrays = {k: encode_array(rng.standard_normal(s).astype(np.float32))
              for k, s in (("b.weight", (3, 4)), ("a.bias", (3,)), ("c", ()))}
    ours, flowers = array_record(arrays), ArrayRecord(dict(arrays))
    assert list(ours) == list(flowers) == list(arrays)  # same keys, same order
    assert [_fields(a) for a in ours.values()] == [_fields(a) for a in flowers.values()]
    assert all(ours[k] is arrays[k] for k in arrays)  # each Array built once
    assert ours.object_id == flowers.object_id  # what Flower sends and hashes
    with pytest.raises(TypeError, match="Value must be of type"):
        array_record({"x": np.zeros(2)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="Key must be of type `str`"):
        array_record({1: arrays["c"]})  # type: ignore[dict-item]


def test_fortran_ordered_and_version_2_and_3_files_decode_as_numpy_reads_them() -> None:
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    cases = [_npy(np.asfortranarray(x)), _npy(x, (2, 0)), _npy(x, (3, 0)),
             _npy(np.asfortranarray(x), (2, 0))]
    for a in cases:
        for _ in range(2):
            got = decode_array(a)
            np.testing.assert_array_equal(got, x)
            _same(got, a.numpy())


def test_the_decoded_array_does_not_share_the_messages_bytes() -> None:
    x = np.ones(5, dtype=np.float32)
    a = Array(x)
    for _ in range(2):
        got = decode_array(a)
        got[0] = 7.0
        np.testing.assert_array_equal(a.numpy(), x)


def _errors(a: Array) -> tuple[type[BaseException], type[BaseException]]:
    with pytest.raises(Exception) as flower:
        a.numpy()
    with pytest.raises(Exception) as ours:
        decode_array(a)
    return flower.type, ours.type


def test_malformed_bytes_raise_what_flower_raises_after_the_header_is_known() -> None:
    x = np.arange(10, dtype=np.float32)
    good = Array(x)
    decode_array(good)  # its header is now known
    short = Array(good.dtype, good.shape, good.stype, good.data[:-4])
    flower, ours = _errors(short)
    assert flower is ours
    no_magic = Array(good.dtype, good.shape, good.stype, b"\x00" * 60)
    flower, ours = _errors(no_magic)
    assert flower is ours
    with pytest.raises(TypeError, match="Unsupported serialization type"):
        decode_array(Array(good.dtype, good.shape, "torch.tensor", good.data))


def test_extra_trailing_bytes_give_numpys_reading() -> None:
    x = np.arange(6, dtype=np.int64)
    a = Array(x)
    decode_array(a)
    longer = Array(a.dtype, a.shape, a.stype, a.data + b"\x01" * 8)
    _same(decode_array(longer), longer.numpy())


def test_a_long_header_is_read_by_numpy_and_not_remembered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_read", {})
    x = np.arange(8, dtype=np.float32)
    text = "{'descr': '<f4', 'fortran_order': False, 'shape': (8,), }"
    body = text + " " * (2047 - 10 - len(text)) + "\n"  # a valid header of 2,048 bytes
    data = b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode() + x.tobytes()
    a = Array("float32", (8,), "numpy.ndarray", data)
    for _ in range(2):
        _same(decode_array(a), a.numpy())
        np.testing.assert_array_equal(decode_array(a), x)
    assert codec._read == {}


def test_a_node_cannot_grow_the_remembered_headers_without_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_read", {})
    monkeypatch.setattr(codec, "_written", {})
    monkeypatch.setattr(codec, "_MAX_HEADERS", 5)
    for n in range(1, 30):  # 29 distinct shapes, as a hostile node could send
        x = np.zeros(n, dtype=np.float32)
        _same(decode_array(encode_array(x)), x)
    assert len(codec._read) == 5 and len(codec._written) == 5


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1))
def test_round_trip_is_exact(shape: list[int], dtype: str, seed: int) -> None:
    x = np.asarray(np.random.default_rng(seed).standard_normal(shape) * 100).astype(dtype)
    a = encode_array(x)
    assert _fields(a) == _fields(Array(x))
    _same(decode_array(a), x)
