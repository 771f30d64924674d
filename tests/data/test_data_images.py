"""Image loaders on small files written in the real formats, and the real Fashion-MNIST."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from fakedata import (
    write_cifar10,
    write_cifar100,
    write_fashion_mnist,
    write_idx,
    write_tinyimagenet,
)

from fedshard.data import (
    DataNotFoundError,
    clear_cache,
    dataset_info,
    load_partition,
    load_test_set,
    per_image_standardization,
    registry,
)
from fedshard.data.image_files import read_idx, read_split


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    # Never search or fill the user's cache, never find the Debian files unless a test asks.
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "no-debian")
    clear_cache()
    yield
    clear_cache()


def _standardize_reference(image: np.ndarray) -> np.ndarray:
    """tf.image.per_image_standardization, written out in float64 numpy."""
    x = image.astype(np.float64)
    std = max(x.std(), 1.0 / np.sqrt(x.size))  # population std
    return (x - x.mean()) / std


def _stack(dataset) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = zip(*(dataset[i] for i in range(len(dataset))), strict=True)
    return torch.stack(xs).numpy(), torch.stack(ys).numpy()


# --- per-image standardization -------------------------------------------------------------


def test_standardization_matches_the_tensorflow_formula():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(4, 3, 5, 6), dtype=np.uint8)
    images[1] = 17  # constant image: std 0 -> floor 1/sqrt(90), result all zeros
    out = per_image_standardization(torch.from_numpy(images))
    assert out.dtype == torch.float32 and out.shape == images.shape
    for i in range(4):
        np.testing.assert_allclose(out[i].numpy(), _standardize_reference(images[i]), atol=1e-5)
        single = per_image_standardization(torch.from_numpy(images[i]))
        torch.testing.assert_close(single, out[i])
    assert torch.count_nonzero(out[1]) == 0
    double = per_image_standardization(torch.from_numpy(images).double())
    assert double.dtype == torch.float64


def test_uint8_images_standardize_the_same_alone_or_in_any_batch():
    """Bit for bit, whatever the batch (a float reduction would round by its vectorization),
    and within float32 rounding of the float64 formula."""
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(300, 3, 32, 32), dtype=np.uint8)
    images[5] = 200  # constant
    images[6] = np.where(rng.random((3, 32, 32)) < 0.5, 0, 255)  # largest variance
    x = torch.from_numpy(images)
    alone = torch.stack([per_image_standardization(img) for img in x])
    for size in (1, 7, 64, 300):
        batched = torch.cat([per_image_standardization(x[i:i + size])
                             for i in range(0, len(x), size)])
        assert torch.equal(batched, alone), size
    want = np.stack([_standardize_reference(img) for img in images])
    err = np.abs(alone.numpy().astype(np.float64) - want)
    assert err.max() <= 4 * np.finfo(np.float32).eps * max(1.0, np.abs(want).max())
    assert torch.count_nonzero(alone[5]) == 0
    strided = x.transpose(2, 3)  # not contiguous
    assert torch.equal(per_image_standardization(strided),
                       torch.stack([per_image_standardization(i.contiguous()) for i in strided]))


def test_wide_integer_images_take_the_float_formula():
    """int32 pixels too large for exact int64 sums of squares are standardized as floats."""
    x = torch.from_numpy(np.random.default_rng(2).integers(0, 2**30, size=(4, 3, 8, 8),
                                                           dtype=np.int32))
    want = np.stack([_standardize_reference(img) for img in x.numpy()])
    got = per_image_standardization(x).numpy().astype(np.float64)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def test_standardization_rejects_wrong_rank():
    with pytest.raises(
        ValueError, match=r"expects \(C, H, W\) or \(B, C, H, W\), got shape \(5, 5\)"
    ):
        per_image_standardization(torch.zeros(5, 5))


# --- idx / Fashion-MNIST -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a-idx3-ubyte.gz", "a-idx3-ubyte"])
def test_read_idx_round_trip(tmp_path, name):
    array = np.random.default_rng(1).integers(0, 256, size=(7, 4, 3), dtype=np.uint8)
    write_idx(tmp_path / name, array)
    np.testing.assert_array_equal(read_idx(tmp_path / name), array)


def test_read_idx_rejects_corrupt_files(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x00\x08\x01\x00\x00\x00\x02ab")
    with pytest.raises(ValueError, match=r"bad magic number"):
        read_idx(tmp_path / "bad")
    (tmp_path / "int").write_bytes(b"\x00\x00\x0c\x01\x00\x00\x00\x01abcd")
    with pytest.raises(ValueError, match=r"element type 0x0c, expected 0x08"):
        read_idx(tmp_path / "int")
    with gzip.open(tmp_path / "short.gz", "wb") as f:
        f.write(b"\x00\x00\x08\x01\x00\x00\x00\x05abc")
    with pytest.raises(ValueError, match=r"announces \(5,\) = 5 bytes of data, found 3"):
        read_idx(tmp_path / "short.gz")


@pytest.mark.parametrize(
    ("subdir", "gz"), [("", True), ("fashion-mnist", True), ("FashionMNIST/raw", False)]
)
def test_fashion_mnist_layouts(tmp_path, subdir, gz):
    written = write_fashion_mnist(tmp_path / "d" / subdir, 50, 20, np.random.default_rng(2), gz=gz)
    test = load_test_set("fashion-mnist", data_dir=tmp_path / "d")
    x, y = _stack(test)
    images, labels = written["test"]
    assert x.shape == (20, 1, 28, 28) and x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(y, labels)
    for i in range(20):
        np.testing.assert_allclose(x[i, 0], _standardize_reference(images[i]), atol=1e-5)


def test_partitions_of_fake_fashion_mnist_cover_the_training_set(tmp_path):
    images, labels = write_fashion_mnist(tmp_path, 60, 10, np.random.default_rng(3))["train"]
    reference = np.stack([_standardize_reference(img) for img in images])  # (60, 28, 28)
    seen = []
    for pid in range(7):
        x, y = _stack(load_partition("fashion-mnist", pid, 7, data_dir=tmp_path, alpha=0.5))
        assert len(x) in (8, 9)
        for xi, yi in zip(x, y, strict=True):
            # Random pixels make every image unique: find the source by nearest reference.
            distance = np.abs(reference - xi[0]).max(axis=(1, 2))
            idx = int(distance.argmin())
            assert distance[idx] < 1e-5 and labels[idx] == yi
            seen.append(idx)
    assert sorted(seen) == list(range(60))


def test_real_fashion_mnist_sizes_and_class_counts():
    root = Path("/usr/share/datasets/fashion-mnist")
    if not root.is_dir():
        pytest.skip(f"{root} absent; install it with: apt-get install dataset-fashion-mnist")
    train = load_partition("fashion-mnist", 0, 1, data_dir=root)  # one client holds all
    test = load_test_set("fashion-mnist", data_dir=root)
    assert len(train) == 60_000 and len(test) == 10_000
    assert np.bincount(train.targets).tolist() == [6000] * 10
    assert np.bincount(test.targets).tolist() == [1000] * 10
    x, y = test[0]
    assert x.shape == (1, 28, 28) and y.item() == 9  # the first test image is an ankle boot
    assert abs(x.mean().item()) < 1e-5 and x.std(correction=0).item() == pytest.approx(1, abs=1e-4)


# --- CIFAR ----------------------------------------------------------------------------------


def test_cifar10_pickles_load_in_channel_first_order(tmp_path):
    written = write_cifar10(tmp_path, 6, 9, np.random.default_rng(4))
    x, y = _stack(load_test_set("cifar10", data_dir=tmp_path))
    images, labels = written["test"]
    np.testing.assert_array_equal(y, labels)
    for i in range(9):
        # The writer stores HWC images as R, G, B planes; channel c of x must be colour c.
        np.testing.assert_allclose(
            x[i], _standardize_reference(images[i].transpose(2, 0, 1)), atol=1e-5
        )
    train = [load_partition("cifar10", p, 3, data_dir=tmp_path) for p in range(3)]
    assert sorted(np.concatenate([d.targets for d in train]).tolist()) == sorted(
        written["train"][1].tolist()
    )
    assert [len(d) for d in train] == [10, 10, 10]


def test_cifar100_uses_coarse_labels_for_pachinko(tmp_path):
    written = write_cifar100(tmp_path, 400, 30, np.random.default_rng(5))
    arrays = read_split("cifar100", tmp_path / "cifar-100-python", "train")
    images, fine, coarse = written["train"]
    np.testing.assert_array_equal(arrays.labels, fine)
    np.testing.assert_array_equal(arrays.coarse_labels, coarse)
    np.testing.assert_array_equal(arrays.images, images.transpose(0, 3, 1, 2))

    def top_coarse_share(alpha_coarse):
        # 20 clients of 20 examples; each coarse label has 20 examples.
        parts = [
            load_partition("cifar100", p, 20, data_dir=tmp_path, alpha=alpha_coarse)
            for p in range(20)
        ]
        assert sorted(len(p) for p in parts) == [20] * 20
        return np.mean([np.bincount(p.targets // 5).max() / 20 for p in parts])

    assert top_coarse_share(0.01) > top_coarse_share(100.0) + 0.2
    assert dataset_info("cifar100").num_classes == 100
    assert len(load_test_set("cifar100", data_dir=tmp_path, max_examples=7)) == 7


# --- TinyImageNet ----------------------------------------------------------------------------


def test_tinyimagenet_folder_layout(tmp_path):
    wnids = ["n03", "n01", "n02"]  # not sorted in wnids.txt; classes follow sorted order
    written = write_tinyimagenet(tmp_path, wnids, 3, 5, np.random.default_rng(6))
    folder = tmp_path / "tiny-imagenet-200"
    for split in ("train", "test"):
        arrays = read_split("tinyimagenet", folder, split)
        colours, labels = written[split]
        assert arrays.images.shape == (len(labels), 3, 64, 64)
        np.testing.assert_array_equal(arrays.labels, labels)
        mean_colour = arrays.images.reshape(len(labels), 3, -1).mean(axis=2)
        np.testing.assert_allclose(mean_colour, colours, atol=3)  # JPEG of a flat colour
    part = load_partition("tinyimagenet", 0, 2, data_dir=tmp_path)
    x, y = part[0]
    assert x.shape == (3, 64, 64) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert len(part) + len(load_partition("tinyimagenet", 1, 2, data_dir=tmp_path)) == 9
    assert len(load_test_set("tinyimagenet", data_dir=tmp_path)) == 5


def test_tinyimagenet_bad_annotation_is_reported(tmp_path):
    write_tinyimagenet(tmp_path, ["n01"], 1, 2, np.random.default_rng(7))
    ann = tmp_path / "tiny-imagenet-200" / "val" / "val_annotations.txt"
    ann.write_text("val_0.JPEG\tn99\t0\t0\t1\t1\n")
    with pytest.raises(ValueError, match=r"val_annotations.txt line 1: .*got 'val_0.JPEG\\tn99"):
        load_test_set("tinyimagenet", data_dir=tmp_path)


# --- missing data and download ----------------------------------------------------------------


def test_missing_data_says_where_it_looked_and_what_to_do(tmp_path):
    # default search: the Debian location, then the cache
    with pytest.raises(DataNotFoundError) as info:
        load_partition("fashion-mnist", 0, 2)
    message = str(info.value)
    assert str(tmp_path / "no-debian") in message and str(tmp_path / "cache") in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert "--run-config 'download=true'" in message
    assert isinstance(info.value, FileNotFoundError)
    # an explicit data-dir is the only place searched (no fallback: see tests/faults)
    with pytest.raises(DataNotFoundError) as info:
        load_partition("fashion-mnist", 0, 2, data_dir=tmp_path / "empty")
    message = str(info.value)
    assert f"data-dir={tmp_path / 'empty'} (searched: {tmp_path / 'empty'});" in message
    with pytest.raises(DataNotFoundError,
                       match=r"tiny-imagenet-200/ with wnids.txt.*--run-config 'data-dir=\"/path"):
        load_test_set("tinyimagenet", data_dir=tmp_path)
    with pytest.raises(DataNotFoundError, match=r"cifar-100-python/.*--run-config 'download=true'"):
        load_test_set("cifar100", data_dir=tmp_path)


def test_download_flag_fetches_into_the_data_dir(tmp_path, monkeypatch):
    import torchvision.datasets as tvd

    calls = []

    class FakeCIFAR10:  # stands in for torchvision's network download
        def __init__(self, root, train, download):
            calls.append((root, train, download))
            if not (Path(root) / "cifar-10-batches-py").exists():
                write_cifar10(Path(root), 2, 3, np.random.default_rng(8))

    monkeypatch.setattr(tvd, "CIFAR10", FakeCIFAR10)
    with pytest.raises(DataNotFoundError):
        load_test_set("cifar10", data_dir=tmp_path / "dl")  # download=False: no network use
    assert calls == []
    assert len(load_test_set("cifar10", data_dir=tmp_path / "dl", download=True)) == 3
    assert calls[0] == (str(tmp_path / "dl"), True, True)
