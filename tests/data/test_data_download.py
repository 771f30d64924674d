"""Fashion-MNIST's download, against a real HTTP server on this machine (the tests have no
internet): checksums, a corrupted and a cut-short file, the cache, concurrent downloads, the
offline message, and the default run config of README's first command.

The server serves the official files. Debian's ``dataset-fashion-mnist`` holds their
compressed data under a normalized gzip header; restoring the original header (file name and
date) gives the official bytes, checked against torchvision's MD5s, an independent reference.
Without the Debian package, small files in the real idx format stand in (with their own
checksums).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shlex
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from fakedata import write_idx

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; tomli comes with flwr
    import tomli as tomllib

from fedshard.data import (
    DataNotFoundError,
    clear_cache,
    fetch,
    load_partition,
    load_test_set,
    registry,
)
from fedshard.data.fetch import FASHION_MNIST_FILES, OfficialFile, fetch_fashion_mnist

DEBIAN = Path("/usr/share/datasets/fashion-mnist")
ROOT = Path(__file__).resolve().parents[2]

# The gzip modification times of the official files (Debian's package replaced them).
_OFFICIAL_MTIME = {"train-images-idx3-ubyte.gz": 1504176606,
                   "train-labels-idx1-ubyte.gz": 1504176606,
                   "t10k-images-idx3-ubyte.gz": 1504176627,
                   "t10k-labels-idx1-ubyte.gz": 1504176627}
_COMMAND = re.compile(r"flwr run \. --run-config '(?:[^']|'\"'\"')*'")


def _official_from_debian(path: Path) -> bytes:
    """Debian's file with the original gzip header: FNAME set, the original date (RFC 1952)."""
    data = path.read_bytes()
    assert data[:4] == b"\x1f\x8b\x08\x00", "Debian's header has no optional fields"
    header = (b"\x1f\x8b\x08\x08" + struct.pack("<I", _OFFICIAL_MTIME[path.name]) + data[8:10]
              + path.name.removesuffix(".gz").encode() + b"\x00")
    return header + data[10:]


