"""Every ``flwr run`` command of the docs (README.md, docs/, examples/*/README.md) runs.

Each command is read from its page (:mod:`doc_commands`), parsed by Flower's own parsers (the
``flwr run`` command line, ``--run-config``, ``--federation-config``) and validated by
fedshard's run config; its node counts must agree with the simulation's (or the deployment's)
nodes. Then every command that can run here is run for one round by the in-process engine,
with the command's run config and node count and only the data made small (fake
Fashion-MNIST in the real format, ``num-server-rounds = 1``). A command that needs a GPU, data
CI lacks or a deployment is only parsed: :data:`PARSE_ONLY` lists each with the reason, and its
page must say so next to it. A command that neither runs nor parses fails with its page and
line.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fakedata
import numpy as np
import pytest
from doc_commands import (
    ROOT,
    CommandError,
    DocCommand,
    Page,
    Parsed,
    doc_pages,
    node_problems,
    parse,
    read_page,
)
from flwr.common.config import fuse_dicts

from fedshard.app.config import ConfigError, RunConfig
from fedshard_lab.engine import app_run_config, run_engine

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: Lines around a command in which its page must say why it does not run on a CPU alone.
NEAR = 8


@dataclass(frozen=True)
class ParseOnly:
    """Documented commands (``text`` a part of the command) that are parsed and checked but
    not run here, and why.

    Attributes
    ----------
    near : str or None
        A pattern the page must show within :data:`NEAR` lines of the command: the reader is
        told there what the command needs (``None``: it runs on a CPU, elsewhere).
    nodes : int or None
        A deployment's SuperNodes, as the page starts them.
    files : mapping
        Files the page makes with shell commands, named in ``--run-config`` as the page writes
        them: ``"heredoc"`` (the page's own ``cat > FILE <<EOF``) or a file of the checkout
        standing in for it.
    """

    page: str
    text: str
    reason: str
    near: str | None
    nodes: int | None = None
    files: Mapping[str, str] = field(default_factory=dict)


_PRESET_DATA = "a paper preset: needs its data set under data-dir and a GPU's time; " \
               "tests/app/test_presets.py runs each preset for one round on fake files"
_EXAMPLE = "an example's own Flower app (not fedshard's); tests/examples/ runs it"
_DEPLOYED = "a deployment (SuperLink and SuperNodes)"
_SEED_COPY = {"/tmp/cifar10-seed1.toml": "presets/cifar10-resnet18.toml",
              "/tmp/cifar10-seed$s.toml": "presets/cifar10-resnet18.toml"}

PARSE_ONLY = [
    ParseOnly("README.md", "presets/", _PRESET_DATA, r"GPU|CIFAR|data-dir"),
    ParseOnly("docs/configuration.md", "presets/cifar10-resnet18.toml", _PRESET_DATA,
              r"CIFAR-10|data-dir"),
    ParseOnly("docs/configuration.md", "/tmp/cifar10-seed1.toml",
              _PRESET_DATA + " (the page's copy of the CIFAR-10 preset)", r"data-dir",
              files=_SEED_COPY),
    ParseOnly("docs/reproducing.md", "presets/", _PRESET_DATA, r"needs its data"),
    ParseOnly("docs/reproducing.md", "/tmp/cifar10-seed$s.toml",
              _PRESET_DATA + " (the page's copies of the CIFAR-10 preset)", r"data-dir",
              files=_SEED_COPY),
    ParseOnly("docs/simulation.md", "client-resources-num-gpus=0.25",
              "needs a GPU (cuda-graph, a quarter GPU per ClientApp)", r"GPU"),
    ParseOnly("docs/deployment.md", "--run-config $D/run.toml",
              _DEPLOYED + "; step 5's is run as written by tests/deploy/test_deploy_docs.py "
              "(e2e)", r"(?i)supernode|superlink", nodes=4, files={"$D/run.toml": "heredoc"}),
    ParseOnly("examples/quickstart-pytorch/README.md", "<your-connection>",
              _DEPLOYED + " of an example's app", r"SuperNode|SuperLink"),
    ParseOnly("examples/lightning-pytorch/README.md", "<your-connection>",
              _DEPLOYED + " of an example's app", r"SuperNode|SuperLink"),
    ParseOnly("examples/advanced-pytorch/README.md", "local-deployment",
              _DEPLOYED + " of an example's app", r"SuperNode|SuperLink", nodes=2),
    *(ParseOnly(f"examples/{name}/README.md", "flwr run", _EXAMPLE, None)
      for name in ("quickstart-pytorch", "lightning-pytorch", "advanced-pytorch")),
]

#: Documented lines that show ``flwr run``'s syntax rather than a command.
NOT_COMMANDS = {("docs/cli.md", "flwr run . [--run-config"): "the synopsis of its options"}

#: Commands the docs show failing on purpose, and what the failure says.
EXPECTED_ERRORS = {
    ("docs/get-started.md", "method='topn'"):
        r"method='topn': expected one of .*\n.*keep-ratios='0.1:0.5': shares sum to 0.5",
}


def _entry(command: DocCommand, table: Mapping[tuple[str, str], Any]) -> Any:
    for (page, text), value in table.items():
        if str(command.page) == page and text in command.text:
            return value
    return None


def _parse_only(command: DocCommand) -> ParseOnly | None:
    """The first entry of :data:`PARSE_ONLY` that names ``command``."""
    return next((e for e in PARSE_ONLY if str(command.page) == e.page and e.text in command.text),
                None)


PAGES = {p.relative_to(ROOT): read_page(p) for p in doc_pages()}
COMMANDS = [c for page in PAGES.values() for c in page.commands]
CHECKED = [c for c in COMMANDS if _entry(c, NOT_COMMANDS) is None]


def _files(command: DocCommand, entry: ParseOnly | None, page: Page,
           scratch: Path) -> dict[str, Path]:
    """Where to read the files the command names that its page makes with shell commands."""
    files: dict[str, Path] = {}
    for given, source in (entry.files if entry else {}).items():
        if source == "heredoc":
            text = page.heredocs[given]
            # the page's shell variables ($D, $HOME) as a scratch folder
            text = re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: str(scratch / m.group(1)), text)
            files[given] = scratch / "heredoc.toml"
            files[given].write_text(text)
        else:
            files[given] = ROOT / source
    return files


@dataclass
class Checked:
    """A command parsed and checked: its parse, its fedshard run config (``None`` for an
    example's app) and what is wrong with it."""

    parsed: Parsed | None
    cfg: RunConfig | None
    problems: list[str]


def check(command: DocCommand, page: Page, scratch: Path) -> Checked:
    """Parse ``command`` with Flower's parsers, validate its run config and its node counts."""
    entry = _parse_only(command)
    try:
        parsed = parse(command, _files(command, entry, page, scratch))
    except CommandError as err:
        return Checked(None, None, [str(err)])
    if parsed.app != ROOT:  # an example's own app: Flower's merge refuses unknown keys
        defaults = tomllib.loads((parsed.app / "pyproject.toml").read_text())
        try:
            fuse_dicts(defaults["tool"]["flwr"]["app"]["config"], parsed.overrides)
        except ValueError as err:
            return Checked(parsed, None, [f"Flower refuses the run config: {err}"])
        return Checked(parsed, None, [])
    try:
        cfg = app_run_config(parsed.app, parsed.overrides)
    except ConfigError as err:
        return Checked(parsed, None, [str(err)])
    if parsed.connection is None:
        nodes, what = parsed.nodes, f"the simulation (num-supernodes={parsed.nodes})"
    elif entry is not None and entry.nodes is not None:
        nodes, what = entry.nodes, f"the deployment ({entry.nodes} SuperNodes on the page)"
    else:
        return Checked(parsed, cfg, [f"a deployment ({parsed.connection}) without a node count "
                                     "in PARSE_ONLY"])
    if parsed.connection is None:
        return Checked(parsed, cfg, node_problems(cfg.num_partitions, cfg.min_available_nodes,
                                                  nodes, what))
    # deployed nodes split a shared data set as their node configs say (num-partitions is not
    # their number); the run config's num-partitions is the default a node config overrides
    problems = node_problems(0, cfg.min_available_nodes, nodes, what)
    for node in page.node_configs:
        if cfg.num_partitions and node.get("num-partitions", cfg.num_partitions) \
                != cfg.num_partitions:
            problems.append(f"a SuperNode's node config {node} on the page disagrees with "
                            f"the run config's num-partitions={cfg.num_partitions}")
    return Checked(parsed, cfg, problems)


def needs(checked: Checked) -> list[str]:
    """What a parsed command needs that CI lacks (empty: it can run here)."""
    parsed, cfg = checked.parsed, checked.cfg
    assert parsed is not None
    found = []
    if parsed.connection is not None:
        found.append(f"a deployment (SuperLink connection {parsed.connection!r})")
    if parsed.app != ROOT:
        found.append("an example's own app")
    if parsed.simulation.client_resources_num_gpus > 0:
        found.append("a GPU (client-resources-num-gpus)")
    if cfg is not None:
        settings = cfg.as_dict()
        if settings["cuda-graph"] or "cuda" in f"{cfg.client_device}{cfg.server_device}":
            found.append("a GPU (cuda-graph or a cuda device)")
        if cfg.dataset != "fashion-mnist":
            found.append(f"the {cfg.dataset} data set")
    return found


def _id(command: DocCommand) -> str:
    return command.where


@pytest.mark.parametrize("command", CHECKED, ids=_id)
def test_every_command_parses_and_its_node_counts_agree(command: DocCommand,
                                                        tmp_path: Path) -> None:
    checked = check(command, PAGES[command.page], tmp_path)
    expected = _entry(command, EXPECTED_ERRORS)
    if expected is not None:
        assert checked.problems and re.search(expected, "\n".join(checked.problems)), (
            f"{command.where}: the page says `{command.text}` fails with {expected!r}; "
            f"found {checked.problems or 'no problem'}")
        return
    assert not checked.problems, f"{command.where}: `{command.text}`:\n" + \
        "\n".join(checked.problems)
    entry = _parse_only(command)
    missing = needs(checked)
    if missing and entry is None:
        pytest.fail(f"{command.where}: `{command.text}` needs {', '.join(missing)}, which CI "
                    "lacks: list it in PARSE_ONLY with the reason, and say it on the page")
    if entry is not None and entry.near is not None:
        lines = (ROOT / command.page).read_text().splitlines()
        window = "\n".join(lines[max(0, command.line - 1 - NEAR):command.line + NEAR])
        assert re.search(entry.near, window), (
            f"{command.where}: `{command.text}` does not run here ({entry.reason}), and the "
            f"page does not say so within {NEAR} lines of it (looked for {entry.near!r})")


def test_every_table_entry_names_a_documented_command() -> None:
    stale = [f"{e.page}: {e.text!r}" for e in PARSE_ONLY
             if not any(str(c.page) == e.page and e.text in c.text for c in COMMANDS)]
    stale += [f"{page}: {text!r}" for page, text in (*NOT_COMMANDS, *EXPECTED_ERRORS)
              if not any(str(c.page) == page and text in c.text for c in COMMANDS)]
    assert not stale, f"no documented command matches: {stale}"


def test_the_docs_commands_are_all_found() -> None:
    pages = {str(c.page) for c in COMMANDS}
    assert {"README.md", "docs/get-started.md", "docs/simulation.md", "docs/reproducing.md",
            "docs/deployment.md"} <= pages
    # one command per paper preset, and get-started's table rows through its shell function
    assert sum("presets/" in c.text for c in COMMANDS if str(c.page) == "docs/reproducing.md") \
        == len(list((ROOT / "presets").glob("*.toml")))
    assert sum("--run-config" in c.text for c in COMMANDS
               if str(c.page) == "docs/get-started.md") >= 7


# ---------------------------------------------------------------------------- the runs
@dataclass(frozen=True)
class Run:
    """A documented run config on its node count, and the commands that give it."""

    overrides: tuple[tuple[str, Any], ...]
    nodes: int
    where: tuple[str, ...]


def _runs() -> list[Run]:
    runs: dict[tuple[Any, ...], list[str]] = {}
    scratch = Path("/nonexistent")  # runnable commands name no file made by their page
    for command in CHECKED:
        if _parse_only(command) or _entry(command, EXPECTED_ERRORS) is not None:
            continue
        checked = check(command, PAGES[command.page], scratch)
        if checked.problems or needs(checked):
            continue  # the parse test says what is wrong
        assert checked.parsed is not None
        key = (tuple(sorted(checked.parsed.overrides.items())), checked.parsed.nodes)
        runs.setdefault(key, []).append(command.where)
    return [Run(key[0], key[1], tuple(where)) for key, where in runs.items()]


RUNS = _runs()


@pytest.fixture(scope="module")
def fake_fashion_mnist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fashion-mnist")
    fakedata.write_fashion_mnist(folder, 200, 40, np.random.default_rng(52))
    return folder


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r.where[0]}+{len(r.where) - 1}")
def test_every_runnable_command_trains_a_round(run: Run, fake_fashion_mnist: Path,
                                               tmp_path: Path) -> None:
    small = {"num-server-rounds": 1, "data-dir": str(fake_fashion_mnist),
             "test-max-examples": 40, "results-dir": str(tmp_path)}
    cfg = app_run_config(ROOT, {**dict(run.overrides), **small})
    summary = run_engine(cfg, run.nodes)
    assert summary["status"] == "finished" and summary["rounds-trained"] == 1, (
        f"{', '.join(run.where)}: the command's run on {run.nodes} nodes did not train its "
        f"round: {summary}")
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    (round_1,) = [row for line in metrics.read_text().splitlines()
                  if (row := json.loads(line)).get("round") == 1]
    if cfg.fraction_train == 1.0:  # every node trained and was heard
        assert round_1["replies-used"] == run.nodes, (run.where, round_1)


# ---------------------------------------------------------------------------- the checker
def _page(tmp_path: Path, text: str) -> Page:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "page.md").write_text(text)
    return read_page(tmp_path / "docs" / "page.md", root=tmp_path)


