"""Writers of small fake data sets in the real on-disk formats, for the loader tests.

Each writer follows the published format description, not fedshard's reader:

* idx (LeCun, http://yann.lecun.com/exdb/mnist/): magic ``00 00 08 <ndim>``, big-endian uint32
  dimensions, raw bytes;
* CIFAR (https://www.cs.toronto.edu/~kriz/cifar.html): pickled dicts with bytes keys,
  ``data`` ``(N, 3072)`` uint8 in R, G, B planes, ``labels`` / ``fine_labels`` /
  ``coarse_labels`` lists;
* TinyImageNet: ``wnids.txt``, ``train/<wnid>/images/<wnid>_<i>.JPEG``,
  ``val/images/val_<i>.JPEG`` and tab-separated ``val/val_annotations.txt``;
* LEAF Shakespeare: JSON with ``users``, ``num_samples``, ``user_data[user] = {"x", "y"}``,
  where ``x`` are the 80-character windows of the role's text and ``y`` the next characters.

Every writer returns what it wrote, so tests compare the loaders' output with it.
"""

from __future__ import annotations

import gzip
import json
import pickle
import struct
from pathlib import Path

import numpy as np
from PIL import Image


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array as an idx file; gzip-compressed if ``path`` ends in ``.gz``."""
    assert array.dtype == np.uint8
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(">" + "I" * array.ndim, *array.shape)
    payload = header + array.tobytes(order="C")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as handle:
            handle.write(payload)
    else:
        path.write_bytes(payload)


def write_fashion_mnist(
    folder: Path, n_train: int, n_test: int, rng: np.random.Generator, *, gz: bool = True
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Four idx files directly in ``folder``; returns split -> (images (N,28,28), labels)."""
    out = {}
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        rng.shuffle(labels)
        suffix = ".gz" if gz else ""
        write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", images)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
        out[split] = (images, labels.astype(np.int64))
    return out


def _cifar_dict(images: np.ndarray, labels: dict[str, np.ndarray]) -> dict[bytes, object]:
    # images (N, 32, 32, 3) HWC -> rows of R plane, G plane, B plane.
    data = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
    content: dict[bytes, object] = {b"data": data}
    for key, values in labels.items():
        content[key.encode()] = [int(v) for v in values]
    return content


def write_cifar10(
    root: Path, n_per_batch: int, n_test: int, rng: np.random.Generator
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``root/cifar-10-batches-py``; returns split -> (images (N,32,32,3) HWC, labels)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    out: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {
        "train": ([], []),
        "test": ([], []),
    }
    names = [(f"data_batch_{i}", "train", n_per_batch) for i in range(1, 6)]
    for name, split, n in [*names, ("test_batch", "test", n_test)]:
        images = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n)
        with open(folder / name, "wb") as handle:
            pickle.dump(_cifar_dict(images, {"labels": labels}), handle, protocol=2)
        out[split][0].append(images)
        out[split][1].append(labels)
    return {k: (np.concatenate(v[0]), np.concatenate(v[1])) for k, v in out.items()}


def write_cifar100(
    root: Path, n_train: int, n_test: int, rng: np.random.Generator
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``root/cifar-100-python``; fine label f has coarse label f // 5 (as a fixed mapping).

    Returns split -> (images (N,32,32,3) HWC, fine labels, coarse labels).
    """
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
        fine = np.arange(n) % 100
        rng.shuffle(fine)
        coarse = fine // 5
        with open(folder / split, "wb") as handle:
            content = _cifar_dict(images, {"fine_labels": fine, "coarse_labels": coarse})
            pickle.dump(content, handle, protocol=2)
        out[split] = (images, fine, coarse)
    return out


def write_tinyimagenet(
    root: Path, wnids: list[str], n_train_per_class: int, n_val: int, rng: np.random.Generator
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``root/tiny-imagenet-200`` with lossless-looking flat-colour JPEGs.

    Every image is a single colour (JPEG reproduces flat colour blocks almost exactly); one
    training image per class is written in grayscale mode ``"L"``, as some real ones are.
    Returns split -> (mean RGB colour (N, 3) per image, wnid index in ``sorted(wnids)``).
    """
    folder = root / "tiny-imagenet-200"
    (folder / "val" / "images").mkdir(parents=True)
    (folder / "wnids.txt").write_text("\n".join(wnids) + "\n")
    index = {w: i for i, w in enumerate(sorted(wnids))}
    colours: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    labels: dict[str, list[int]] = {"train": [], "test": []}
    for wnid in sorted(wnids):
        images_dir = folder / "train" / wnid / "images"
        images_dir.mkdir(parents=True)
        for i in range(n_train_per_class):
            if i == 0:
                grey = int(rng.integers(0, 256))
                Image.new("L", (64, 64), grey).save(images_dir / f"{wnid}_{i}.JPEG")
                colour = np.array([grey] * 3)
            else:
                colour = rng.integers(0, 256, size=3)
                Image.new("RGB", (64, 64), tuple(int(c) for c in colour)).save(
                    images_dir / f"{wnid}_{i}.JPEG"
                )
            colours["train"].append(colour)
            labels["train"].append(index[wnid])
    lines = []
    for i in range(n_val):
        wnid = wnids[int(rng.integers(0, len(wnids)))]
        colour = rng.integers(0, 256, size=3)
        name = f"val_{i}.JPEG"
        Image.new("RGB", (64, 64), tuple(int(c) for c in colour)).save(
            folder / "val" / "images" / name
        )
        lines.append(f"{name}\t{wnid}\t0\t0\t63\t63")
        colours["test"].append(colour)
        labels["test"].append(index[wnid])
    (folder / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return {k: (np.array(colours[k]), np.array(labels[k])) for k in colours}


def leaf_samples(text: str, window: int = 80) -> dict[str, list[str]]:
    """LEAF's samples of one role: every window of ``text`` and the character after it."""
    n = len(text) - window
    return {
        "x": [text[i : i + window] for i in range(n)],
        "y": [text[i + window] for i in range(n)],
    }


def write_leaf_json(path: Path, texts: dict[str, str], window: int = 80) -> None:
    """One LEAF JSON file holding the samples of ``texts`` (role -> raw text)."""
    user_data = {user: leaf_samples(text, window) for user, text in texts.items()}
    content = {
        "users": list(texts),
        "num_samples": [len(d["x"]) for d in user_data.values()],
        "user_data": user_data,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content), encoding="utf-8")
