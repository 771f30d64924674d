"""The ``flwr run`` commands of the documentation, read from the Markdown pages and parsed as
``flwr run`` parses them.

:func:`page_commands` reads a page: every shell line of a code block that runs ``flwr run``
(``\\`` continuations joined; ``a && b`` and ``a; b`` lines split), every inline code span that
does, and every call of a shell function the page defines around ``flwr run`` (``run() { ...
flwr run ... "$@"; }`` then ```run --run-config "..."```), with the function's body filled in.
A span that is only the program's name (```flwr run```) is a mention, not a command.

:func:`parse` hands a command's arguments to Flower's own parsers: the ``flwr run`` command line
(the CLI's click command), ``--run-config`` (:func:`flwr.common.config.parse_config_args`) and
``--federation-config`` (the same, then
:func:`flwr.supercore.utils.simulation_config_from_json`, over Flower's default simulation,
as ``flwr run`` does). :func:`node_problems` checks that a fedshard run config fits the nodes
that will run it: ``num-partitions`` is 0 or the node count, and ``min-available-nodes`` is
not more than there are (a round would wait for nodes that never come).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import typer.main
from flwr.cli.app import app as flwr_cli
from flwr.common.config import parse_config_args
from flwr.proto.federation_config_pb2 import SimulationConfig
from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG
from flwr.supercore.utils import simulation_config_from_json

ROOT = Path(__file__).resolve().parents[1]

#: Code blocks whose lines are shell commands (no language, or a shell's).
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "zsh"}
_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w{}-]*)")
_SPAN = re.compile(r"(`+)(.+?)\1")
_FUNCTION = re.compile(r"^\s*([A-Za-z_][\w-]*)\s*\(\)\s*\{(.*)\}\s*;?\s*$")
_HEREDOC = re.compile(r"\bcat\s+>>?\s*(\S+)\s+<<-?\s*['\"]?(\w+)['\"]?")
_SUPERNODE_CONFIG = re.compile(r"flower-supernode\b.*?--node-config\s+(\"[^\"]*\"|'[^']*')")
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")

#: ``flwr run``'s own click command (Flower's CLI): parses the argument list, runs nothing.
FLWR_RUN: click.Command = typer.main.get_command(flwr_cli).commands["run"]  # type: ignore[attr-defined]


@dataclass(frozen=True)
class DocCommand:
    """One ``flwr run`` command of a page.

    Attributes
    ----------
    page : Path
        The page, relative to the repository root.
    line : int
        The line it starts on (1-based).
    text : str
        The shell command (continuations joined, a function call expanded).
    """

    page: Path
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass
class Page:
    """What a page holds: its commands, its heredocs (``cat > FILE <<EOF``: the file's text by
    the path as written) and the node configs of the SuperNodes it starts."""

    path: Path
    commands: list[DocCommand] = field(default_factory=list)
    heredocs: dict[str, str] = field(default_factory=dict)
    node_configs: list[dict[str, Any]] = field(default_factory=list)


def _logical_lines(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """A code block's lines with ``\\`` continuations joined: (first line number, text)."""
    start = 0
    parts: list[str] = []
    for number, line in lines:
        if not parts:
            start = number
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1].strip())
            continue
        parts.append(line.strip())
        yield start, " ".join(p for p in parts if p)
        parts = []
    if parts:
        yield start, " ".join(p for p in parts if p)


def _segments(text: str) -> list[str]:
    """A shell line split at ``&&``, ``||``, ``;``, ``|`` and ``&`` outside quotes."""
    lex = shlex.shlex(text, posix=False, punctuation_chars="&;|")
    lex.whitespace_split = True
    lex.commenters = ""
    segments: list[list[str]] = [[]]
    for token in lex:
        if token and set(token) <= set("&;|"):
            segments.append([])
        else:
            segments[-1].append(token)
    return [" ".join(s) for s in segments if s]


def _calls(text: str, functions: Mapping[str, str]) -> list[str]:
    """The ``flwr run`` commands in a shell line: its segments that run ``flwr run``, and
    calls of ``functions`` with their body filled in."""
    found = []
    for segment in _segments(text):
        words = segment.split()
        while words and (_ASSIGNMENT.match(words[0]) or words[0] in ("do", "then")):
            words = words[1:]
        if words[:2] == ["flwr", "run"]:
            found.append(segment.removeprefix("do ").removeprefix("then "))
        elif words and words[0] in functions:
            args = segment.split(None, 1)[1] if len(words) > 1 else ""
            for body in _calls(functions[words[0]], {}):
                found.append(body.replace('"$@"', args).replace("$@", args).strip())
    return found


def read_page(path: Path, root: Path = ROOT) -> Page:
    """Every ``flwr run`` command of the Markdown page ``path`` (and its heredocs and node
    configs)."""
    page = Page(path.relative_to(root) if path.is_absolute() else path)
    lines = (root / page.path).read_text().splitlines()
    functions: dict[str, str] = {}
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            for span in _SPAN.finditer(lines[i]):
                code = span.group(2).strip()
                if code == "flwr run":  # the program's name, not a command
                    continue
                for text in _calls(code, functions):
                    page.commands.append(DocCommand(page.path, i + 1, text))
            i += 1
            continue
        marker, lang = fence.group(1), fence.group(2).lower()
        body: list[tuple[int, str]] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(marker):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1  # the closing fence
        if lang in SHELL_FENCES:
            _read_block(page, body, functions)
    return page


