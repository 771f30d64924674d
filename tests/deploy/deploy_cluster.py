"""A real Flower deployment on 127.0.0.1 for tests: one SuperLink, SuperNodes, the ``flwr`` CLI.

:class:`LocalDeployment` is a context manager. Every process it starts gets its own
``FLWR_HOME`` under the deployment's root folder, its own free ports, its own log file, and the
environment variable ``FEDSHARD_DEPLOY_ROOT=<root>``. On exit (also after a failure or an
interrupt) it stops each process it started, with all descendants, by PID, and then every
process whose environment still carries that marker or one of its ``FLWR_HOME`` folders
(SuperExec, ``flwr-serverapp``, ``flwr-clientapp`` re-parented to init, say).

The TLS material and SuperNode keys are generated here with ``cryptography`` (installed with
Flower): a CA, a server certificate for ``127.0.0.1``/``localhost`` signed by it, and ECDSA
P-384 key pairs in OpenSSH format, the format ``flower-supernode
--auth-supernode-private-key`` and ``flwr supernode register`` read.

The commands of ``docs/deployment.md`` can be run as written (:func:`docs_blocks`,
:meth:`LocalDeployment.shell`, :meth:`LocalDeployment.start_shell`): with ``$HOME`` a folder of
the deployment and the docs' fixed ports (9092, 9094-9097) replaced by free ones.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedshard_lab.experiments.launch import free_port, kill_tree, processes_with_env, toml_value

MARKER = "FEDSHARD_DEPLOY_ROOT"
BIN = Path(sys.executable).parent
DOCS = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
#: The ports docs/deployment.md names: the SuperLink's, then the SuperNodes'.
DOCS_PORTS = (9092, 9094, 9095, 9096, 9097)


# --------------------------------------------------------------------------- the docs' commands
def docs_blocks(heading: str, lang: str = "bash") -> list[str]:
    """The ``lang`` code blocks of docs/deployment.md's section ``heading`` (its whole
    heading line, e.g. ``"## 4. SuperNodes (one per device)"``), in order."""
    text = DOCS.read_text()
    start = text.find(f"\n{heading}\n")
    if start < 0:
        raise KeyError(f"docs/deployment.md has no section {heading!r}")
    end = text.find("\n## ", start + 1)
    section = text[start:] if end < 0 else text[start:end]
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def docs_commands(block: str) -> list[str]:
    """The command lines of a code block, continuation lines (``\\``) joined."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line for line in joined.splitlines() if line.strip()]


