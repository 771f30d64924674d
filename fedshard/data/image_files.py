"""Readers for the on-disk formats of the image data sets, and their download.

Accepted layouts below a root directory ``R`` (the root itself may also be the data set's own
folder, e.g. ``R = .../cifar-10-batches-py``):

* Fashion-MNIST: the four idx files ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (each plain or ``.gz``) directly in
  ``R`` (Debian's flat layout), in ``R/fashion-mnist/`` or in ``R/FashionMNIST/raw/``
  (torchvision's layout).
* CIFAR-10: ``R/cifar-10-batches-py/{data_batch_1..5, test_batch}`` (the Python pickles).
* CIFAR-100: ``R/cifar-100-python/{train, test}`` (pickles with ``fine_labels`` and
  ``coarse_labels``).
* TinyImageNet: ``R/tiny-imagenet-200/`` with ``wnids.txt``, ``train/<wnid>/images/*.JPEG``,
  ``val/images/*.JPEG`` and ``val/val_annotations.txt``. The labelled ``val`` split serves as
  the test set (the official test labels are not public). Class ``i`` is the ``i``-th wnid in
  sorted order (as torchvision's ``ImageFolder``).

The pickles are read with :mod:`pickle`; only point ``data_dir`` at files you trust.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import pickle
import socket
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fedshard.data.fetch import fetch_fashion_mnist, locked
from fedshard.data.images import ImageArrays
from fedshard.data.registry import DataFormatError, DataNotFoundError, dataset_info

__all__ = ["IMAGE_LAYOUTS", "download", "locate", "read_idx", "read_split"]

logger = logging.getLogger(__name__)

IMAGE_LAYOUTS: dict[str, str] = {
    "fashion-mnist": (
        "{train,t10k}-images-idx3-ubyte[.gz] and {train,t10k}-labels-idx1-ubyte[.gz] directly "
        "in it, in fashion-mnist/ or in FashionMNIST/raw/"
    ),
    "cifar10": "cifar-10-batches-py/ with data_batch_1..data_batch_5 and test_batch",
    "cifar100": "cifar-100-python/ with the pickles train and test",
    "tinyimagenet": (
        "tiny-imagenet-200/ with wnids.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG and "
        "val/val_annotations.txt"
    ),
}

_DOWNLOAD_TIMEOUT_S = 60.0
_IDX_UINT8 = 0x08
_FMNIST_PREFIX = {"train": "train", "test": "t10k"}
_IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png"}
_REPLACE = "The file is damaged or was not copied completely: delete it and fetch it again."


#: The largest payload :func:`read_idx` reads (bytes): Fashion-MNIST's training images are
#: 47 MB; a header announcing more is refused before anything is inflated.
MAX_IDX_BYTES = 1 << 31


def read_idx(path: Path, *, item_shape: tuple[int, ...] | None = None,
             max_bytes: int = MAX_IDX_BYTES) -> np.ndarray:
    """Read an idx file (LeCun's MNIST format), plain or gzip-compressed, streaming: the
    header is read and checked first, then exactly the bytes it announces (a gzip bomb is
    never inflated past them).

    Parameters
    ----------
    path : Path
        File whose name ends in ``.gz`` for gzip, anything else for plain.
    item_shape : tuple of int, optional
        The dimensions after the first the file must have (``(28, 28)`` for images, ``()``
        for labels), checked against the header before the payload is read.
    max_bytes : int
        The largest payload read; a header announcing more is refused.

    Returns
    -------
    numpy.ndarray
        ``uint8`` array with the dimensions stored in the header.

    Raises
    ------
    DataFormatError
        If a ``.gz`` file cannot be decompressed (truncated, damaged), the header is
        malformed or announces other dimensions than ``item_shape`` or more than
        ``max_bytes``, the element type is not unsigned byte, or the payload is shorter or
        longer than the header says.
    """
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as handle:
            return _read_idx_stream(path, handle, item_shape, max_bytes)
    except (EOFError, OSError, zlib.error) as err:
        gz = path.suffix == ".gz"
        raise DataFormatError(
            f"{path} ({path.stat().st_size} bytes): cannot {'decompress' if gz else 'read'} "
            f"it ({type(err).__name__}: {err}); expected a complete "
            f"{'gzip-compressed ' if gz else ''}idx file. {_REPLACE}"
        ) from err


def _read_idx_stream(path: Path, handle: Any, item_shape: tuple[int, ...] | None,
                     max_bytes: int) -> np.ndarray:
    # Header: two zero bytes, a type code (0x08 = unsigned byte), the number of dimensions,
    # then one big-endian uint32 per dimension.
    magic: bytes = handle.read(4)
    if len(magic) < 4 or magic[0] != 0 or magic[1] != 0:
        raise DataFormatError(f"{path}: not an idx file (bad magic number); it was not loaded.")
    if magic[2] != _IDX_UINT8:
        raise DataFormatError(
            f"{path}: idx element type 0x{magic[2]:02x}, expected 0x08 (unsigned byte)."
        )
    ndim = magic[3]
    raw: bytes = handle.read(4 * ndim)
    if len(raw) < 4 * ndim:
        raise DataFormatError(f"{path}: idx header truncated ({4 + len(raw)} bytes, expected "
                              f"{4 + 4 * ndim}). {_REPLACE}")
    dims = struct.unpack(">" + "I" * ndim, raw)
    if item_shape is not None and tuple(dims[1:]) != tuple(item_shape):
        want = "(N, " + ", ".join(map(str, item_shape)) + ")" if item_shape else "(N,)"
        raise DataFormatError(
            f"{path}: the idx header announces dimensions {dims}, expected {want}; it was not "
            "loaded. Check that the folder holds this data set, not another idx data set.")
    expected = int(np.prod(dims, dtype=np.int64))
    if expected > max_bytes:
        raise DataFormatError(
            f"{path}: the idx header announces {dims} = {expected:,} bytes of data, more than "
            f"the {max_bytes:,} read at most; it was not loaded. {_REPLACE}")
    data: bytes = handle.read(expected)
    if len(data) != expected:
        raise DataFormatError(f"{path}: idx header announces {dims} = {expected} bytes of "
                              f"data, found {len(data)}. {_REPLACE}")
    if handle.read(1):
        raise DataFormatError(f"{path}: idx header announces {dims} = {expected} bytes of "
                              f"data, found more; it was not loaded. {_REPLACE}")
    return np.frombuffer(data, dtype=np.uint8).reshape(dims)


def _idx_file(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


def _fmnist_files(root: Path, split: str) -> tuple[Path, Path] | None:
    prefix = _FMNIST_PREFIX[split]
    for folder in (root, root / "fashion-mnist", root / "FashionMNIST" / "raw"):
        images = _idx_file(folder, f"{prefix}-images-idx3-ubyte")
        labels = _idx_file(folder, f"{prefix}-labels-idx1-ubyte")
        if images is not None and labels is not None:
            return images, labels
    return None


def _own_folder(root: Path, folder: str) -> list[Path]:
    return [root / folder, *([root] if root.name == folder else [])]


def locate(name: str, root: Path, split: str) -> Path | None:
    """Return the folder below ``root`` that holds ``split`` of ``name``, or ``None``.

    Parameters
    ----------
    name : str
        ``"fashion-mnist"``, ``"cifar10"``, ``"cifar100"`` or ``"tinyimagenet"``.
    root : Path
        Candidate root (see the module docstring for the accepted layouts).
    split : str
        ``"train"`` or ``"test"``.
    """
    if name == "fashion-mnist":
        files = _fmnist_files(root, split)
        return None if files is None else files[0].parent
    if name == "cifar10":
        needed = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
        folders = _own_folder(root, "cifar-10-batches-py")
    elif name == "cifar100":
        needed = [split]
        folders = _own_folder(root, "cifar-100-python")
    elif name == "tinyimagenet":
        needed = ["wnids.txt", "train"] if split == "train" else ["wnids.txt", "val/images"]
        if split == "test":
            needed.append("val/val_annotations.txt")
        folders = [root / "tiny-imagenet-200", *([root] if (root / "wnids.txt").is_file() else [])]
    else:
        raise ValueError(f"{name!r} is not an image data set; expected one of {IMAGE_LAYOUTS}.")
    for folder in folders:
        if all((folder / item).exists() for item in needed):
            return folder
    return None


def _unpickle(path: Path) -> dict[Any, Any]:
    try:
        with open(path, "rb") as handle:
            content = pickle.load(handle, encoding="bytes")
    except (EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError,
            IndexError, UnicodeDecodeError) as err:
        raise DataFormatError(
            f"{path} ({path.stat().st_size} bytes): cannot unpickle it ({type(err).__name__}: "
            f"{err}); expected a complete pickled CIFAR batch (a dict). {_REPLACE}"
        ) from err
    if not isinstance(content, dict):
        raise DataFormatError(
            f"{path}: expected a pickled dict (CIFAR format), got {type(content)}.")
    return content


def _entry(content: dict[Any, Any], key: str, path: Path) -> Any:
    # The official pickles were written by Python 2 and have bytes keys.
    for candidate in (key.encode(), key):
        if candidate in content:
            return content[candidate]
    raise ValueError(f"{path}: CIFAR pickle has no {key!r} entry (keys: {list(content)}).")


def _cifar_batch(path: Path, label_keys: tuple[str, ...]) -> list[np.ndarray]:
    content = _unpickle(path)
    raw = np.asarray(_entry(content, "data", path))
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != 3 * 32 * 32:
        raise DataFormatError(
            f"{path}: 'data' must be (N, 3072) uint8 (32x32 RGB images), got {raw.dtype} "
            f"{raw.shape}. {_REPLACE}")
    data = raw
    # Rows are 1024 red, 1024 green, 1024 blue values, each plane row-major: (N, 3, 32, 32).
    images = data.reshape(-1, 3, 32, 32)
    labels = [np.asarray(_entry(content, k, path), dtype=np.int64) for k in label_keys]
    for key, arr in zip(label_keys, labels, strict=True):
        if arr.shape != (images.shape[0],):
            raise DataFormatError(
                f"{path}: {key!r} has shape {arr.shape}, expected ({len(images)},).")
    return [images, *labels]


def _read_tinyimagenet(folder: Path, split: str) -> ImageArrays:
    from PIL import Image

    wnids = sorted(set((folder / "wnids.txt").read_text().split()))
    num_classes = dataset_info("tinyimagenet").num_classes
    if not 0 < len(wnids) <= num_classes:
        raise DataFormatError(
            f"{folder / 'wnids.txt'}: lists {len(wnids)} classes, expected 1 to {num_classes} "
            "(TinyImageNet has 200); the file is damaged or belongs to another data set."
        )
    index = {wnid: i for i, wnid in enumerate(wnids)}
    files: list[Path] = []
    labels: list[int] = []
    if split == "train":
        for wnid in wnids:
            class_files = sorted(
                p
                for p in (folder / "train" / wnid / "images").glob("*")
                if p.suffix.lower() in _IMAGE_SUFFIXES
            )
            files += class_files
            labels += [index[wnid]] * len(class_files)
    else:
        for line_no, line in enumerate(
            (folder / "val" / "val_annotations.txt").read_text().splitlines(), start=1
        ):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) < 2 or fields[1] not in index:
                raise ValueError(
                    f"{folder / 'val' / 'val_annotations.txt'} line {line_no}: expected "
                    f"'<file>\\t<wnid>...' with a wnid from wnids.txt, got {line!r}."
                )
            files.append(folder / "val" / "images" / fields[0])
            labels.append(index[fields[1]])
    if not files:
        raise ValueError(f"{folder}: no TinyImageNet {split} images found.")
    logger.info("Decoding %d TinyImageNet %s images from %s", len(files), split, folder)
    images = np.empty((len(files), 3, 64, 64), dtype=np.uint8)
    for i, path in enumerate(files):
        try:
            with Image.open(path) as img:
                pixels = np.asarray(img.convert("RGB"))  # (H, W, 3); some are grayscale
        except (OSError, SyntaxError, ValueError) as err:  # PIL's truncated/unknown-format errors
            raise DataFormatError(
                f"{path}: cannot decode it as an image ({type(err).__name__}: {err}); "
                f"expected a 64x64 JPEG. {_REPLACE}") from err
        if pixels.shape != (64, 64, 3):
            raise DataFormatError(
                f"{path}: TinyImageNet images are 64x64, got {pixels.shape[:2]}.")
        images[i] = pixels.transpose(2, 0, 1)
    return ImageArrays(images, np.asarray(labels, dtype=np.int64))


def read_split(name: str, folder: Path, split: str) -> ImageArrays:
    """Read ``split`` of ``name`` from ``folder`` as returned by :func:`locate`.

    Parameters
    ----------
    name : str
        Image data set name.
    folder : Path
        Folder returned by :func:`locate`.
    split : str
        ``"train"`` or ``"test"``.

    Returns
    -------
    ImageArrays
        ``uint8`` images ``(N, C, H, W)`` and ``int64`` labels (CIFAR-100 also coarse labels).
    """
    if name == "fashion-mnist":
        files = _fmnist_files(folder, split)
        if files is None:
            raise DataNotFoundError(f"{folder}: Fashion-MNIST {split} idx files disappeared.")
        images = read_idx(files[0], item_shape=(28, 28))
        labels = read_idx(files[1], item_shape=()).astype(np.int64)
        if images.shape[0] == 0:
            raise DataFormatError(f"{files[0]}: holds 0 images; expected the Fashion-MNIST "
                                  f"{split} set. {_REPLACE}")
        if labels.shape != (images.shape[0],):
            raise DataFormatError(
                f"{files[1]}: expected ({images.shape[0]},) labels to match {files[0]}, got "
                f"{labels.shape}. Images and labels come from different copies or one is "
                "damaged; fetch both again."
            )
        _check_labels(name, labels, files[1])
        return ImageArrays(np.ascontiguousarray(images[:, None]), labels)
    if name == "cifar10":
        batches = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
        parts = [_cifar_batch(folder / b, ("labels",)) for b in batches]
        for batch, part in zip(batches, parts, strict=True):
            _check_labels(name, part[1], folder / batch)
        return ImageArrays(
            np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        )
    if name == "cifar100":
        images, fine, coarse = _cifar_batch(folder / split, ("fine_labels", "coarse_labels"))
        _check_labels(name, fine, folder / split, "fine_labels")
        _check_labels(name, coarse, folder / split, "coarse_labels", _CIFAR100_COARSE)
        return ImageArrays(np.ascontiguousarray(images), fine, coarse)
    if name == "tinyimagenet":
        return _read_tinyimagenet(folder, split)
    raise ValueError(f"{name!r} is not an image data set; expected one of {IMAGE_LAYOUTS}.")


_CIFAR100_COARSE = 20


def _check_labels(name: str, labels: np.ndarray, source: Path, what: str = "labels",
                  num_classes: int | None = None) -> None:
    """Refuse labels outside ``[0, num_classes)`` (they would fail later, inside training)."""
    k = dataset_info(name).num_classes if num_classes is None else num_classes
    bad = np.flatnonzero((labels < 0) | (labels >= k))
    if bad.size:
        raise DataFormatError(
            f"{source}: {bad.size} of {labels.size} {what} are outside [0, {k}) for {name} "
            f"(first at index {bad[0]}: {labels[bad[0]]}). The file is damaged or belongs to "
            "another data set; fetch the right one again."
        )


@contextlib.contextmanager
def _socket_timeout(seconds: float) -> Iterator[None]:
    # torchvision's downloader calls urllib without a timeout, so offline it could block on a
    # socket for a long time; the process-wide default bounds every blocking socket operation.
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def download(name: str, root: Path) -> None:
    """Download ``name`` into ``root`` (Fashion-MNIST, CIFAR-10/100).

    Fashion-MNIST's four official files go to ``root/fashion-mnist/`` (``root`` itself when it
    is named ``fashion-mnist``), checksummed and renamed into place
    (:func:`fedshard.data.fetch.fetch_fashion_mnist`); CIFAR is downloaded with torchvision,
    which checks its MD5. Processes downloading into one ``root`` take turns (a file lock).

    Parameters
    ----------
    name : str
        ``"fashion-mnist"``, ``"cifar10"`` or ``"cifar100"``.
    root : Path
        Target directory; torchvision creates ``cifar-10-batches-py/`` or ``cifar-100-python/``
        inside it.

    Raises
    ------
    DataNotFoundError
        If the data set cannot be downloaded (no network, a file cut short or with another
        checksum, no download for it); every blocking socket operation is bounded by 60 s,
        so this does not hang offline.
    """
    if name == "fashion-mnist":
        fetch_fashion_mnist(root if root.name == "fashion-mnist" else root / "fashion-mnist")
        return
    import torchvision.datasets as tvd

    classes: dict[str, Any] = {"cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100}
    if name not in classes:
        raise DataNotFoundError(
            f"{name} cannot be downloaded automatically; place it by hand under a data "
            f"directory ({IMAGE_LAYOUTS.get(name, '')})."
        )
    with locked(root):
        logger.info("Downloading %s with torchvision into %s", name, root)
        try:
            with _socket_timeout(_DOWNLOAD_TIMEOUT_S):
                for train in (True, False):
                    classes[name](root=str(root), train=train, download=True)
        except Exception as exc:  # urllib, socket and checksum errors all mean "not available"
            raise DataNotFoundError(
                f"Downloading {name} into {root} failed ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())})."
            ) from exc