def _read_block(page: Page, body: list[tuple[int, str]], functions: dict[str, str]) -> None:
    heredoc: tuple[str, str, list[str]] | None = None
    shell: list[tuple[int, str]] = []
    for number, line in body:  # heredoc bodies are file contents, not commands
        if heredoc is not None:
            target, end, content = heredoc
            if line.strip() == end:
                page.heredocs[target] = "\n".join(content) + "\n"
                heredoc = None
            else:
                content.append(line)
            continue
        shell.append((number, line))
        if found := _HEREDOC.search(line):
            heredoc = (found.group(1), found.group(2), [])
    for number, text in _logical_lines(shell):
        text = text.split(" #", 1)[0] if not text.lstrip().startswith("#") else ""
        if not text.strip():
            continue
        for node in _SUPERNODE_CONFIG.finditer(text):
            page.node_configs.append(parse_config_args([node.group(1)[1:-1]]))
        if (function := _FUNCTION.match(text)) and "flwr run" in function.group(2):
            definition = function.group(2).strip().rstrip(";").strip()
            functions[function.group(1)] = definition
            text = definition.replace('"$@"', "")  # the function called without arguments
        for command in _calls(text, functions):
            page.commands.append(DocCommand(page.path, number, command))


def doc_pages(root: Path = ROOT) -> list[Path]:
    """The pages whose commands are checked: README.md, docs/ (every page) and the examples'
    READMEs."""
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md")),
             *sorted((root / "examples").glob("*/README.md"))]
    return [p for p in pages if p.is_file()]


def app_folder(page: Path, app: str, root: Path = ROOT) -> Path:
    """The folder ``flwr run`` is given: the repository root for README and docs/ (their
    commands run from the checkout's root), ``after/`` for an example's README (whose
    commands run there, after ``cd after``)."""
    base = root / page.parent / "after" if page.parts[0] == "examples" else root
    return (base / app).resolve()


@dataclass
class Parsed:
    """A ``flwr run`` command as Flower reads it.

    Attributes
    ----------
    app : Path
        The Flower app's folder.
    connection : str or None
        The SuperLink connection named (a deployment), or ``None`` (the local simulation).
    run_config : list of str
        The ``--run-config`` arguments, as given.
    overrides : dict
        The run config's overrides, as :func:`parse_config_args` reads them.
    simulation : SimulationConfig
        The simulation (Flower's default with the ``--federation-config`` overrides).
    """

    app: Path
    connection: str | None
    run_config: list[str]
    overrides: dict[str, Any]
    simulation: SimulationConfig

    @property
    def nodes(self) -> int:
        """Simulated SuperNodes (Flower's default, 2, unless ``num-supernodes`` says)."""
        return int(self.simulation.num_supernodes)


class CommandError(ValueError):
    """A documented command that Flower's parsers (or a file it names) refuse."""


def flwr_run_args(text: str) -> list[str]:
    """The arguments after ``flwr run`` of a shell command (``VAR=value`` prefixes dropped)."""
    try:
        words = shlex.split(text)
    except ValueError as err:
        raise CommandError(f"not a shell command ({err}): {text}") from None
    while words and _ASSIGNMENT.match(words[0]):
        words = words[1:]
    if words[:2] != ["flwr", "run"]:
        raise CommandError(f"expected `flwr run ...`, found: {text}")
    return words[2:]


def parse(command: DocCommand, files: Mapping[str, Path] | None = None,
          root: Path = ROOT) -> Parsed:
    """``command`` read by Flower's parsers.

    Parameters
    ----------
    command : DocCommand
        The command.
    files : mapping, optional
        Files named in ``--run-config`` by the text the command gives them (``$D/run.toml``)
        that the docs create elsewhere: where to read them instead.

    Raises
    ------
    CommandError
        If Flower refuses the command line, the run config or the federation config, or a
        ``--run-config`` file does not exist.
    """
    files = files or {}
    args = flwr_run_args(command.text)
    try:
        params = FLWR_RUN.make_context("flwr run", list(args), resilient_parsing=False).params
    except click.ClickException as err:
        raise CommandError(f"Flower's `flwr run` refuses {args}: {err.format_message()}") \
            from None
    app = app_folder(command.page, params["app"], root)
    given = list(params["run_config_overrides"] or [])
    config_args = []
    for arg in given:
        if arg.endswith(".toml"):
            path = Path(files[arg]) if arg in files else app / arg
            if not path.is_file():
                raise CommandError(f"--run-config {arg}: no such file (from {app})")
            arg = str(path)
        config_args.append(arg)
    try:
        overrides = parse_config_args(config_args or None)
        simulation = SimulationConfig()
        simulation.CopyFrom(DEFAULT_SIMULATION_CONFIG)
        if fed := params["federation_config_overrides"]:
            given_fed = {k.replace("-", "_"): v for k, v in parse_config_args(list(fed)).items()}
            simulation.MergeFrom(simulation_config_from_json(given_fed))
    except (ValueError, click.ClickException) as err:
        message = err.format_message() if isinstance(err, click.ClickException) else str(err)
        raise CommandError(f"Flower refuses the configuration: {message}") from None
    return Parsed(app, params["superlink"], given, overrides, simulation)


def node_problems(num_partitions: int, min_available_nodes: int, nodes: int,
                  what: str = "the simulation") -> list[str]:
    """What keeps a run config from running on ``nodes`` nodes (empty when it fits)."""
    problems = []
    if num_partitions not in (0, nodes):
        problems.append(f"num-partitions={num_partitions}, but {what} has {nodes} node(s): "
                        "every node refuses to train (leave num-partitions out, or set it to "
                        "the node count)")
    if min_available_nodes > nodes:
        problems.append(f"min-available-nodes={min_available_nodes}, but {what} has {nodes} "
                        "node(s): the first round waits for nodes that never come, until "
                        "round-timeout")
    return problems
