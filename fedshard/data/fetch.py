"""Downloads of a data set's official files: checksummed, atomic, safe to start many at once.

Fashion-MNIST comes as four gzip files on Zalando's server (the URL torchvision's
``FashionMNIST`` uses). :func:`fetch_fashion_mnist` puts them in a folder once:

* each file is written to a temporary file in the same folder and renamed into place only
  after its size and SHA-256 match the official ones, so the folder never holds a partial or
  wrong file, and an interrupted download simply starts again next time;
* a file lock serializes the processes that download into one folder (the simulated
  ClientApps of one machine start together): the first downloads, the others wait and find
  the files; the lock file is never opened through a symbolic link;
* a mirror is trusted with nothing: at most the official size (and never more than
  :data:`MAX_DOWNLOAD_BYTES`) is read and written, and the whole download has a deadline
  (:data:`DOWNLOAD_DEADLINE_S`), so an endless or trickling body cannot fill the disk or
  stall a run;
* only the download's own leftovers are removed: its temporary files are named
  ``.<file>.fedshard-XXXXXXXX.part``, and a leftover is deleted only when it has such a name
  for one of the files being fetched and is a regular file of this user;
* progress goes to the log (module logger), about every 10 % of each file.

``$FEDSHARD_FASHION_MNIST_MIRROR`` replaces the base URL (a mirror, e.g. behind a proxy; the
standard ``http_proxy`` / ``https_proxy`` variables are honoured too).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import logging
import os
import re
import stat
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedshard.data.registry import DataNotFoundError

__all__ = [
    "DOWNLOAD_DEADLINE_S",
    "FASHION_MNIST_FILES",
    "FASHION_MNIST_MIRROR_ENV",
    "FASHION_MNIST_URL",
    "MAX_DOWNLOAD_BYTES",
    "OfficialFile",
    "fashion_mnist_mirror",
    "fetch",
    "fetch_fashion_mnist",
    "locked",
    "run_config_hint",
]

logger = logging.getLogger(__name__)

#: Zalando's server, the mirror of torchvision's ``FashionMNIST``.
FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
FASHION_MNIST_MIRROR_ENV = "FEDSHARD_FASHION_MNIST_MIRROR"

_TIMEOUT_S = 60.0  # per blocking socket operation: offline, a download fails instead of hanging
_CHUNK = 1 << 16
_LOCK_NAME = ".fedshard-download.lock"
#: Seconds a whole :func:`fetch` may take (every file, from the first request): a mirror that
#: trickles a byte now and then passes every per-read timeout, not this. The 31 MB of
#: Fashion-MNIST fit at 20 kB/s.
DOWNLOAD_DEADLINE_S = 1800.0
#: The most bytes read from a mirror for one file, whatever its official size says.
MAX_DOWNLOAD_BYTES = 1 << 30
_PART_TAG = "fedshard-"  # .<file>.fedshard-XXXXXXXX.part: the download's temporary files


@dataclass(frozen=True)
class OfficialFile:
    """One file as its publisher serves it.

    Attributes
    ----------
    name : str
        File name, appended to the base URL and kept in the target folder.
    size : int
        Size in bytes.
    sha256 : str
        Hex SHA-256 of the file.
    """

    name: str
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if not 0 < self.size <= MAX_DOWNLOAD_BYTES:
            raise ValueError(f"OfficialFile {self.name!r}: size {self.size!r}, expected in "
                             f"[1, {MAX_DOWNLOAD_BYTES}] bytes (the most a download reads); "
                             "no file is fetched")


#: The four official files (names, sizes, SHA-256). The same bytes have the MD5s of
#: torchvision's ``FashionMNIST.resources`` and the SHA-256s of TensorFlow Datasets'
#: ``url_checksums/fashion_mnist.txt``. Debian's ``dataset-fashion-mnist`` holds the same
#: compressed data under a normalized gzip header (no file name, the packaging date); with the
#: original header restored its files are these bytes (the tests check that).
FASHION_MNIST_FILES: tuple[OfficialFile, ...] = (
    OfficialFile("train-images-idx3-ubyte.gz", 26421880,
                 "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84"),
    OfficialFile("train-labels-idx1-ubyte.gz", 29515,
                 "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845"),
    OfficialFile("t10k-images-idx3-ubyte.gz", 4422102,
                 "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073"),
    OfficialFile("t10k-labels-idx1-ubyte.gz", 5148,
                 "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5"),
)


def run_config_hint(**settings: str | bool) -> str:
    """The ``flwr run`` command that sets ``settings``, pasteable into a POSIX shell as written.

    Keys are given in snake case (``data_dir``) and written in kebab case; values as TOML
    (``true``, ``"/a/path"``; a string holding ``"`` or ``\\`` as a literal ``'...'``, since
    Flower's ``--run-config`` parser takes a quoted value up to the next quote), the whole
    override single-quoted for the shell.

    Raises
    ------
    ValueError
        If a string holds ``'`` and also ``"`` or ``\\`` (``--run-config`` cannot carry it).

    Examples
    --------
    >>> print(run_config_hint(data_dir="/data/fmnist"))
    flwr run . --run-config 'data-dir="/data/fmnist"'
    """
    parts = []
    for key, value in settings.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif '"' not in value and "\\" not in value:
            text = f'"{value}"'
        elif "'" not in value:
            text = f"'{value}'"
        else:
            raise ValueError(f"{value!r}: a --run-config value cannot hold ' together with "
                             "\" or \\ (Flower's parser has no escapes); use another path")
        parts.append(f"{key.replace('_', '-')}={text}")
    override = " ".join(parts).replace("'", "'\"'\"'")  # ' closes, "'" is one, ' reopens
    return f"flwr run . --run-config '{override}'"


def fashion_mnist_mirror() -> str:
    """Base URL of the Fashion-MNIST files: ``$FEDSHARD_FASHION_MNIST_MIRROR``, else
    :data:`FASHION_MNIST_URL`."""
    return os.environ.get(FASHION_MNIST_MIRROR_ENV) or FASHION_MNIST_URL


def _open_lock(path: Path) -> int:
    """The lock file's descriptor, opened (created ``0600``) without following a symbolic
    link; anything but a regular file is refused, naming it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0),
                     0o600)
    except OSError as err:
        if err.errno != errno.ELOOP and not path.is_symlink():
            raise
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise DataNotFoundError(
            f"The download lock {path} is a symbolic link (to {target}); expected a plain file "
            "that fedshard creates, so nothing was opened or created through it and nothing "
            "was downloaded. Remove the link (and find out who put it there), then run "
            "again.") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataNotFoundError(
            f"The download lock {path} is not a regular file (a FIFO, socket or device); "
            "expected a plain file that fedshard creates, so nothing was downloaded. Remove "
            "it, then run again.")
    return fd


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (created if needed) for downloading into it.

    A process that finds the lock taken logs that it waits, then blocks until the other is
    done. Where ``fcntl`` is missing (Windows) there is no lock; the atomic renames of
    :func:`fetch` still keep every file whole.

    Raises
    ------
    DataNotFoundError
        If the lock file (``.fedshard-download.lock``) is a symbolic link or not a regular
        file: it is refused, naming it, and nothing is created through it.
    """
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with os.fdopen(_open_lock(folder / _LOCK_NAME), "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Another process is downloading into %s; waiting for it", folder)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _own_leftovers(folder: Path, files: Sequence[OfficialFile]) -> list[Path]:
    """The temporary files an interrupted download of ``files`` left in ``folder``: named
    ``.<file>.fedshard-XXXXXXXX.part`` (as :func:`_download` names them), regular files (not
    links) owned by this user. Nothing else there is the download's."""
    names = "|".join(re.escape(f.name) for f in files)
    pattern = re.compile(rf"\.(?:{names})\.{re.escape(_PART_TAG)}[a-z0-9_]{{8}}\.part")
    out = []
    for path in folder.iterdir():
        if not pattern.fullmatch(path.name):
            continue
        try:
            info = path.lstat()
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
            out.append(path)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _is_whole(path: Path, official: OfficialFile) -> bool:
    return (path.is_file() and path.stat().st_size == official.size
            and _sha256(path) == official.sha256)