def test_the_reader_finds_blocks_continuations_functions_and_inline_commands(
        tmp_path: Path) -> None:
    page = _page(tmp_path, "\n".join([
        "Run `flwr run .` first; `flwr run` is the program.",                     # 1
        "```bash",                                                                 # 2
        "pip install -e . && FLWR_HOME=x flwr run . \\",                           # 3
        '  --run-config "lr=0.1" --stream   # a comment',                          # 4
        'run() { flwr run . --federation-config "num-supernodes=3" "$@"; }',       # 5
        "cat > $D/run.toml <<EOF",                                                 # 6
        "flwr run = 1",                                                            # 7
        "EOF",                                                                     # 8
        "```",                                                                     # 9
        "| a | `run --run-config \"seed=1\"` |",                                   # 10
        "```text",                                                                 # 11
        "flwr run . --not-a-shell-block",                                          # 12
        "```",                                                                     # 13
    ]))
    assert [(c.line, c.text) for c in page.commands] == [
        (1, "flwr run ."),
        (3, 'FLWR_HOME=x flwr run . --run-config "lr=0.1" --stream'),
        (5, 'flwr run . --federation-config "num-supernodes=3"'),
        (10, 'flwr run . --federation-config "num-supernodes=3" --run-config "seed=1"'),
    ]
    assert page.heredocs == {"$D/run.toml": "flwr run = 1\n"}


