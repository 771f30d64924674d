"""Shakespeare next-character data in LEAF's JSON format, one client per speaking role.

Accepted layout below a root ``R``: ``R/shakespeare/{train,test}/*.json`` or LEAF's own tree
``R/shakespeare/data/{train,test}/*.json`` (``R = leaf/data`` after running LEAF's
``preprocess.sh``). Each JSON file holds::

    {"users": [...], "num_samples": [...],
     "user_data": {user: {"x": [80-character strings], "y": [next characters]}}}

LEAF's samples of a role are windows over that role's lines; sample ``i`` is ``x_i`` followed
by ``y_i``. We store every sample as its 81 characters ``x_i + y_i`` and serve
``x = chars[:-1]`` and ``y = chars[1:]``: the target is the next character at *every* position
(the last one is LEAF's ``y``), so a causal transformer is trained on all 80 positions at once.
Next-character accuracy (paper, Sec. 4.1, after Reddi et al. 2021) can be computed over all
positions or over the last one only; that choice belongs to the evaluation code.

Characters are indexed in LEAF's 80-character alphabet :data:`LEAF_LETTERS`
(``models/utils/language_utils.py``); any other character maps to :data:`UNKNOWN_INDEX` = 80,
so :data:`VOCAB_SIZE` = 81. (LEAF itself maps unknown characters to ``find() = -1``, which
its one-hot code silently turns into the last letter ``'}'``.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from fedshard.data.registry import DataFormatError

__all__ = [
    "LEAF_LETTERS",
    "SHAKESPEARE_LAYOUT",
    "UNKNOWN_INDEX",
    "VOCAB_SIZE",
    "ShakespeareDataset",
    "decode",
    "encode",
    "locate",
    "read_leaf_split",
]

logger = logging.getLogger(__name__)

LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
UNKNOWN_INDEX = len(LEAF_LETTERS)
VOCAB_SIZE = len(LEAF_LETTERS) + 1
SHAKESPEARE_LAYOUT = "shakespeare/{train,test}/*.json or shakespeare/data/{train,test}/*.json"

# Code point -> vocabulary index for code points < 128; everything else is unknown.
_ASCII_TABLE = np.full(128, UNKNOWN_INDEX, dtype=np.uint8)
for _i, _c in enumerate(LEAF_LETTERS):
    _ASCII_TABLE[ord(_c)] = _i


def encode(text: str) -> np.ndarray:
    """Map ``text`` to vocabulary indices (``uint8``, unknown characters -> 80)."""
    # UTF-32 gives one fixed-width code point per character, so this is vectorized.
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    out = np.full(points.shape, UNKNOWN_INDEX, dtype=np.uint8)
    ascii_mask = points < 128
    out[ascii_mask] = _ASCII_TABLE[points[ascii_mask]]
    return out


def decode(indices: np.ndarray | torch.Tensor | list[int]) -> str:
    """Inverse of :func:`encode`; the unknown index becomes U+FFFD."""
    letters = [*LEAF_LETTERS, "\ufffd"]
    return "".join(letters[int(i)] for i in np.asarray(indices).ravel())


def locate(root: Path, split: str) -> Path | None:
    """Folder below ``root`` holding ``split``'s JSON files, or ``None``."""
    for folder in (root / "shakespeare" / split, root / "shakespeare" / "data" / split):
        if folder.is_dir() and any(folder.glob("*.json")):
            return folder
    return None