def _served_files(scratch: Path) -> dict[str, bytes]:
    """The four files the mirror serves: the official ones, or small stand-ins."""
    if DEBIAN.is_dir():
        return {f.name: _official_from_debian(DEBIAN / f.name) for f in FASHION_MNIST_FILES}
    rng = np.random.default_rng(3)
    for prefix, n in (("train", 60), ("t10k", 20)):
        write_idx(scratch / f"{prefix}-images-idx3-ubyte.gz",
                  rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(scratch / f"{prefix}-labels-idx1-ubyte.gz", (np.arange(n) % 10).astype(np.uint8))
    return {f.name: (scratch / f.name).read_bytes() for f in FASHION_MNIST_FILES}


class Mirror:
    """A real HTTP server on 127.0.0.1 holding files by name. It records every request and can
    serve a file with one byte changed (``corrupt``), close after half of it (``cut``), go on
    past its end (``endless``: the file, then 64 kB blocks up to 100 times its size, no
    ``Content-Length``) or send it a byte every 50 ms (``trickle``)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.requests: list[str] = []
        self.corrupt: set[str] = set()
        self.cut: set[str] = set()
        self.endless: set[str] = set()
        self.trickle: set[str] = set()
        self.sent: dict[str, int] = {}  # bytes written to the socket per endless/trickled file
        self.delay = 0.0
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                name = self.path.lstrip("/")
                mirror.requests.append(name)
                time.sleep(mirror.delay)
                data = mirror.files.get(name)
                if data is None:
                    self.send_error(404)
                    return
                if name in mirror.corrupt:
                    data = data[:-1] + bytes([data[-1] ^ 0xFF])  # same size, other bytes
                if name in mirror.endless or name in mirror.trickle:
                    self._slow_or_endless(name, data)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if name in mirror.cut:
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True
                    return
                self.wfile.write(data)

            def _slow_or_endless(self, name: str, data: bytes) -> None:
                self.send_response(200)
                if name in mirror.trickle:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.close_connection = True
                mirror.sent[name] = 0
                try:
                    if name in mirror.trickle:
                        for i in range(len(data)):
                            self.wfile.write(data[i:i + 1])
                            self.wfile.flush()
                            mirror.sent[name] += 1
                            time.sleep(0.05)
                        return
                    self.wfile.write(data)
                    mirror.sent[name] += len(data)
                    while mirror.sent[name] < 100 * len(data):
                        self.wfile.write(b"\0" * (1 << 16))
                        mirror.sent[name] += 1 << 16
                except OSError:  # the client hung up
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return _served_files(tmp_path_factory.mktemp("served"))


@pytest.fixture
def mirror(served: dict[str, bytes], tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Mirror]:
    """The mirror, the downloader pointed at it, an empty cache and no Debian copy."""
    server = Mirror(dict(served))
    monkeypatch.setenv(fetch.FASHION_MNIST_MIRROR_ENV, server.url)
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "no-debian")
    if not DEBIAN.is_dir():  # stand-ins: their own sizes and checksums
        monkeypatch.setattr(fetch, "FASHION_MNIST_FILES", tuple(
            OfficialFile(f.name, len(served[f.name]), hashlib.sha256(served[f.name]).hexdigest())
            for f in FASHION_MNIST_FILES))
    clear_cache()
    yield server
    clear_cache()
    server.close()


def _cached(tmp_path: Path) -> list[str]:
    folder = tmp_path / "cache" / "fashion-mnist"
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) + sorted(
        p.name for p in folder.glob("*.part"))


def _idx(data: bytes) -> np.ndarray:
    raw = gzip.decompress(data)
    ndim = raw[3]
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


# --- the official files ---------------------------------------------------------------------


@pytest.mark.skipif(not DEBIAN.is_dir(), reason="needs Debian's dataset-fashion-mnist")
def test_the_official_table_is_torchvisions_files(served: dict[str, bytes]) -> None:
    from torchvision.datasets import FashionMNIST

    assert FashionMNIST.mirrors[0] == fetch.FASHION_MNIST_URL
    md5 = dict(FashionMNIST.resources)
    assert [f.name for f in FASHION_MNIST_FILES] == list(md5)
    for f in FASHION_MNIST_FILES:
        assert hashlib.md5(served[f.name]).hexdigest() == md5[f.name]
        assert len(served[f.name]) == f.size
        assert hashlib.sha256(served[f.name]).hexdigest() == f.sha256
        # and the contents are Debian's
        assert gzip.decompress(served[f.name]) == gzip.decompress(
            (DEBIAN / f.name).read_bytes())


# --- downloads ------------------------------------------------------------------------------


def test_a_download_is_verified_cached_and_read(mirror: Mirror, served: dict[str, bytes],
                                                tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(DataNotFoundError):
        load_test_set("fashion-mnist")  # download=False: no request
    assert mirror.requests == []
    caplog.set_level("INFO", logger="fedshard")
    # named as the download names its temporary files: what a killed download left
    leftover = (tmp_path / "cache" / "fashion-mnist"
                / ".train-images-idx3-ubyte.gz.fedshard-k1lled_0.part")
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"what a killed download left")
    test = load_test_set("fashion-mnist", download=True)
    assert sorted(mirror.requests) == sorted(f.name for f in FASHION_MNIST_FILES)
    assert _cached(tmp_path) == sorted(f.name for f in FASHION_MNIST_FILES)
    for f in FASHION_MNIST_FILES:
        assert (tmp_path / "cache" / "fashion-mnist" / f.name).read_bytes() == served[f.name]
    labels = _idx(served["t10k-labels-idx1-ubyte.gz"])
    assert len(test) == len(labels)
    assert [int(test[i][1]) for i in range(5)] == labels[:5].tolist()
    log = caplog.text
    assert "Downloading Fashion-MNIST" in log and mirror.url in log
    assert log.count(" verified (") == 4
    if DEBIAN.is_dir():  # the 26 MB file reports its progress
        assert "train-images-idx3-ubyte.gz 26.4 of 26.4 MB (100%)" in log

    # the second run, and another process's first, read the cache: no request at all
    clear_cache()
    assert len(load_partition("fashion-mnist", 0, 2, download=True)) > 0
    fetch_fashion_mnist(tmp_path / "cache" / "fashion-mnist")
    assert len(mirror.requests) == 4


def test_a_corrupted_file_is_refused_and_not_kept(mirror: Mirror, tmp_path: Path) -> None:
    mirror.corrupt.add("t10k-labels-idx1-ubyte.gz")
    with pytest.raises(DataNotFoundError, match=(
        r"t10k-labels-idx1-ubyte.gz: SHA-256 [0-9a-f]{64}, expected [0-9a-f]{64} \(the official "
        r"t10k-labels-idx1-ubyte.gz\); the file was refused and deleted")) as info:
        load_test_set("fashion-mnist", download=True)
    assert "\n" not in str(info.value)
    # the verified files stay, the wrong one is gone, no temporary file is left
    assert "t10k-labels-idx1-ubyte.gz" not in _cached(tmp_path)
    assert len(_cached(tmp_path)) == 3
    # once the server is right, the next run fetches only what is missing
    mirror.corrupt.clear()
    assert len(load_test_set("fashion-mnist", download=True)) > 0
    assert mirror.requests.count("t10k-labels-idx1-ubyte.gz") == 2
    assert mirror.requests.count("train-images-idx3-ubyte.gz") == 1


def test_a_cut_short_transfer_is_refused_and_not_kept(mirror: Mirror, tmp_path: Path) -> None:
    mirror.cut.add("train-images-idx3-ubyte.gz")
    size = len(mirror.files["train-images-idx3-ubyte.gz"])
    with pytest.raises(DataNotFoundError, match=(
        rf"train-images-idx3-ubyte.gz stopped after {size // 2:,} of {size:,} bytes \(the "
        r"transfer was cut short\); the partial file was deleted. Run again")):
        load_partition("fashion-mnist", 0, 2, download=True)
    assert _cached(tmp_path) == []
    mirror.cut.clear()
    assert len(load_partition("fashion-mnist", 0, 2, download=True)) > 0
    assert _cached(tmp_path) == sorted(f.name for f in FASHION_MNIST_FILES)


_SMALL = "t10k-labels-idx1-ubyte.gz"


def _small(mirror: Mirror) -> OfficialFile:
    """The small labels file as the table of one :func:`fetch.fetch`."""
    data = mirror.files[_SMALL]
    return OfficialFile(_SMALL, len(data), hashlib.sha256(data).hexdigest())


def test_the_cleanup_removes_only_the_downloads_own_partial_files(mirror: Mirror,
                                                                 tmp_path: Path) -> None:
    folder = tmp_path / "cache" / "fashion-mnist"
    folder.mkdir(parents=True)
    outside = tmp_path / "outside.part"
    outside.write_bytes(b"the user's")
    users = {".notes.part": b"a user's draft", ".t10k-labels-idx1-ubyte.gz.mine.part": b"mine",
             ".t10k-labels-idx1-ubyte.gz.fedshard-toolong99.part": b"not our name",
             ".other.gz.fedshard-abcdefgh.part": b"not a file being fetched"}
    for name, data in users.items():
        (folder / name).write_bytes(data)
    linked = folder / ".t10k-labels-idx1-ubyte.gz.fedshard-linked00.part"
    linked.symlink_to(outside)  # named as ours, but a link: not the download's file
    ours = folder / ".t10k-labels-idx1-ubyte.gz.fedshard-k1lled_0.part"
    ours.write_bytes(b"what a killed download left")

    fetch.fetch([_small(mirror)], mirror.url, folder, what="X", offline_hint="")

    assert not ours.exists()
    for name, data in users.items():
        assert (folder / name).read_bytes() == data
    assert linked.is_symlink() and outside.read_bytes() == b"the user's"
    assert (folder / _SMALL).read_bytes() == mirror.files[_SMALL]


def test_an_endless_body_is_read_only_up_to_the_files_size(
    mirror: Mirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[int] = []
    real = fetch.tempfile.NamedTemporaryFile

    def counting(*args: object, **kwargs: object) -> object:
        handle = real(*args, **kwargs)  # type: ignore[call-overload]
        write = handle.write
        handle.write = lambda b: written.append(len(b)) or write(b)
        return handle

    monkeypatch.setattr(fetch.tempfile, "NamedTemporaryFile", counting)
    mirror.endless.add(_SMALL)
    size = len(mirror.files[_SMALL])
    folder = tmp_path / "cache" / "fashion-mnist"
    with pytest.raises(DataNotFoundError, match=(
            rf"^{re.escape(mirror.url + _SMALL)} sends more than the {size:,} bytes of "
            rf"{_SMALL}; the download was stopped after {size + 1:,} bytes and nothing of it "
            "was kept")):
        fetch.fetch([_small(mirror)], mirror.url, folder, what="X", offline_hint="")
    # never more than the file on disk (nothing at all when the first read already brought
    # more than the file's size: how much the mirror had sent by then depends on timing)
    assert sum(written) <= size
    assert [p.name for p in folder.iterdir() if p.name != ".fedshard-download.lock"] == []


def test_a_trickling_mirror_is_stopped_at_the_whole_downloads_deadline(
    mirror: Mirror, tmp_path: Path
) -> None:
    mirror.trickle.add(_SMALL)  # a byte every 50 ms: no read ever times out
    folder = tmp_path / "cache" / "fashion-mnist"
    size = len(mirror.files[_SMALL])
    t0 = time.monotonic()
    with pytest.raises(DataNotFoundError, match=(
            r"^Downloading X did not finish within its deadline of 1 s \(for the whole "
            rf"download; \d+ of {size:,} bytes of {re.escape(mirror.url + _SMALL)} had "
            r"arrived\); it was stopped and nothing of the unfinished file was kept")):
        fetch.fetch([_small(mirror)], mirror.url, folder, what="X", offline_hint="",
                    deadline_s=1.0)
    assert time.monotonic() - t0 < 5
    assert mirror.sent[_SMALL] < size
    assert [p.name for p in folder.iterdir() if p.name != ".fedshard-download.lock"] == []


def test_a_link_planted_as_the_download_lock_is_refused(mirror: Mirror, tmp_path: Path) -> None:
    folder = tmp_path / "cache" / "fashion-mnist"
    folder.mkdir(parents=True)
    target = tmp_path / "elsewhere" / "created-through-the-link"
    target.parent.mkdir()
    (folder / ".fedshard-download.lock").symlink_to(target)
    with pytest.raises(DataNotFoundError, match=(
            r"download lock .*\.fedshard-download\.lock is a symbolic link \(to "
            rf"{re.escape(str(target))}\); expected a plain file .* nothing was opened or "
            "created through it")):
        fetch.fetch([_small(mirror)], mirror.url, folder, what="X", offline_hint="")
    assert not target.exists()
    assert mirror.requests == []


def test_a_fifo_as_the_download_lock_is_refused(mirror: Mirror, tmp_path: Path) -> None:
    folder = tmp_path / "cache" / "fashion-mnist"
    folder.mkdir(parents=True)
    os.mkfifo(folder / ".fedshard-download.lock")
    with pytest.raises(DataNotFoundError, match=(
            r"download lock .*\.fedshard-download\.lock is not a regular file \(a FIFO")):
        fetch.fetch([_small(mirror)], mirror.url, folder, what="X", offline_hint="")
    assert mirror.requests == []


def test_concurrent_first_downloads_fetch_each_file_once(mirror: Mirror, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="fedshard")
    mirror.delay = 0.2  # the first holds the lock while the others arrive
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def first_run() -> None:
        start.wait()
        try:
            fetch_fashion_mnist(tmp_path / "cache" / "fashion-mnist")
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=first_run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(mirror.requests) == sorted(f.name for f in FASHION_MNIST_FILES)
    assert _cached(tmp_path) == sorted(f.name for f in FASHION_MNIST_FILES)
    assert "Another process is downloading into" in caplog.text


_CHILD = """
import json, logging, sys
from pathlib import Path
from fedshard.data import fetch
logging.basicConfig(level=logging.INFO)
fetch.FASHION_MNIST_FILES = tuple(fetch.OfficialFile(*f) for f in json.loads(sys.argv[2]))
fetch.fetch_fashion_mnist(Path(sys.argv[1]))
"""


def test_processes_starting_together_download_once(mirror: Mirror, tmp_path: Path) -> None:
    """As simulated ClientApps (separate processes) on one machine: one downloads, the others
    wait for it and find the files; none fails."""
    mirror.delay = 1.0  # the first holds the lock while the others finish importing
    table = json.dumps([[f.name, f.size, f.sha256] for f in fetch.FASHION_MNIST_FILES])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    children = [subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path / "cache" / "fashion-mnist"), table],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)]
    outputs = [child.communicate(timeout=300)[0] for child in children]
    assert [child.returncode for child in children] == [0, 0], outputs
    assert sorted(mirror.requests) == sorted(f.name for f in FASHION_MNIST_FILES)
    assert _cached(tmp_path) == sorted(f.name for f in FASHION_MNIST_FILES)
    assert any("Another process is downloading into" in out for out in outputs), outputs


def test_offline_the_error_is_one_line_ending_in_a_pasteable_command(
    mirror: Mirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flwr.common.config import parse_config_args

    from fedshard.app.config import RunConfig

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv(fetch.FASHION_MNIST_MIRROR_ENV, f"http://127.0.0.1:{port}")
    with pytest.raises(DataNotFoundError, match=(
        rf"^Cannot download Fashion-MNIST from http://127.0.0.1:{port}/train-images-idx3-ubyte"
        r"\.gz \(URLError: .*\); nothing of it was kept in .*Without internet: .*apt-get install "
        r"dataset-fashion-mnist; or copy the four .gz files into a folder and run: flwr run \. "
        r"--run-config 'data-dir=\"/path/to/folder\"'$")) as info:
        load_test_set("fashion-mnist", download=True)
    message = str(info.value)
    assert "\n" not in message
    assert _cached(tmp_path) == []
    # pasted into a shell, the command gives Flower a run config that fedshard accepts
    argv = shlex.split(message[message.index("flwr run"):])
    assert argv[:4] == ["flwr", "run", ".", "--run-config"]
    assert parse_config_args([argv[4]]) == {"data-dir": "/path/to/folder"}
    assert RunConfig.from_mapping(parse_config_args([argv[4]])).data_dir == "/path/to/folder"


# --- README's first command -----------------------------------------------------------------


def test_readmes_first_command_downloads_when_no_local_copy_exists(
    mirror: Mirror, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedshard.app import task
    from fedshard.app.config import RunConfig

    # the run config `flwr run .` gives the apps: pyproject's, with no override
    with open(ROOT / "pyproject.toml", "rb") as handle:
        defaults = tomllib.load(handle)["tool"]["flwr"]["app"]["config"]
    cfg = RunConfig.from_mapping(defaults)
    assert (cfg.dataset, cfg.data_dir, cfg.download) == ("fashion-mnist", "", True)
    monkeypatch.setattr(task, "_DATASETS", OrderedDict())  # nothing prepared earlier
    # what the ClientApp calls for node 0 of README's 10 simulated nodes
    dataset = task.client_dataset(cfg, *task.node_partition(
        cfg, {"partition-id": 0, "num-partitions": 10}))
    assert len(dataset) > 0
    assert sorted(mirror.requests) == sorted(f.name for f in FASHION_MNIST_FILES)


# --- every hint is pasteable ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["fashion-mnist", "cifar10", "cifar100", "tinyimagenet",
                                  "shakespeare"])
@pytest.mark.parametrize("explicit", [False, True])
def test_every_missing_data_hint_is_a_command_flower_and_fedshard_accept(
    name: str, explicit: bool, mirror: Mirror, tmp_path: Path
) -> None:
    from flwr.common.config import parse_config_args

    from fedshard.app.config import RunConfig

    with pytest.raises(DataNotFoundError) as info:
        load_test_set(name, data_dir=tmp_path / "empty" if explicit else None)
    message = str(info.value)
    assert "\n" not in message
    assert not re.search(r"=True|=False|=DIR\b", message)
    commands = _COMMAND.findall(message)
    assert commands
    for command in commands:
        argv = shlex.split(command)
        overrides = parse_config_args([argv[4]])
        assert overrides in ({"download": True}, {"data-dir": "/path/to/folder"})
        RunConfig.from_mapping({**overrides, "dataset": name,
                                "model": "chargpt" if name == "shakespeare" else "mlp",
                                "model-width": 48 if name == "shakespeare" else 896})
    if name == "fashion-mnist":
        assert "apt-get install dataset-fashion-mnist;" in message


@pytest.mark.parametrize("path", ["/path/to/folder", "/with space/x", "/it's/here",
                                  "C:\\data\\fmnist", '/a "quoted" name'])
def test_run_config_hint_survives_the_shell_and_flowers_parser(path: str) -> None:
    from flwr.common.config import parse_config_args

    argv = shlex.split(fetch.run_config_hint(data_dir=path, download=False))
    assert argv[:4] == ["flwr", "run", ".", "--run-config"]
    assert parse_config_args([argv[4]]) == {"data-dir": path, "download": False}


def test_run_config_hint_refuses_what_flower_cannot_carry() -> None:
    with pytest.raises(ValueError, match=r"cannot hold ' together with \" or \\ "):
        fetch.run_config_hint(data_dir="/it's \"x\"")