@pytest.mark.parametrize(("text", "problem"), [
    ('flwr run . --run-config "num-partitions=10" --federation-config "num-supernodes=100"',
     r"num-partitions=10, but the simulation \(num-supernodes=100\) has 100 node\(s\)"),
    ('flwr run . --run-config "min-available-nodes=3"',
     r"min-available-nodes=3, but the simulation \(num-supernodes=2\) has 2 node\(s\): the "
     r"first round waits"),
    ("flwr run . --run-config presets/cifar10-resnet18.toml",
     r"num-partitions=100, but the simulation \(num-supernodes=2\)"),
    ('flwr run . --federation-config "num-supernode=4"',
     r"Flower refuses the configuration: Unknown simulation config field\(s\): num_supernode"),
    ('flwr run . --run-confg "lr=0.1"', r"Flower's `flwr run` refuses .*No such option"),
    ("flwr run . my-link --stream more", r"unexpected extra argument \(more\)"),
    ('flwr run . --run-config "learning-rate=0.1"', r"learning-rate"),
    ('flwr run . --run-config "key=value key2=value2"', r"invalid format"),
    ("flwr run . --run-config presets/missing.toml", r"no such file"),
])
def test_the_checker_catches_a_wrong_command(text: str, problem: str, tmp_path: Path) -> None:
    command = DocCommand(Path("docs/page.md"), 1, text)
    checked = check(command, Page(command.page), tmp_path)
    assert re.search(problem, "\n".join(checked.problems)), checked.problems


def test_a_command_that_needs_a_gpu_must_be_listed(tmp_path: Path) -> None:
    command = DocCommand(Path("docs/page.md"), 1, 'flwr run . --federation-config '
                         '"num-supernodes=4 client-resources-num-gpus=0.5"')
    checked = check(command, Page(command.page), tmp_path)
    assert not checked.problems
    assert needs(checked) == ["a GPU (client-resources-num-gpus)"]
    deployed = check(DocCommand(Path("docs/page.md"), 1, "flwr run . my-link"),
                     Page(command.page), tmp_path)
    assert deployed.problems == ["a deployment (my-link) without a node count in PARSE_ONLY"]
