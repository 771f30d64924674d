"""Per-round server checkpoints: everything needed to continue a run after a crash.

A checkpoint holds the global model after round ``k``, ``k`` itself, the strategy's capability
cache and metrics history, and the run config it belongs to. No random-number-generator state
is needed: every random stream of a run is derived from ``(seed, round, ...)``
(``numpy.random.default_rng([seed, round, tag, ...])``), so round ``k + 1`` draws the same
numbers whether or not the server was restarted in between.

The file is written to a temporary name and renamed over the previous one (atomic on POSIX),
so a crash at any moment leaves either the previous or the new checkpoint, never a torn one.
The checkpoint before it is kept as ``checkpoint.prev.pt``, so a resume can roll back one
round when the newest is damaged (``Checkpoint.load(directory, fallback=True)``). A model
holding NaN or ±inf is never checkpointed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedshard.app.rundir import CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME, open_private

__all__ = [
    "CHECKPOINT_NAME",
    "PREVIOUS_CHECKPOINT_NAME",
    "RESUME_MAY_CHANGE",
    "Checkpoint",
    "CheckpointError",
]

logger = logging.getLogger(__name__)

#: The format this version writes, and those it reads: 1 (fedshard 0.1.0 and before: no
#: version recorded), 2 (the writer's fedshard version in ``"fedshard-version"``).
_FORMAT = 2
_FORMATS_READ = (1, 2)
#: Run-config keys a resumed run may change: where it is stored (a moved results folder) and
#: where and how fast it runs, not what it computes.
RESUME_MAY_CHANGE = ("resume", "overwrite", "results-dir", "run-name", "round-timeout",
                     "download", "client-device", "server-device", "compile", "cuda-graph",
                     "merge-terms", "tensorboard", "reference-run")
_KEYS = ("format", "server-round", "arrays", "config", "capabilities", "history")
_WHAT_TO_DO = (
    "Delete it to fall back on {prev} (Checkpoint.load(directory, fallback=True) does that "
    "for you), or start the run again with overwrite=true."
)
_WHAT_TO_DO_NO_PREV = (
    "There is no previous checkpoint to fall back on: start the run again with overwrite=true "
    "(or under another run-name)."
)


class CheckpointError(ValueError):
    """A checkpoint file cannot be read or does not hold a fedshard checkpoint."""


def _non_finite(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """``"name (k of n)"`` for every floating array holding NaN or ±inf."""
    bad = []
    for name, value in arrays.items():
        arr = np.asarray(value)
        if np.issubdtype(arr.dtype, np.inexact):
            count = int(arr.size - np.count_nonzero(np.isfinite(arr)))
            if count:
                bad.append(f"{name!r} ({count} of {arr.size})")
    return bad


def _payload_problems(payload: Any) -> list[str]:
    """Everything wrong with a loaded payload (empty: a valid format-1 checkpoint)."""
    if not isinstance(payload, dict):
        return [f"expected a dict with keys {list(_KEYS)}, found a {type(payload).__name__}"]
    if payload.get("format") not in _FORMATS_READ:
        return [f"unknown checkpoint format {payload.get('format')!r} (written by fedshard "
                f"{payload.get('fedshard-version', 'of an unknown version')!s}); fedshard "
                f"{_version()} reads formats {', '.join(map(str, _FORMATS_READ))}: resume it "
                "with the fedshard version that wrote it"]
    problems = [f"missing key {k!r}" for k in _KEYS if k not in payload]
    if problems:
        return problems
    rnd = payload["server-round"]
    if isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < 0:
        problems.append(f"'server-round' must be an integer >= 0, found {rnd!r}")
    arrays = payload["arrays"]
    if not isinstance(arrays, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in arrays.items()
    ):
        problems.append("'arrays' must map names to tensors")
    else:
        bad = _non_finite({k: v.numpy() for k, v in arrays.items()})
        if bad:
            problems.append(f"non-finite values in {', '.join(bad)}")
    if not isinstance(payload["config"], dict):
        problems.append(f"'config' must be a dict, found {type(payload['config']).__name__}")
    caps = payload["capabilities"]
    if not isinstance(caps, dict) or not all(
        isinstance(k, int) and isinstance(v, (tuple, list)) and len(v) == 2
        and isinstance(v[0], (int, float)) and isinstance(v[1], str)
        for k, v in caps.items()
    ):
        problems.append("'capabilities' must map node ids to (keep ratio, reason) pairs")
    trust = payload.get("trust", {})
    if not isinstance(trust, dict) or not all(
        isinstance(k, int) and isinstance(v, list)
        and all(isinstance(c, float) and -1 <= c <= 1 for c in v) for k, v in trust.items()
    ):
        problems.append("'trust' must map node ids to lists of cosines in [-1, 1]")
    excluded = payload.get("excluded", {})
    if not isinstance(excluded, dict) or not all(
        isinstance(k, int) and isinstance(v, int) and v >= 1 for k, v in excluded.items()
    ):
        problems.append("'excluded' must map node ids to the round (≥ 1) each was left out in")
    history = payload["history"]
    if not isinstance(history, dict) or not all(
        isinstance(k, int) and isinstance(v, dict) for k, v in history.items()
    ):
        problems.append("'history' must map rounds to dicts of metrics")
    return problems


def _read(path: Path) -> Checkpoint:
    """The checkpoint in ``path``; :class:`CheckpointError` naming the file otherwise."""
    prev = path.with_name(PREVIOUS_CHECKPOINT_NAME)
    what_to_do = (_WHAT_TO_DO.format(prev=prev.name) if path != prev and prev.is_file()
                  else _WHAT_TO_DO_NO_PREV)
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(
            f"{path} is empty (0 bytes); expected a fedshard checkpoint (torch.save of a dict, "
            f"format {_FORMAT}), so the run cannot resume from it. {what_to_do}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # zip, pickle and EOF errors all mean: not a readable checkpoint
        raise CheckpointError(
            f"{path} ({size} bytes) is corrupt or truncated ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no details'}); expected a fedshard "
            f"checkpoint (torch.save of a dict, format {_FORMAT}), so the run cannot resume "
            f"from it. {what_to_do}"
        ) from err
    problems = _payload_problems(payload)
    if problems:
        raise CheckpointError(
            f"{path} is not a valid fedshard checkpoint: {'; '.join(problems)}. The run cannot "
            f"resume from it. {what_to_do}")
    return Checkpoint(
        format=int(payload["format"]),
        version=str(payload.get("fedshard-version", "0.1.0 or earlier")),
        server_round=int(payload["server-round"]),
        arrays={k: v.numpy() for k, v in payload["arrays"].items()},
        config=dict(payload["config"]),
        capabilities={int(k): (float(v[0]), str(v[1]))
                      for k, v in payload["capabilities"].items()},
        history={int(k): dict(v) for k, v in payload["history"].items()},
        path=path,
        trust={int(k): [float(c) for c in v] for k, v in payload.get("trust", {}).items()},
        excluded={int(k): int(v) for k, v in payload.get("excluded", {}).items()},
    )


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be fsync'ed
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass
class Checkpoint:
    """State of a run after ``server_round`` completed rounds."""

    server_round: int
    arrays: dict[str, np.ndarray]
    config: dict[str, Any]
    capabilities: dict[int, tuple[float, str]] = field(default_factory=dict)
    history: dict[int, dict[str, float]] = field(default_factory=dict)
    path: Path | None = None  # the file it was loaded from (None: not loaded)
    # node -> its last rounds' cosines (fedshard.server.trust_record.TrustRecord); optional
    trust: dict[int, list[float]] = field(default_factory=dict)
    # node -> the round exclude-distrusted left it out in (TrustStage.excluded); optional
    excluded: dict[int, int] = field(default_factory=dict)
    format: int = _FORMAT  # the checkpoint format it was read in (saved: always _FORMAT)
    version: str = field(default_factory=lambda: _version())  # the fedshard that wrote it

    def save(self, directory: Path) -> Path:
        """Write ``directory/checkpoint.pt`` atomically, keeping the one before it.

        The previous ``checkpoint.pt`` becomes ``checkpoint.prev.pt``; at every moment
        ``checkpoint.pt`` is a complete checkpoint (the old or the new one). Both are ``0600``.

        Parameters
        ----------
        directory : Path
            The run directory (it must exist).

        Returns
        -------
        Path
            The path of the new checkpoint.

        Raises
        ------
        ValueError
            If a floating array holds NaN or ±inf: a non-finite model is never checkpointed,
            so a resume starts from the last finite one. Nothing is written.
        OSError
            ``ENOSPC`` when the write fails for lack of space (an ``OSError``, or torch's
            "unexpected pos" from its zip writer); the partial file is removed and the
            message names the previous checkpoint, which is kept.
        fedshard.app.rundir.RunDirectoryError
            If ``checkpoint.pt.tmp`` is a symbolic link: nothing is written through it.
        """
        path = directory / CHECKPOINT_NAME
        bad = _non_finite(self.arrays)
        if bad:
            raise ValueError(
                f"Round {self.server_round}'s model has non-finite values in {', '.join(bad)}; "
                f"expected finite weights. A non-finite model is never checkpointed: nothing "
                f"was written, and {path} (if any) still holds the last finite round. Lower "
                "the learning rate or enable ClipLR, then resume."
            )
        tmp = directory / (CHECKPOINT_NAME + ".tmp")
        payload = {
            "format": _FORMAT,
            "fedshard-version": _version(),
            "server-round": self.server_round,
            "arrays": {k: torch.from_numpy(np.ascontiguousarray(v))
                       for k, v in self.arrays.items()},
            "config": self.config,
            "capabilities": self.capabilities,
            "history": self.history,
            **({"trust": self.trust} if self.trust else {}),
            **({"excluded": self.excluded} if self.excluded else {}),
        }
        try:
            fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # not via a link
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fd, 0o600)
                torch.save(payload, fh)
                fh.flush()
                os.fsync(fh.fileno())
        except (OSError, RuntimeError) as err:
            # torch's zip writer reports a short write as "unexpected pos A vs B"
            if isinstance(err, RuntimeError) and "unexpected pos" not in str(err):
                raise
            tmp.unlink(missing_ok=True)
            raise OSError(errno.ENOSPC, self._full_disk(directory, path, err)) from err
        if path.is_file():
            # A hard link keeps checkpoint.pt in place until the new one replaces it, so no
            # crash leaves the directory without a newest checkpoint.
            prev_tmp = directory / (PREVIOUS_CHECKPOINT_NAME + ".tmp")
            prev_tmp.unlink(missing_ok=True)
            try:
                os.link(path, prev_tmp)
            except OSError:  # no hard links on this file system
                shutil.copyfile(path, prev_tmp)
            os.replace(prev_tmp, directory / PREVIOUS_CHECKPOINT_NAME)
        os.replace(tmp, path)
        _fsync_directory(directory)
        return path

    def _full_disk(self, directory: Path, path: Path, err: BaseException) -> str:
        if path.is_file():
            try:
                kept = f"{path} (round {_read(path).server_round})"
            except CheckpointError:
                kept = str(path)
            what = f"the previous checkpoint {kept} is kept"
        else:
            what = "no earlier checkpoint exists, so the run can only start again"
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        return (f"The disk holding {directory} is full (or the write failed) while writing "
                f"round {self.server_round}'s checkpoint ({type(err).__name__}: {detail}); the "
                f"partial file was removed and {what}. Free some space, then resume "
                "(resume=true).")

    @classmethod
    def load(cls, directory: Path, *, fallback: bool = False) -> Checkpoint | None:
        """The newest checkpoint in ``directory``, or ``None`` when there is none.

        Parameters
        ----------
        directory : Path
            The run directory.
        fallback : bool
            When ``checkpoint.pt`` is missing or unreadable, load ``checkpoint.prev.pt`` (the
            round before) instead, with a logged warning.

        Raises
        ------
        CheckpointError
            If the checkpoint is empty, corrupt, truncated or holds the wrong keys or types
            (and, with ``fallback``, the previous one cannot be read either); the message
            names the file and what to do.
        """
        path = directory / CHECKPOINT_NAME
        prev = directory / PREVIOUS_CHECKPOINT_NAME
        can_fall_back = fallback and prev.is_file()
        if not path.is_file():
            if not can_fall_back:
                return None
            logger.warning("%s is missing; resuming from the previous checkpoint %s",
                           path, prev)
            return _read(prev)
        try:
            return _read(path)
        except CheckpointError as err:
            if not can_fall_back:
                raise
            logger.warning("%s; falling back to the previous checkpoint %s", err, prev)
            try:
                return _read(prev)
            except CheckpointError as prev_err:
                raise CheckpointError(
                    f"Neither checkpoint in {directory} can be read, so the run cannot resume: "
                    f"{err} -- and {prev_err}") from prev_err

    def check_arrays(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse to resume a model whose arrays (name -> shape, ``expected``) differ from the
        checkpoint's: a checkpoint written for another model (another ``model-width``) under
        the same run config.

        Raises
        ------
        CheckpointError
            Naming the file and every differing array: the shape expected and the one found,
            the arrays missing and those unexpected.
        """
        found = {k: tuple(np.shape(v)) for k, v in self.arrays.items()}
        problems = [f"{k}: expected {tuple(shape)}, found {found[k]}"
                    for k, shape in expected.items() if k in found and found[k] != tuple(shape)]
        missing = [k for k in expected if k not in found]
        unexpected = [k for k in found if k not in expected]
        if missing:
            problems.append(f"missing {missing[:5]}{' …' if len(missing) > 5 else ''}")
        if unexpected:
            problems.append(f"unexpected {unexpected[:5]}{' …' if len(unexpected) > 5 else ''}")
        if not problems:
            return
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise CheckpointError(
            f"{self.path or 'The checkpoint'} holds arrays that do not fit this run's model: "
            f"{'; '.join(problems[:8])}{more}. The run cannot resume from it: it was written "
            "for another model (another model or model-width) under this run config. Resume "
            "with the model it was written for, or start a new run (another run-name, or "
            "overwrite=true).")

    def check_config(self, config: Mapping[str, Any], *, ignore: tuple[str, ...] = (),
                     defaults: Mapping[str, Any] | None = None) -> None:
        """Refuse to resume a run under a different configuration.

        A checkpoint written by an earlier fedshard lacks the settings added since: with
        ``defaults`` (this version's default run config) each takes its default, logged, and
        a run config that sets one to another value is refused, naming both versions.
        Settings the writer had and this version does not are logged and dropped.

        Raises
        ------
        CheckpointError
            If a shared setting differs, or a setting the writer did not have is not at its
            default.
        """
        added = sorted(k for k in config if k not in self.config and k not in ignore)
        dropped = sorted(k for k in self.config if k not in config and k not in ignore)
        other = (f" (written by fedshard {self.version}, checkpoint format {self.format}; "
                 f"this is fedshard {_version()})" if self.version != _version() else "")
        diff = sorted(k for k in set(config) & set(self.config)
                      if k not in ignore and config[k] != self.config[k])
        if defaults is None:
            diff += added
            added = []
        changed = [k for k in added if config[k] != defaults.get(k)] if defaults else []
        if diff or changed:
            details = ", ".join(
                [f"{k}: {self.config[k]!r} -> {config[k]!r}" for k in diff if k in self.config]
                + [f"{k}: {config[k]!r} (the checkpoint's fedshard had no {k}; its default "
                   f"is {defaults.get(k) if defaults else None!r})" for k in changed]
                + [f"{k}: None -> {config[k]!r}" for k in diff if k not in self.config])
            raise CheckpointError(
                f"Cannot resume: the run config differs from the checkpoint's{other} "
                f"({details}). Resume with the checkpoint's config (settings it did not have "
                "at their defaults), or start a new run (another run-name, or "
                "overwrite=true).")
        if added:
            logger.info("The checkpoint%s has no %s: %s take%s this version's default%s "
                        "(%s), as this run config does.", other or f" {self.path or ''}",
                        ", ".join(added), "they" if len(added) > 1 else "it",
                        "" if len(added) > 1 else "s", "s" if len(added) > 1 else "",
                        ", ".join(f"{k}={config[k]!r}" for k in added))
        if dropped:
            logger.warning("The checkpoint%s holds settings this version does not have: %s; "
                           "they are ignored.", other, ", ".join(
                               f"{k}={self.config[k]!r}" for k in dropped))


def _version() -> str:
    """This fedshard's version (the package is imported by the time a checkpoint is)."""
    import fedshard

    return str(fedshard.__version__)
