"""Names and static facts of the supported data sets, and where their files are looked for.

Every loader resolves its root directory the same way (:func:`candidate_roots`). An explicit
``data_dir`` argument is the only place searched: a run never silently trains on another copy
than the one it names. Without one, the default search is, in order:

1. for Fashion-MNIST only, the Debian package location :data:`DEBIAN_FASHION_MNIST_DIR`
   (``apt-get install dataset-fashion-mnist``);
2. the user cache directory :func:`default_cache_dir`, where ``download=True`` puts what it
   downloads (Fashion-MNIST with :mod:`fedshard.data.fetch`, CIFAR-10/100 with torchvision).

Nothing is ever synthesized: if no candidate holds the expected files, a
:class:`DataNotFoundError` lists every place that was searched and how to get the data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DATASETS",
    "DEBIAN_FASHION_MNIST_DIR",
    "DataFormatError",
    "DataNotFoundError",
    "DatasetInfo",
    "candidate_roots",
    "dataset_info",
    "default_cache_dir",
]

DATASETS: tuple[str, ...] = ("fashion-mnist", "cifar10", "cifar100", "tinyimagenet", "shakespeare")

DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


class DataNotFoundError(FileNotFoundError):
    """Raised when a data set's files are in none of the searched locations.

    The message names every directory that was searched, the layout that was expected there
    and how to obtain the data; no synthetic stand-in data is ever returned instead.
    """


class DataFormatError(ValueError):
    """Raised when a data file is damaged or holds what its data set cannot hold.

    Truncated or undecodable files, labels outside ``[0, num_classes)``, images of the wrong
    size: found when the files are loaded, not later inside training. The message names the
    file, what was expected and found, and what to do.
    """


@dataclass(frozen=True)
class DatasetInfo:
    """Static description of a data set.

    Attributes
    ----------
    name : str
        One of :data:`DATASETS`.
    num_classes : int
        Number of labels; for ``"shakespeare"`` the size of the character vocabulary
        (LEAF's 80 characters plus one index for unknown characters).
    in_channels : int
        Image channels; ``0`` for text.
    image_size : int
        Height = width of the images in pixels; ``0`` for text.
    task : str
        ``"image"`` (one label per image) or ``"next-char"`` (a label at every position).
    partition : str
        How clients are simulated: ``"dirichlet"`` (Dir(α·p) class priors, Hsu et al. 2019),
        ``"pachinko"`` (two-stage coarse/fine, CIFAR-100) or ``"natural"`` (one client per
        speaking role, Shakespeare).
    default_alpha : float or None
        Concentration used when ``load_partition`` gets ``alpha=None`` (paper, Sec. 4.1);
        for ``"pachinko"`` the coarse-label α (the fine-label α is
        :attr:`default_alpha_fine`); ``None`` for the natural split.
    default_alpha_fine : float or None
        Coarse-to-fine α of the Pachinko split; ``None`` otherwise.
    """

    name: str
    num_classes: int
    in_channels: int
    image_size: int
    task: str
    partition: str = "dirichlet"
    default_alpha: float | None = None
    default_alpha_fine: float | None = None


_INFOS: dict[str, DatasetInfo] = {
    "fashion-mnist": DatasetInfo("fashion-mnist", 10, 1, 28, "image", "dirichlet", 1.0),
    "cifar10": DatasetInfo("cifar10", 10, 3, 32, "image", "dirichlet", 1.0),
    "cifar100": DatasetInfo("cifar100", 100, 3, 32, "image", "pachinko", 1.0, 10.0),
    "tinyimagenet": DatasetInfo("tinyimagenet", 200, 3, 64, "image", "dirichlet", 10.0),
    # 80 LEAF characters + 1 unknown index, see fedshard.data.shakespeare.VOCAB_SIZE.
    "shakespeare": DatasetInfo("shakespeare", 81, 0, 0, "next-char", "natural"),
}
assert tuple(_INFOS) == DATASETS


def dataset_info(name: str) -> DatasetInfo:
    """Return the :class:`DatasetInfo` of ``name``.

    Parameters
    ----------
    name : str
        One of :data:`DATASETS`.

    Raises
    ------
    ValueError
        If ``name`` is not a supported data set.
    """
    try:
        return _INFOS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown data set {name!r}: expected one of {DATASETS}; no data was loaded."
        ) from None


def default_cache_dir() -> Path:
    """Directory that ``download=True`` downloads into and that is always searched last.

    ``$FEDSHARD_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/fedshard/data``, else
    ``~/.cache/fedshard/data``.
    """
    explicit = os.environ.get("FEDSHARD_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "fedshard" / "data"


def candidate_roots(name: str, data_dir: str | os.PathLike[str] | None) -> list[Path]:
    """Directories searched for ``name``, in order (see the module docstring).

    Parameters
    ----------
    name : str
        One of :data:`DATASETS`.
    data_dir : str or path-like or None
        Explicit root given by the caller; ``None`` or ``""`` means none.

    Returns
    -------
    list of Path
        ``[data_dir]`` when it is given, else the default locations without duplicates; they
        need not exist.
    """
    dataset_info(name)  # validates the name
    if data_dir is not None and str(data_dir) != "":
        return [Path(data_dir).expanduser()]
    roots: list[Path] = []
    if name == "fashion-mnist":
        roots.append(DEBIAN_FASHION_MNIST_DIR)
    roots.append(default_cache_dir())
    unique: list[Path] = []
    for root in roots:
        if root not in unique:
            unique.append(root)
    return unique
