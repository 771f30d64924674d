"""Damaged or wrong data files fail at load time, naming the file; an explicit data-dir
never falls back to another copy."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from fakedata import (
    write_cifar10,
    write_cifar100,
    write_fashion_mnist,
    write_idx,
    write_leaf_json,
    write_tinyimagenet,
)

from fedshard.data import (
    DataFormatError,
    DataNotFoundError,
    clear_cache,
    load_partition,
    load_test_set,
    registry,
)
from fedshard.data.image_files import read_idx

TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York; and all "
        "the clouds that lour'd upon our house.")


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "no-debian")
    clear_cache()
    yield
    clear_cache()


# --- an explicit data-dir is the only place searched ---------------------------------------


def test_an_explicit_data_dir_without_the_data_is_an_error_not_a_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_fashion_mnist(tmp_path / "debian", 20, 10, np.random.default_rng(9))
    write_fashion_mnist(tmp_path / "cache", 20, 10, np.random.default_rng(9))
    monkeypatch.setattr(registry, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "debian")
    empty = tmp_path / "empty"
    with pytest.raises(DataNotFoundError, match=(
        rf"fashion-mnist test data not found in data-dir={empty} \(searched: {empty}\); "
        r"expected there: .*idx3-ubyte.*An explicit data-dir is the only place searched.*fix "
        r"data-dir, or leave it empty to search the default locations"
    )) as info:
        load_test_set("fashion-mnist", data_dir=empty)
    assert str(tmp_path / "debian") not in str(info.value)
    with pytest.raises(DataNotFoundError, match=rf"train data not found in data-dir={empty}"):
        load_partition("fashion-mnist", 0, 2, data_dir=empty)
    # the default search still goes on to the next location
    assert len(load_test_set("fashion-mnist")) == 10


def test_an_explicit_data_dir_for_shakespeare_does_not_fall_back(tmp_path: Path) -> None:
    write_leaf_json(tmp_path / "cache" / "shakespeare" / "test" / "a.json", {"A": TEXT})
    with pytest.raises(DataNotFoundError, match=(
        rf"shakespeare test data not found in data-dir={tmp_path / 'leaf'}"
    )):
        load_test_set("shakespeare", data_dir=tmp_path / "leaf")
    assert len(load_test_set("shakespeare")) == len(TEXT) - 80  # default search: the cache


# --- Fashion-MNIST idx files -------------------------------------------------------------


def test_a_truncated_gz_idx_file_is_named_with_what_to_do(tmp_path: Path) -> None:
    write_fashion_mnist(tmp_path, 30, 10, np.random.default_rng(0))
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFormatError, match=(
        rf"{path} \({len(data) // 2} bytes\): cannot decompress it \(EOFError: .*\); expected "
        r"a complete gzip-compressed idx file\. The file is damaged or was not copied "
        r"completely: delete it and fetch it again\."
    )):
        load_test_set("fashion-mnist", data_dir=tmp_path)


def test_a_gz_idx_file_that_is_not_gzip_is_named(tmp_path: Path) -> None:
    write_fashion_mnist(tmp_path, 30, 10, np.random.default_rng(0))
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(b"plain bytes, no gzip header")
    with pytest.raises(DataFormatError, match=rf"{path} \(27 bytes\): cannot decompress it"):
        load_partition("fashion-mnist", 0, 1, data_dir=tmp_path)


def test_a_truncated_plain_idx_file_says_what_to_do(tmp_path: Path) -> None:
    write_fashion_mnist(tmp_path, 30, 10, np.random.default_rng(0), gz=False)
    path = tmp_path / "t10k-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(DataFormatError, match=(
        rf"{path}: idx header announces \(10,\) = 10 bytes of data, found 7\. The file is "
        r"damaged.*fetch it again"
    )):
        load_test_set("fashion-mnist", data_dir=tmp_path)


def test_a_label_out_of_range_fails_at_load_time(tmp_path: Path) -> None:
    write_fashion_mnist(tmp_path, 30, 10, np.random.default_rng(0))
    labels = np.array([0, 1, 2, 10, 4, 5, 6, 200, 8, 9], dtype=np.uint8)
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    write_idx(path, labels)
    with pytest.raises(DataFormatError, match=(
        rf"{path}: 2 of 10 labels are outside \[0, 10\) for fashion-mnist \(first at index 3: "
        r"10\)\. The file is damaged or belongs to another data set"
    )):
        load_test_set("fashion-mnist", data_dir=tmp_path)


def test_images_of_the_wrong_size_fail_at_load_time(tmp_path: Path) -> None:
    write_fashion_mnist(tmp_path, 30, 10, np.random.default_rng(0))
    path = tmp_path / "train-images-idx3-ubyte.gz"
    write_idx(path, np.zeros((30, 32, 32), dtype=np.uint8))  # e.g. another idx data set
    with pytest.raises(DataFormatError, match=(
        rf"{path}: the idx header announces dimensions \(30, 32, 32\), expected \(N, 28, "
        r"28\); it was not loaded\. Check that the folder holds this data set"
    )):
        load_partition("fashion-mnist", 0, 2, data_dir=tmp_path)


def test_images_and_labels_of_different_lengths_are_named(tmp_path: Path) -> None:
    write_fashion_mnist(tmp_path, 30, 10, np.random.default_rng(0))
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    write_idx(path, np.zeros(29, dtype=np.uint8))
    with pytest.raises(DataFormatError, match=rf"{path}: expected \(30,\) labels to match"):
        load_partition("fashion-mnist", 0, 2, data_dir=tmp_path)


def test_real_fashion_mnist_passes_the_checks() -> None:
    real = Path("/usr/share/datasets/fashion-mnist")
    if not real.is_dir():
        pytest.skip("the Debian Fashion-MNIST files are not installed")
    test = load_test_set("fashion-mnist", data_dir=real)
    assert len(test) == 10_000
    assert set(np.unique(test.targets)) == set(range(10))


# --- CIFAR pickles -----------------------------------------------------------------------


def _rewrite(path: Path, **changes: object) -> None:
    with open(path, "rb") as fh:
        content = pickle.load(fh, encoding="bytes")
    content.update({k.encode(): v for k, v in changes.items()})
    with open(path, "wb") as fh:
        pickle.dump(content, fh, protocol=2)


@pytest.mark.parametrize(("bad", "count"), [(-1, 1), (10, 1)])
def test_a_cifar10_label_out_of_range_fails_at_load_time(
    tmp_path: Path, bad: int, count: int
) -> None:
    write_cifar10(tmp_path, 4, 5, np.random.default_rng(1))
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    _rewrite(path, labels=[0, 1, bad, 3, 4])
    with pytest.raises(DataFormatError, match=(
        rf"{path}: {count} of 5 labels are outside \[0, 10\) for cifar10 \(first at index 2: "
        rf"{bad}\)"
    )):
        load_test_set("cifar10", data_dir=tmp_path)


def test_cifar100_coarse_labels_are_checked_against_20_superclasses(tmp_path: Path) -> None:
    write_cifar100(tmp_path, 100, 100, np.random.default_rng(2))
    path = tmp_path / "cifar-100-python" / "train"
    _rewrite(path, coarse_labels=[20] + [0] * 99)
    with pytest.raises(DataFormatError, match=(
        rf"{path}: 1 of 100 coarse_labels are outside \[0, 20\) for cifar100"
    )):
        load_partition("cifar100", 0, 2, data_dir=tmp_path)
    _rewrite(path, coarse_labels=[0] * 100, fine_labels=[100] * 100)
    clear_cache()
    with pytest.raises(DataFormatError, match=rf"{path}: 100 of 100 fine_labels are outside"):
        load_partition("cifar100", 0, 2, data_dir=tmp_path)


def test_cifar_data_that_is_not_uint8_is_refused(tmp_path: Path) -> None:
    write_cifar10(tmp_path, 4, 5, np.random.default_rng(1))
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    _rewrite(path, data=np.full((5, 3072), 300, dtype=np.int64))  # would wrap to 44 as uint8
    with pytest.raises(DataFormatError, match=(
        rf"{path}: 'data' must be \(N, 3072\) uint8 \(32x32 RGB images\), got int64 \(5, 3072\)"
    )):
        load_test_set("cifar10", data_dir=tmp_path)


def test_a_truncated_cifar_pickle_is_named(tmp_path: Path) -> None:
    write_cifar10(tmp_path, 4, 5, np.random.default_rng(1))
    path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(DataFormatError, match=(
        rf"{path} \(500 bytes\): cannot unpickle it \(.*\); expected a complete pickled CIFAR "
        r"batch \(a dict\)\. The file is damaged.*fetch it again"
    )):
        load_partition("cifar10", 0, 2, data_dir=tmp_path)


# --- TinyImageNet ------------------------------------------------------------------------


def test_a_truncated_tinyimagenet_jpeg_is_named(tmp_path: Path) -> None:
    write_tinyimagenet(tmp_path, ["n01", "n02"], 2, 3, np.random.default_rng(3))
    path = tmp_path / "tiny-imagenet-200" / "val" / "images" / "val_1.JPEG"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(DataFormatError, match=(
        rf"{path}: cannot decode it as an image \(.*\); expected a 64x64 JPEG\. The file is "
        r"damaged"
    )):
        load_test_set("tinyimagenet", data_dir=tmp_path)


def test_more_than_200_tinyimagenet_classes_are_refused(tmp_path: Path) -> None:
    write_tinyimagenet(tmp_path, ["n01"], 1, 1, np.random.default_rng(3))
    wnids = tmp_path / "tiny-imagenet-200" / "wnids.txt"
    wnids.write_text("\n".join(f"n{i:03d}" for i in range(201)) + "\n")
    with pytest.raises(DataFormatError, match=(
        rf"{wnids}: lists 201 classes, expected 1 to 200 \(TinyImageNet has 200\)"
    )):
        load_partition("tinyimagenet", 0, 1, data_dir=tmp_path)


# --- Shakespeare JSON --------------------------------------------------------------------


def test_a_truncated_leaf_json_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "shakespeare" / "train" / "all.json"
    write_leaf_json(path, {"A": TEXT, "B": TEXT[::-1]})
    size = len(path.read_bytes()) // 2
    path.write_bytes(path.read_bytes()[:size])
    with pytest.raises(DataFormatError, match=(
        rf"{path} \({size} bytes\): not readable as JSON \(.*\); expected a complete LEAF JSON "
        r"file\. It is damaged.*re-run LEAF's preprocess.sh or copy it again"
    )):
        load_partition("shakespeare", 0, 1, data_dir=tmp_path)


@pytest.mark.parametrize(("user_data", "found"), [
    ({"x": "abc", "y": ["d"]}, "found str"),
    ({"x": [1, 2], "y": ["a", "b"]}, "found a list with int"),
    ({"x": ["a" * 80], "y": None}, "found NoneType"),
])
def test_leaf_samples_of_the_wrong_types_are_named(
    tmp_path: Path, user_data: dict, found: str
) -> None:
    path = tmp_path / "shakespeare" / "test" / "a.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"users": ["A"], "num_samples": [1],
                                "user_data": {"A": user_data}}))
    with pytest.raises(DataFormatError, match=(
        rf"{path}: user_data\['A'\]\['[xy]'\] must be a list of strings, {found}; the file is "
        r"not LEAF's Shakespeare JSON"
    )):
        load_test_set("shakespeare", data_dir=tmp_path)



def test_a_gzip_bomb_is_refused_from_its_header_before_it_inflates(tmp_path: Path) -> None:
    """A gzip whose header announces 10 images but which inflates to 512 MiB of zeros is
    read only as far as the header says, then refused: the process never holds the rest."""
    import gzip
    import resource

    path = tmp_path / "train-images-idx3-ubyte.gz"
    header = b"\x00\x00\x08\x03" + (10).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
    chunk = bytes(1 << 24)
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(header)
        for _ in range(32):  # 512 MiB after the header
            f.write(chunk)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(DataFormatError, match=rf"{path}: idx header announces \(10, 28, 28\) = "
                       r"7840 bytes of data, found more; it was not loaded"):
        read_idx(path, item_shape=(28, 28))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB
    huge = tmp_path / "huge-idx3-ubyte"
    huge.write_bytes(b"\x00\x00\x08\x03" + (4_000_000).to_bytes(4, "big")
                     + (28).to_bytes(4, "big") * 2)
    with pytest.raises(DataFormatError, match=r"= 3,136,000,000 bytes of data, more than the "
                       r"2,147,483,648 read at most"):
        read_idx(huge, item_shape=(28, 28))


def test_idx_files_of_no_images_are_named_with_the_setting(tmp_path: Path) -> None:
    write_fashion_mnist(tmp_path, 30, 10, np.random.default_rng(0))
    path = tmp_path / "train-images-idx3-ubyte.gz"
    write_idx(path, np.zeros((0, 28, 28), dtype=np.uint8))
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(0, dtype=np.uint8))
    with pytest.raises(DataFormatError, match=rf"{path}: holds 0 images; expected the "
                       r"Fashion-MNIST train set"):
        load_partition("fashion-mnist", 0, 2, data_dir=tmp_path)


def test_a_damaged_trusted_set_names_the_setting_and_the_file(tmp_path: Path) -> None:
    from fedshard.app.config import RunConfig
    from fedshard.app.task import trusted_reference

    write_fashion_mnist(tmp_path, 30, 10, np.random.default_rng(0))
    path = tmp_path / "train-images-idx3-ubyte.gz"
    write_idx(path, np.zeros((0, 28, 28), dtype=np.uint8))
    cfg = RunConfig.from_mapping({"dataset": "fashion-mnist", "trusted-data-dir": str(tmp_path)})
    with pytest.raises(DataFormatError, match=rf"trusted-data-dir='{tmp_path}': {path}: holds 0 "
                       "images"):
        trusted_reference(cfg)