def _one_line(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())


def _late(what: str, url: str, allowed_s: float, got: int,
          official: OfficialFile) -> DataNotFoundError:
    return DataNotFoundError(
        f"Downloading {what} did not finish within its deadline of {allowed_s:g} s (for the "
        f"whole download; {got:,} of {official.size:,} bytes of {url} had arrived); it was "
        "stopped and nothing of the unfinished file was kept. Run again on a faster "
        "connection, or copy the files by hand.")


def _download(url: str, official: OfficialFile, target: Path, what: str,
              deadline: float, allowed_s: float) -> None:
    """Download ``url`` to ``target`` through a temporary file, or raise; never leaves a file
    that does not match ``official``, never reads more than its size (and one byte to tell a
    longer body), and gives up at ``deadline`` (``time.monotonic()``; ``allowed_s`` after the
    download began)."""
    if time.monotonic() > deadline:
        raise _late(what, url, allowed_s, 0, official)
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below, renamed or removed
        dir=target.parent, prefix=f".{official.name}.{_PART_TAG}", suffix=".part",
        delete=False)
    part = Path(handle.name)
    limit = min(official.size, MAX_DOWNLOAD_BYTES)
    try:
        digest = hashlib.sha256()
        got = 0
        shown = 0  # tenths of the file already reported
        started = time.monotonic()
        request = urllib.request.Request(url, headers={"User-Agent": "fedshard"})
        timeout = max(0.001, min(_TIMEOUT_S, deadline - started))
        try:
            with handle, urllib.request.urlopen(request, timeout=timeout) as response:
                # read1: what has arrived, so that the deadline is checked between reads
                while chunk := response.read1(min(_CHUNK, limit + 1 - got)):
                    got += len(chunk)
                    if got > limit:
                        raise DataNotFoundError(
                            f"{url} sends more than the {limit:,} bytes of {official.name}; "
                            f"the download was stopped after {got:,} bytes and nothing of it "
                            f"was kept. The server or a proxy serves another file: check "
                            f"${FASHION_MNIST_MIRROR_ENV} if you set it.")
                    handle.write(chunk)
                    digest.update(chunk)
                    if time.monotonic() > deadline:
                        raise _late(what, url, allowed_s, got, official)
                    tenths = min(10, got * 10 // official.size)
                    if tenths > shown and official.size >= 1 << 20:  # small files: no progress
                        shown = tenths
                        logger.info("%s: %s %.1f of %.1f MB (%d%%)", what, official.name,
                                    got / 1e6, official.size / 1e6, 100 * got // official.size)
        except http.client.IncompleteRead:
            pass  # the connection closed early: the size check below says so
        if got != official.size:
            raise DataNotFoundError(
                f"Downloading {what} from {url} stopped after {got:,} of {official.size:,} "
                f"bytes (the transfer was cut short); the partial file was deleted. Run again "
                "to restart the download.")
        found = digest.hexdigest()
        if found != official.sha256:
            raise DataNotFoundError(
                f"{url}: SHA-256 {found}, expected {official.sha256} (the official "
                f"{official.name}); the file was refused and deleted. The server or a proxy "
                f"serves another file: check ${FASHION_MNIST_MIRROR_ENV} if you set it.")
        os.replace(part, target)
        logger.info("%s: %s verified (%.1f MB in %.1f s)", what, official.name,
                    official.size / 1e6, time.monotonic() - started)
    finally:
        part.unlink(missing_ok=True)


def fetch(files: Sequence[OfficialFile], base_url: str, folder: Path, *, what: str,
          offline_hint: str, deadline_s: float | None = None) -> Path:
    """Make ``folder`` hold every file of ``files``, downloading the missing ones.

    Parameters
    ----------
    files : sequence of OfficialFile
        What to fetch; a file already in ``folder`` with the right size and SHA-256 is kept.
    base_url : str
        URL that each file's name is appended to (a ``/`` is added when missing).
    folder : Path
        Target folder, created if needed.
    what : str
        The data set's name, for the log and the messages.
    offline_hint : str
        What to do without a network, the end of the message of a failed connection.
    deadline_s : float or None
        Seconds the whole download may take (``None``: :data:`DOWNLOAD_DEADLINE_S`).

    Returns
    -------
    Path
        ``folder``.

    Raises
    ------
    DataNotFoundError
        If a file cannot be downloaded (the one-line message names the URL, the error and
        ``offline_hint``), is cut short, is longer than its official size, has another
        checksum, or the download passes its deadline; nothing of it stays in ``folder``.
        Files completed before stay (they are verified). Also if the lock file is a link or
        not a regular file (:func:`locked`).
    """
    base = base_url if base_url.endswith("/") else base_url + "/"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataNotFoundError(
            f"Cannot create {folder} to download {what} into ({_one_line(err)}); nothing was "
            f"downloaded. {offline_hint}") from err
    allowed_s = DOWNLOAD_DEADLINE_S if deadline_s is None else float(deadline_s)
    deadline = time.monotonic() + allowed_s
    with locked(folder):
        if os.name == "posix":  # locked: nobody else writes here, a killed process's leftovers go
            for stale in _own_leftovers(folder, files):
                stale.unlink(missing_ok=True)
        missing = [f for f in files if not _is_whole(folder / f.name, f)]
        if not missing:
            return folder
        total = sum(f.size for f in missing)
        logger.info("Downloading %s (%.1f MB, once) from %s into %s", what, total / 1e6, base,
                    folder)
        for official in missing:
            url = base + official.name
            try:
                _download(url, official, folder / official.name, what, deadline, allowed_s)
            except DataNotFoundError:
                raise
            except (OSError, http.client.HTTPException, ValueError) as err:
                # URLError and socket errors are OSErrors; a bad mirror URL is a ValueError
                raise DataNotFoundError(
                    f"Cannot download {what} from {url} ({_one_line(err)}); nothing of it was "
                    f"kept in {folder}. {offline_hint}") from err
    return folder


def fetch_fashion_mnist(folder: Path, *, base_url: str | None = None) -> Path:
    """Put the four official Fashion-MNIST files (:data:`FASHION_MNIST_FILES`) in ``folder``.

    Parameters
    ----------
    folder : Path
        Target folder (a flat layout, as Debian's package).
    base_url : str or None
        Where the files are; ``None``: :func:`fashion_mnist_mirror`.

    Returns
    -------
    Path
        ``folder``.

    Raises
    ------
    DataNotFoundError
        As :func:`fetch`; offline, its message ends with the ``flwr run`` command that points
        the run at a copy of the files.
    """
    hint = (
        "Without internet: on Debian (found without settings), run apt-get install "
        "dataset-fashion-mnist; or copy the four .gz files into a folder and run: "
        + run_config_hint(data_dir="/path/to/folder")
    )
    return fetch(FASHION_MNIST_FILES, base_url or fashion_mnist_mirror(), folder,
                 what="Fashion-MNIST", offline_hint=hint)
