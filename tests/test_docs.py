"""The documentation site builds with warnings as errors (broken references and images
included), and its command-line reference names every option of the programs."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: docs/robustness.md (the defences, their defaults and headline figures) and the page of its
#: measured tables, each with its record and command (docs/robustness-tables.md)
ROBUSTNESS, ATTACK_TABLES = DOCS / "robustness.md", DOCS / "robustness-tables.md"


def test_the_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    missing = [name for name in ("sphinx", "myst_parser", "furo")
               if importlib.util.find_spec(name) is None]
    if missing:
        pytest.fail(f"Cannot build the docs: {', '.join(missing)} not installed; "
                    "install the test extra with pip install -e '.[test]'.")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-j", "1", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert result.returncode == 0, (
        f"sphinx-build failed (exit {result.returncode}); its warnings:\n"
        f"{result.stderr}\n{result.stdout}")
    assert (tmp_path / "html" / "index.html").is_file()


#: Run in a fresh interpreter: torch, torchvision, Flower, Ray and matplotlib are hidden from
#: the import system as if not installed (no finder finds them), then Sphinx builds the site.
_LIGHT_BUILD = """
import importlib.machinery, sys
HIDDEN = {"torch", "torchvision", "flwr", "ray", "matplotlib"}
class Finder(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return super().find_spec(name, path, target)
sys.meta_path[:] = [Finder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
from sphinx.cmd.build import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_docs_build_without_torch_or_flower(tmp_path: Path) -> None:
    """A light environment (Sphinx, MyST, furo, numpy; contributing.md) builds the site too:
    the API pages' autodoc mocks what is missing. The dummy builder reads every page and runs
    autodoc, without writing HTML."""
    pytest.importorskip("myst_parser")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", _LIGHT_BUILD, "-W", "--keep-going", "-q", "-b", "dummy",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert result.returncode == 0, (
        f"the light docs build failed (exit {result.returncode}):\n"
        f"{result.stderr[-6000:]}\n{result.stdout[-2000:]}")


CLI_PAGE = DOCS / "cli.md"


@pytest.mark.parametrize(("module", "argv"), [
    ("fedshard_lab.experiments.__main__", ["--help"]),
    ("fedshard_lab.experiments.__main__", ["run", "--help"]),
    ("fedshard_lab.experiments.__main__", ["status", "--help"]),
    ("fedshard_lab.experiments.__main__", ["report", "--help"]),
    ("fedshard_lab.engine.__main__", ["--help"]),
])
def test_every_command_line_option_is_on_the_cli_page(
        module: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """docs/cli.md names every option and subcommand that the programs' --help lists."""
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    page = CLI_PAGE.read_text(encoding="utf-8")
    options = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", help_text))
    commands = re.search(r"\{([\w,]+)\}", help_text)
    names = options | (set(commands.group(1).split(",")) if commands else set())
    missing = sorted(name for name in names if f"`{name}" not in page and f" {name}" not in page)
    assert not missing, f"{module} {' '.join(argv)}: not on docs/cli.md: {missing}"


def test_width_pages_tables_are_the_committed_measurements() -> None:
    """docs/width-slicing.md's cost table is what benchmarks/width_budget.py prints from the
    committed result, and its accuracy tables are the experiment reports' (table.md)."""
    root = DOCS.parent
    spec = importlib.util.spec_from_file_location("width_budget",
                                                  root / "benchmarks" / "width_budget.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (DOCS / "width-slicing.md").read_text(encoding="utf-8")
    costs = json.loads((root / "results" / "width-budget" / "costs.json").read_text())
    assert module.markdown(costs) in page
    for suite in ("width-table", "width-resnet"):
        report = (root / "results" / suite / "table.md").read_text(encoding="utf-8")
        main = report.split("## ", 2)[1].split("\n", 1)[1].strip().split("\n\n")[0]
        assert main in page, f"{suite}'s table.md main table is not on the page as written"


def test_results_page_shakespeare_tables_are_the_report() -> None:
    """docs/results.md's Shakespeare tables are the experiment report's (table.md), and its
    side-by-side table quotes the same means and paired differences (results.json)."""
    root = DOCS.parent
    page = (DOCS / "results.md").read_text(encoding="utf-8")
    report = (root / "results" / "shakespeare-reduced" / "table.md").read_text(encoding="utf-8")
    main = report.split("## ", 2)[1].split("\n", 1)[1].strip().split("\n\n")[0]
    assert main in page
    for row in report.split("## Reference", 1)[1].split("\n\n")[1].splitlines()[2:]:
        assert row in page, row
    report_json = json.loads(
        (root / "results" / "shakespeare-reduced" / "results.json").read_text())
    cells = {c["label"]: dict(zip(c["seeds-finished"], c["final-test-accuracy"], strict=True))
             for c in report_json["cells"]}
    side = page.split("| r = 0.1 | paper | here", 1)[1].split("\n\n")[0]
    rows = side.splitlines()[2:]
    assert len(rows) == len(cells) == 7
    for line in rows:
        label, _paper, here, paired = (c.strip() for c in line.strip("|").split("|"))
        finals = cells[label]
        assert sorted(finals) == [0, 1], label
        assert here.startswith(f"{sum(finals.values()) / 2:.2f} ± "), (label, here)
        if paired:
            want = [finals[seed] - cells["Top-n"][seed] for seed in (0, 1)]
            assert paired == ", ".join(f"{d:+.2f}".replace("-", "−") for d in want), label


def _attack_table(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(DOCS.parent / "benchmarks"))  # its sibling modules
    spec = importlib.util.spec_from_file_location(
        "attack_table", DOCS.parent / "benchmarks" / "attack_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_merged_attack_tables_keep_every_seed_and_recompute_the_means(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = _attack_table(monkeypatch)

    def out(seeds: list[int], deltas: list[float]) -> Path:
        cells = {str(s): {"accuracy": 0.7, "delta-points": d}
                 for s, d in zip(seeds, deltas, strict=True)}
        path = tmp_path / f"{seeds[0]}.json"
        path.write_text(json.dumps({
            "size": {"rounds": 12, "seeds": seeds}, "date": "d", "cpu": "c", "torch": "t",
            "threads": 1, "wall-s": 1.0,
            "results": {"default": {"keys": {}, "clean": {str(s): {} for s in seeds},
                                    "attacks": {"replay/1": {"seeds": cells}}}}}))
        return path

    merged = at.merge([str(out([0, 1, 2], [-1.0, -2.0, 0.0])), str(out([3, 4], [-4.0, -8.0]))])
    cell = merged["results"]["default"]["attacks"]["replay/1"]
    assert merged["size"]["seeds"] == [0, 1, 2, 3, 4]
    assert (cell["delta-points-mean"], cell["delta-points-worst"]) == (-3.0, -8.0)
    assert sorted(cell["seeds"]) == ["0", "1", "2", "3", "4"]
    with pytest.raises(SystemExit, match=r"seeds \[0, 1, 2\] overlap \[0, 1, 2\]"):
        at.merge([str(tmp_path / "0.json"), str(tmp_path / "0.json")])


def test_robustness_pages_six_seed_table_is_the_committed_measurement(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/robustness-tables.md's six-seed table is what benchmarks/attack_table.py prints
    from the committed output, row for row."""
    at = _attack_table(monkeypatch)
    path = DOCS.parent / "results" / "robustness" / "attacks-defaults-seeds-0-5.json"
    assert json.loads(path.read_text())["size"]["seeds"] == [0, 1, 2, 3, 4, 5]
    rows = at.markdown([str(path)]).split("\n\n", 1)[1]
    assert rows in ATTACK_TABLES.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["attacks-width-before-hold-seeds-0-2",
                                  "attacks-width-seeds-0-5", "attacks-collective-seeds-0-2"])
def test_robustness_pages_width_tables_are_the_committed_measurements(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/robustness-tables.md's width-slicing tables (per method, before and after the
    median hold) are what benchmarks/attack_table.py prints from the committed outputs, table
    for table."""
    at = _attack_table(monkeypatch)
    path = DOCS.parent / "results" / "robustness" / f"{name}.json"
    out = json.loads(path.read_text())
    assert all(table["keys"].get("method") for table in out["results"].values())
    assert at.markdown([str(path)]) in ATTACK_TABLES.read_text(encoding="utf-8")


TRUSTED = sorted((DOCS.parent / "results" / "robustness").glob("attacks-trusted-data-*.json"))


@pytest.mark.parametrize("path", TRUSTED, ids=[p.stem for p in TRUSTED])
def test_robustness_pages_trusted_data_tables_are_the_committed_measurements(
        path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/robustness-tables.md's trusted-data tables are what benchmarks/attack_table.py
    prints from the committed outputs, table for table."""
    at = _attack_table(monkeypatch)
    out = json.loads(path.read_text())
    assert [t["keys"] for t in out["results"].values()] == [{"trusted-data": 500}]
    assert at.markdown([str(path)]) in ATTACK_TABLES.read_text(encoding="utf-8")


def test_robustness_pages_trusted_data_figures_are_the_committed_measurements() -> None:
    """The trusted-data section's lead figures on docs/robustness.md (per share of dishonest
    nodes the worst mean cost and the worst seed, the clean runs and the honest nodes they
    named) are the committed outputs'."""
    text = " ".join(ROBUSTNESS.read_text(encoding="utf-8").split())
    tables = [json.loads(p.read_text())["results"]["trusted-data"] for p in TRUSTED]
    assert tables, "no trusted-data table is committed"
    facts = []
    for k, share in (("3", "three"), ("1", "one")):
        cells = [c for t in tables for key, c in t["attacks"].items()
                 if key.endswith(f"/{k}")]
        if not cells:
            continue
        worst = min(c["delta-points-mean"] for c in cells)
        seed = min(s["delta-points"] for c in cells for s in c["seeds"].values())
        facts.append(f"{share} in ten {-worst:.1f} points on average at most (worst seed "
                     f"{-seed:.1f})")
    clean = tables[0]["clean"].values()
    facts.append(" / ".join(f"{c['accuracy']:.3f}" for c in clean))
    missing = [f for f in facts if f not in text]
    assert not missing, missing


def test_robustness_pages_naming_figures_are_the_committed_measurements(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The honest nodes named before and after the 10-round record: the 5-round rule recomputed
    here by brute force from the committed cosines agrees with what that code named; the
    current rule, replayed on them, names none; the table run under it named none (the
    figures on docs/robustness-tables.md; the honest nodes of the clean runs in the section's
    lead on docs/robustness.md)."""
    import numpy as np

    at = _attack_table(monkeypatch)
    text = " ".join(ATTACK_TABLES.read_text(encoding="utf-8").split())
    lead = " ".join(ROBUSTNESS.read_text(encoding="utf-8").split())
    path = DOCS.parent / "results" / "robustness" / "trust-record-clean-window-5.json"
    before = json.loads(path.read_text())["results"]["trusted-data"]["clean"]
    named, lowest = {}, 1.0
    for seed, cell in before.items():
        first = {}
        for node, pairs in cell["cosines"].items():
            row = [c for _, c in pairs]
            for i in range(2, len(row)):  # at least 3 rounds
                if node not in first and np.median(row[max(0, i - 4):i + 1]) < 0.02:
                    first[node] = pairs[i][0]
                lowest = min(lowest, float(np.median(row[max(0, i - 9):i + 1])))
        assert len(first) == cell["honest-nodes-named"], seed  # that code's rule, recomputed
        named[seed] = first
        assert at.replay_names(cell["cosines"], 0.02) == {}, seed  # the current rule
    counts = [len(named[s]) for s in sorted(named)]
    rounds = sorted(r for f in named.values() for r in f.values())
    facts = [f"fell below for {sum(counts)} of {10 * len(before)} honest nodes",
             ", ".join(f"seed {s}: {len(named[s])}" for s in sorted(named)),
             f"all in rounds {rounds[0]}–{rounds[-1]}",
             f"`honest-nodes-named` {' / '.join(map(str, counts))}",
             f"the lowest median of any honest node in any round: {lowest:.3f}"]
    assert f"median cosine of all {10 * len(before)} honest nodes" in lead
    after = json.loads((DOCS.parent / "results" / "robustness" /
                        "attacks-trusted-data-one-b.json").read_text())
    clean = after["results"]["trusted-data"]["clean"].values()
    facts.append("ran under the 10-round rule: " + " / ".join(
        str(c["honest-nodes-distrusted"]) for c in clean))
    attacked = [s for c in after["results"]["trusted-data"]["attacks"].values()
                for s in c["seeds"].values()]
    facts.append(f"the record's rule named {sum(s['honest-nodes-distrusted'] for s in attacked)} "
                 f"of the {9 * len(attacked)} honest nodes of the seven attacks of that table "
                 f"(any WARNING line: {sum(s['honest-nodes-named'] for s in attacked)})")
    missing = [f for f in facts if f not in text]
    assert not missing, missing


HISTORY = ["attacks-history", "attacks-absent-three", "attacks-trusted-exclude"]


@pytest.mark.parametrize("name", HISTORY)
def test_robustness_pages_history_tables_are_the_committed_measurements(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/robustness-tables.md's tables of the record without trusted data (and of
    exclusion) are what benchmarks/attack_table.py prints from the committed outputs."""
    at = _attack_table(monkeypatch)
    path = DOCS.parent / "results" / "robustness" / f"{name}.json"
    assert at.markdown([str(path)]) in ATTACK_TABLES.read_text(encoding="utf-8")


def test_robustness_pages_history_figures_are_the_committed_measurements() -> None:
    """What the record alone does, as the section says it: the nodes it names and leaves
    out, IPM's cost against the defaults' on the same seeds, and the honest nodes named on
    the clean runs under each threshold."""
    root = DOCS.parent / "results" / "robustness"

    def table(name: str) -> dict[str, Any]:
        out = json.loads((root / f"{name}.json").read_text())["results"]
        return next(iter(out.values()))

    history, below, default = (table("attacks-history"), table("attacks-history-below-0.02"),
                               table("attacks-default-seeds-0-2"))
    text = " ".join(ATTACK_TABLES.read_text(encoding="utf-8").split())
    ipm = history["attacks"]["ipm/3"]
    by_round = max(s["round-all-dishonest-named"] for s in ipm["seeds"].values())
    facts = [
        f"IPM's nodes were named by round {by_round} in every seed",
        f"{-ipm['delta-points-mean']:.1f} points on average where the defaults lose "
        f"{-default['attacks']['ipm/3']['delta-points-mean']:.1f}",
        "At −0.5 the clean runs named " + " / ".join(str(c["honest-nodes-distrusted"])
                                                   for c in history["clean"].values()),
        "at `distrust-below-aggregate = 0.02` the clean runs named " + " / ".join(
            str(c["honest-nodes-distrusted"]) for c in below["clean"].values()),
        "lost " + " / ".join(f"{100 * (d['accuracy'] - b['accuracy']):.1f}" for d, b in zip(
            default["clean"].values(), below["clean"].values(), strict=True)) + " points",
    ]
    minus = table("attacks-history-below-minus-0.3")["attacks"]["zero/3"]["seeds"].values()
    facts.append("at −0.3 the record named " + " / ".join(
        str(c["honest-nodes-distrusted"]) for c in minus) + " honest nodes in the zero-update runs")
    absent = table("attacks-absent-three")["attacks"]["absent/3"]["seeds"].values()
    facts.append("lose " + " / ".join(f"{-c['delta-points']:.1f}" for c in absent) + " points")
    missing = [f for f in facts if f not in text]
    assert not missing, missing


def test_robustness_pages_honest_nodes_named_under_attack_are_the_committed_measurements(
        ) -> None:
    """The honest nodes the record named in the attacked runs of the one-in-ten (first seven
    attacks) and three-in-ten trusted-data tables, as the section counts them."""
    root = DOCS.parent / "results" / "robustness"
    text = " ".join(ATTACK_TABLES.read_text(encoding="utf-8").split())
    facts = []
    for name, k, words in (("attacks-trusted-data-one-a", 1, "of the other seven"),
                           ("attacks-trusted-data-three", 3, "of the three-in-ten table")):
        table = json.loads((root / f"{name}.json").read_text())["results"]["trusted-data"]
        cells = [c for a in table["attacks"].values() for c in a["seeds"].values()]
        named = sum(c["honest-nodes-distrusted"] for c in cells)
        facts.append(f"{named} of the {(10 - k) * len(cells)} {words}")
    missing = [f for f in facts if f not in text]
    assert not missing, missing


def test_robustness_pages_floor_figures_are_the_committed_measurements() -> None:
    """The three-in-ten table's seed 2: how many attacks cost it more than 5 points, in which
    range, how many of those had every dishonest node named by round 3, and what the same
    runs lose with the three nodes absent."""
    root = DOCS.parent / "results" / "robustness"
    text = " ".join(ATTACK_TABLES.read_text(encoding="utf-8").split())
    three = json.loads((root / "attacks-trusted-data-three.json").read_text())
    over = [c["seeds"]["2"] for c in three["results"]["trusted-data"]["attacks"].values()
            if c["seeds"]["2"]["delta-points"] < -5]
    early = sum(1 for c in over if (c.get("round-all-dishonest-named") or 99) <= 3)
    words = {5: "five", 6: "six", 7: "seven", 8: "eight"}
    deltas = [-c["delta-points"] for c in over]
    facts = [f"more than 5 points in {words[len(over)]} attacks ({min(deltas):.1f} to "
             f"{max(deltas):.1f}), with the dishonest nodes of {words[early]} of them named by "
             "round 3"]
    missing = [f for f in facts if f not in text]
    assert not missing, missing


#: The most lines each long page may have; what does not fit moves to a page of its own
#: (docs/robustness-tables.md, docs/results-beyond.md, docs/results-factor-step.md,
#: docs/integration-recipes.md), linked from it.
PAGE_LINES = {"README.md": 220, "docs/robustness.md": 250, "docs/results.md": 350,
              "docs/integration.md": 350}


@pytest.mark.parametrize(("page", "most"), sorted(PAGE_LINES.items()))
def test_the_long_pages_stay_short_enough_to_read(page: str, most: int) -> None:
    lines = (DOCS.parent / page).read_text(encoding="utf-8").splitlines()
    assert len(lines) <= most, f"{page} has {len(lines)} lines, more than {most}"


@pytest.mark.parametrize(("page", "moved"), [
    ("robustness.md", "robustness-tables.md"), ("results.md", "results-beyond.md"),
    ("results.md", "results-factor-step.md"), ("integration.md", "integration-recipes.md")])
def test_each_page_links_the_page_its_tables_moved_to(page: str, moved: str) -> None:
    assert f"]({moved}" in (DOCS / page).read_text(encoding="utf-8")
    assert f"]({page}" in (DOCS / moved).read_text(encoding="utf-8")