# --------------------------------------------------------------------------- key material
@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA certificate (given to SuperNodes and the CLI), the SuperLink's
    certificate and private key."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_tls_files(folder: Path, *, hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                   days: int = 2) -> TlsFiles:
    """A throw-away CA and a server certificate for ``hosts`` signed by it (EC P-256)."""
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("fedshard test CA")).issuer_name(_name("fedshard test CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0])).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.server_key.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    files.server_key.chmod(0o600)
    return files


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """An ECDSA P-384 key pair in OpenSSH format (what ``ssh-keygen -t ecdsa -b 384`` writes):
    ``<name>`` (private, for the SuperNode) and ``<name>.pub`` (public, to register)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    private.chmod(0o600)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH) + b"\n")
    return private, public


# --------------------------------------------------------------------------- processes
@dataclass
class Started:
    """One long-running process of the deployment."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    home: Path
    port: int

    def wait(self, timeout_s: float) -> int | None:
        """Exit code, or ``None`` if still running after ``timeout_s``."""
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def count(self, text: str) -> int:
        """How often ``text`` occurs in the log."""
        return self.output().count(text)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, chars: int = 3000) -> str:
        return f"--- {self.name} ({self.log}) ---\n{self.output()[-chars:]}"


@dataclass
class LocalDeployment:
    """SuperLink + SuperNodes + CLI on 127.0.0.1 under ``root``; stops everything on exit.

    Parameters
    ----------
    root : Path
        Folder for every ``FLWR_HOME``, log, key and database of this deployment.
    tls : TlsFiles or None
        Serve the SuperLink over TLS with these files (``None``: ``--insecure``).
    supernode_auth : bool
        Start the SuperLink with ``--enable-supernode-auth`` (needs ``tls``).
    """

    root: Path
    tls: TlsFiles | None = None
    supernode_auth: bool = False
    link: Started | None = None
    nodes: list[Started] = field(default_factory=list)
    _all: list[Started] = field(default_factory=list)
    _docs_ports: dict[int, int] = field(default_factory=dict)

    # -- environment -------------------------------------------------------------------------
    @property
    def home(self) -> Path:
        """``$HOME`` of the docs' commands (:meth:`shell`, :meth:`start_shell`)."""
        return self.root / "home"

    def env(self, home: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
        env.update({
            "FLWR_HOME": str(home),
            MARKER: str(self.root),
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONUNBUFFERED": "1",
            # SuperLink and SuperNode find flower-superexec / flwr-clientapp on PATH.
            "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
        })
        return env

    @property
    def address(self) -> str:
        assert self.link is not None, "start_superlink() first"
        return f"127.0.0.1:{self.link.port}"

    def _start(self, name: str, cmd: list[str], port: int,
               env: dict[str, str] | None = None) -> Started:
        home = self.root / name
        home.mkdir(parents=True, exist_ok=True)
        log = self.root / f"{name}.log"
        with log.open("wb") as fh:
            popen = subprocess.Popen(cmd, env=env or self.env(home), stdout=fh,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=home, start_new_session=True)
        started = Started(name, popen, log, home, port)
        self._all.append(started)
        (self.root / f"{name}.cmd").write_text(" ".join(cmd) + "\n")
        return started

    # -- the docs' commands ------------------------------------------------------------------
    def docs_port(self, port: int) -> int:
        """The free port that stands for the docs' ``port``."""
        if port not in self._docs_ports:
            self._docs_ports[port] = free_port()
        return self._docs_ports[port]

    def localize(self, script: str) -> str:
        """``script`` with the docs' fixed ports replaced by this deployment's free ones."""
        for port in DOCS_PORTS:
            script = re.sub(rf"(?<![\d.]){port}(?!\d)", str(self.docs_port(port)), script)
        return script

    def _shell_env(self, flwr_home: Path) -> dict[str, str]:
        env = self.env(flwr_home)
        env["HOME"] = str(self.home)
        self.home.mkdir(parents=True, exist_ok=True)
        return env

    def shell(self, script: str, *, timeout_s: float = 120.0,
              cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run a docs' code block with bash (``set -e``; ``$HOME`` = :attr:`home`, the CLI's
        ``FLWR_HOME`` = :attr:`cli_home`); stopped with its descendants on timeout."""
        env = self._shell_env(self.cli_home)
        proc = subprocess.Popen(["bash", "-e", "-c", self.localize(script)], env=env,
                                cwd=cwd or self.home, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            out, _ = proc.communicate()
            raise TimeoutError(f"docs block exceeded {timeout_s:.0f} s:\n{script}\n"
                               f"{out[-4000:]}\n{self.tails()}") from None
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
        with (self.root / "cli.log").open("a") as fh:
            fh.write(f"$ {script}\n{out}\n[exit {proc.returncode}]\n")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)

    def start_shell(self, name: str, script: str, *, superlink: bool = False) -> Started:
        """A long-running docs' command (a SuperLink's or a SuperNode's), run by bash in the
        background with its own ``FLWR_HOME`` (the docs' SuperLink command sets its own); the
        last command replaces the shell (``exec``), so the process is the SuperLink's or
        SuperNode's own. With ``superlink`` it becomes :attr:`link` (and returns once its port
        accepts)."""
        *before, last = docs_commands(self.localize(script))
        # exec after the command's leading VAR=value assignments (they stay its environment)
        assigns = re.match(r"((?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*)(.*)", last, flags=re.S)
        assert assigns is not None
        script = "\n".join([*before, f"{assigns.group(1)}exec {assigns.group(2)}"])
        port = self.docs_port(9092) if superlink else 0
        started = self._start(name, ["bash", "-c", script], port,
                              env=self._shell_env(self.root / name))
        if superlink:
            self.link = started
            self._wait_listening(started, 60.0)
        else:
            self.nodes.append(started)
        return started

    def _wait_listening(self, link: Started, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if link.popen.poll() is not None:
                raise RuntimeError(f"SuperLink exited with {link.popen.returncode}\n"
                                   + link.tail())
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", link.port)) == 0:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"SuperLink not listening on {link.port} after {timeout_s} s\n"
                           + link.tail())

    # -- SuperLink ---------------------------------------------------------------------------
    def start_superlink(self, *, ready_timeout_s: float = 60.0) -> Started:
        """``flower-superlink`` on a free port of 127.0.0.1; returns once the port accepts."""
        port = free_port()
        cmd = [str(BIN / "flower-superlink"), "--host", "127.0.0.1", "--port", str(port),
               "--database", str(self.root / "superlink" / "state.db"),
               "--disable-runtime-dependency-installation"]
        if self.tls is None:
            cmd.append("--insecure")
        else:
            cmd += ["--ssl-ca-certfile", str(self.tls.ca_cert),
                    "--ssl-certfile", str(self.tls.server_cert),
                    "--ssl-keyfile", str(self.tls.server_key)]
        if self.supernode_auth:
            cmd.append("--enable-supernode-auth")
        self.link = self._start("superlink", cmd, port)
        self._wait_listening(self.link, ready_timeout_s)
        self._write_cli_config()
        return self.link

    # -- SuperNodes --------------------------------------------------------------------------
    def start_supernode(
        self,
        name: str,
        node_config: Mapping[str, Any],
        *,
        insecure: bool | None = None,
        root_certificates: Path | None = None,
        private_key: Path | None = None,
        extra: Sequence[str] = (),
    ) -> Started:
        """``flower-supernode`` connected to this SuperLink, with ``--node-config``.

        ``insecure=None`` follows the SuperLink: TLS when it has TLS, trusting
        ``root_certificates`` (default: the deployment's CA). ``private_key`` is passed as
        ``--auth-supernode-private-key``; ``extra`` are further command-line arguments.
        """
        port = free_port()
        conf = " ".join(f"{k}={toml_value(v)}" for k, v in node_config.items())
        cmd = [str(BIN / "flower-supernode"),
               "--superlink", self.address, "--host", "127.0.0.1", "--port", str(port),
               "--node-config", conf]
        if insecure is None:
            insecure = self.tls is None
        if insecure:
            cmd.append("--insecure")
        elif root_certificates is not None:
            cmd += ["--root-certificates", str(root_certificates)]
        elif self.tls is not None:
            cmd += ["--root-certificates", str(self.tls.ca_cert)]
        if private_key is not None:
            cmd += ["--auth-supernode-private-key", str(private_key)]
        cmd += list(extra)
        node = self._start(name, cmd, port)
        self.nodes.append(node)
        return node

    # -- CLI ---------------------------------------------------------------------------------
    @property
    def cli_home(self) -> Path:
        return self.root / "cli"

    connection = "test-deployment"

    def _write_cli_config(self) -> None:
        self.cli_home.mkdir(parents=True, exist_ok=True)
        lines = ["[superlink]", f'default = "{self.connection}"', "",
                 f"[superlink.{self.connection}]", f'address = "{self.address}"']
        if self.tls is None:
            lines.append("insecure = true")
        else:
            lines.append(f"root-certificates = {toml_value(str(self.tls.ca_cert))}")
        (self.cli_home / "config.toml").write_text("\n".join(lines) + "\n")

    def flwr(self, *args: str, timeout_s: float = 60.0,
             cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """One ``flwr`` CLI command with this deployment's CLI ``FLWR_HOME`` (not raising).

        The CLI is started in its own session and, on timeout, stopped with its descendants.
        """
        cmd = [str(BIN / "flwr"), *args]
        proc = subprocess.Popen(cmd, env=self.env(self.cli_home), cwd=cwd or self.cli_home,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            out, _ = proc.communicate()
            raise TimeoutError(f"`flwr {' '.join(args)}` exceeded {timeout_s:.0f} s\n"
                               f"{out[-4000:]}\n{self.tails()}") from None
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
        with (self.root / "cli.log").open("a") as fh:
            fh.write(f"$ flwr {' '.join(args)}\n{out}\n[exit {proc.returncode}]\n")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, None)

    def supernodes(self) -> list[dict[str, Any]]:
        """``flwr supernode list --format json``: one dict per registered/known node."""
        res = self.flwr("supernode", "list", self.connection, "--format", "json")
        start = res.stdout.find("{")
        if res.returncode != 0 or start < 0:
            raise RuntimeError(f"`flwr supernode list` failed ({res.returncode}):\n{res.stdout}")
        data = json.loads(res.stdout[start:])
        nodes = data.get("nodes", [])
        assert isinstance(nodes, list), data
        return nodes

    def wait_online(self, count: int, *, timeout_s: float = 90.0) -> list[dict[str, Any]]:
        """Wait until ``count`` SuperNodes are ``online``; returns them."""
        deadline = time.monotonic() + timeout_s
        while True:
            online = [n for n in self.supernodes() if n.get("status") == "online"]
            if len(online) >= count:
                return online
            for node in self.nodes:
                if node.popen.poll() is not None:
                    raise RuntimeError(f"{node.name} exited with {node.popen.returncode}\n"
                                       + node.tail())
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(online)}/{count} SuperNodes online after "
                                   f"{timeout_s:.0f} s\n{self.tails()}")
            time.sleep(1.0)

    def run_app(self, app_dir: Path, run_config: Mapping[str, Any], *,
                timeout_s: float = 240.0) -> subprocess.CompletedProcess[str]:
        """``flwr run <app_dir> <connection> --run-config <file.toml> --stream``."""
        overrides = self.root / "run-config.toml"
        overrides.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in run_config.items()))
        return self.flwr("run", str(app_dir), self.connection, "--run-config", str(overrides),
                         "--stream", timeout_s=timeout_s)

    # -- teardown ----------------------------------------------------------------------------
    def tails(self, chars: int = 2500) -> str:
        return "\n".join(p.tail(chars) for p in self._all)

    def leftovers(self) -> list[int]:
        """PIDs that still carry this deployment's marker or one of its ``FLWR_HOME``s."""
        pids = set(processes_with_env(MARKER, str(self.root)))
        for home in [self.cli_home, *(p.home for p in self._all),
                     *(self.home / "fedshard-deploy").glob("*")]:
            pids.update(processes_with_env("FLWR_HOME", str(home)))
        return sorted(pids)

    def stop(self, *, grace_s: float = 10.0) -> None:
        """Stop every process this deployment started, then anything left that carries its
        environment.

        First SIGTERM to each started process (SuperNodes first): SuperLink and SuperNode then
        stop and reap their own SuperExec. What still runs after ``grace_s`` is killed with its
        descendants by PID; last, every process whose environment still names this deployment
        (children re-parented to init) is killed.
        """
        for started in reversed(self._all):
            if started.popen.poll() is None:
                started.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for started in reversed(self._all):
            if started.wait(max(0.0, deadline - time.monotonic())) is None:
                kill_tree(started.popen.pid, grace_s=2.0)
                started.wait(5.0)
        for _ in range(3):
            left = self.leftovers()
            if not left:
                return
            for pid in left:
                kill_tree(pid, grace_s=2.0)
            time.sleep(0.2)

    def __enter__(self) -> LocalDeployment:
        self.root.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