def _user_rows(user: str, data: Any, path: Path) -> np.ndarray:
    if not isinstance(data, dict) or "x" not in data or "y" not in data:
        raise ValueError(f"{path}: user_data[{user!r}] must be a dict with 'x' and 'y' lists.")
    xs, ys = data["x"], data["y"]
    for key, values in (("x", xs), ("y", ys)):
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            found = type(values).__name__ if not isinstance(values, list) else "a list with " + (
                next(type(v).__name__ for v in values if not isinstance(v, str)))
            raise DataFormatError(
                f"{path}: user_data[{user!r}][{key!r}] must be a list of strings, found {found}; "
                "the file is not LEAF's Shakespeare JSON. Re-run LEAF's preprocess.sh."
            )
    if len(xs) != len(ys):
        raise ValueError(f"{path}: user {user!r} has {len(xs)} x but {len(ys)} y entries.")
    if not xs:
        return np.zeros((0, 0), dtype=np.uint8)
    width = len(xs[0])
    if any(len(x) != width for x in xs) or any(len(y) != 1 for y in ys):
        raise ValueError(
            f"{path}: user {user!r} must have x strings of one length (first is {width}) and "
            "single-character y strings."
        )
    # (n, width + 1): the window followed by its next character.
    return encode("".join(x + y for x, y in zip(xs, ys, strict=True))).reshape(len(xs), width + 1)


def read_leaf_split(folder: Path) -> dict[str, np.ndarray]:
    """Read all LEAF JSON files in ``folder``.

    Parameters
    ----------
    folder : Path
        A ``train`` or ``test`` folder of the layout above.

    Returns
    -------
    dict of str to numpy.ndarray
        User -> ``(n_user, L + 1)`` ``uint8`` character indices (``L`` = window length, 80 in
        LEAF), users in sorted order; users without samples are dropped.

    Raises
    ------
    ValueError
        If a file is not readable JSON (truncated) or not in LEAF's format (``x`` / ``y`` not
        lists of strings), windows have different lengths, or a user appears in two files
        (e.g. two preprocessing runs in one folder).
    """
    users: dict[str, np.ndarray] = {}
    origin: dict[str, Path] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            with open(path, encoding="utf-8") as handle:
                content = json.load(handle)
        except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
            raise DataFormatError(
                f"{path} ({path.stat().st_size} bytes): not readable as JSON ({err}); expected "
                "a complete LEAF JSON file. It is damaged or was not written completely: "
                "re-run LEAF's preprocess.sh or copy it again."
            ) from err
        if not isinstance(content, dict) or not isinstance(content.get("user_data"), dict):
            raise ValueError(f"{path}: not a LEAF JSON file (no 'user_data' dict).")
        for user, data in content["user_data"].items():
            if user in users:
                raise ValueError(
                    f"{path}: user {user!r} also appears in {origin[user]}; each user must be "
                    "in one file. Keep one preprocessing run per folder."
                )
            rows = _user_rows(user, data, path)
            users[user] = rows
            origin[user] = path
    widths = {rows.shape[1] for rows in users.values() if len(rows)}
    if len(widths) > 1:
        raise ValueError(f"{folder}: windows of different lengths {sorted(w - 1 for w in widths)}.")
    empty = [u for u, rows in users.items() if len(rows) == 0]
    if empty:
        logger.info("Dropping %d Shakespeare users without samples in %s", len(empty), folder)
    return {u: users[u] for u in sorted(users) if len(users[u])}


class ShakespeareDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Map-style dataset of ``(x, y)``, both ``int64`` ``(L,)``, ``y`` = ``x`` shifted by one.

    Parameters
    ----------
    rows : numpy.ndarray
        ``(N, L + 1)`` character indices as returned by :func:`read_leaf_split`.
    """

    def __init__(self, rows: np.ndarray) -> None:
        if rows.ndim != 2 or rows.shape[1] < 2:
            raise ValueError(f"rows must be (N, L + 1) with L >= 1, got shape {rows.shape}.")
        self._rows = torch.tensor(rows, dtype=torch.uint8)  # copy; (N, L + 1)

    def __len__(self) -> int:
        return int(self._rows.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self._rows[index].long()
        return row[:-1], row[1:]

    def example_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All examples at once: ``(N, L)`` inputs and targets, ``int64``, ``[i]`` equal to
        ``self[i]`` (for :class:`fedshard.client.train.TensorBatches`)."""
        rows = self._rows.long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
