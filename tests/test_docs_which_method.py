"""docs/which-method.md, README's advice and docs/sharding.md's first question against the
mixed-capacity record: the page's tables are what ``benchmarks/mixed_capacity.py`` prints from
``results/mixed-capacity/table.json``, that record is what the committed runs say, each number
the prose cites is a cell of it, and the page says how many of the suite's runs stand behind it.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "mixed-capacity"
TABLE = RESULTS / "table.json"
PAGE = ROOT / "docs" / "which-method.md"

A = "20 % r = 1 / 80 % r = 0.1"
B = "60 % r = 0.2 / 40 % r = 0.4"
C = "r = 0.1"
TOPN = "Top-n, low-rank start"
STRONG_10 = "Strong devices only, 10 a round"

#: (column, budget, row) of every accuracy the page's prose cites as "mean ± std %"
PAGE_CELLS = [
    (A, "full", "Small model"), (A, "full", "Whole model, every node"),
    (A, "full", TOPN), (A, "full", "Strong devices only"), (A, "full", "Collective"),
    (A, "full", "HeteroFL"), (A, "full", "Ordered dropout"), (A, "full", "FedRolex"),
    (A, "r0.1", "HeteroFL"), (A, "r0.1", "Ordered dropout"), (A, "r0.1", "Collective"),
    (B, "full", "Small model"), (B, "full", TOPN), (B, "r0.2", "HeteroFL"),
    (C, "full", "Small model"), (C, "r0.1", "HeteroFL"), (C, "r0.1", TOPN),
    (C, "r0.1", "Collective"), (A, "full", STRONG_10), (A, "r0.1", STRONG_10),
    (A, "full", "PriSM + Wallenius + ClipLR"), (B, "full", "Collective"),
    (B, "full", "PriSM + Wallenius + ClipLR"), (C, "r0.1", "PriSM + Wallenius + ClipLR"),
]
#: (column, budget, row) whose paired difference to the column's best baseline the prose cites
PAGE_DIFFERENCES = [(A, "full", TOPN), (B, "full", TOPN), (C, "r0.1", TOPN),
                    (A, "r0.1", "HeteroFL"), (A, "r0.1", "Ordered dropout"),
                    (A, "full", STRONG_10), (A, "full", "Whole model, every node")]
#: (column, budget, row) of which the prose says in how many seeds it beat the best baseline
PAGE_SEED_COUNTS = [(A, "full", STRONG_10)]
#: what README's and docs/sharding.md's advice cite
ADVICE_CELLS = [(A, "full", "Small model"), (A, "full", "Whole model, every node"),
                (A, "full", TOPN), (A, "r0.1", "HeteroFL")]


def _module() -> Any:
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "mixed_capacity", ROOT / "benchmarks" / "mixed_capacity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flat(path: Path) -> str:
    return " ".join(path.read_text(encoding="utf-8").split())


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    return json.loads(TABLE.read_text())


def accuracy(record: dict[str, Any], column: str, budget: str, row: str) -> str:
    """A cell as the prose writes it: ``74.0 ± 0.3 %`` (one seed: ``74.0 %``)."""
    e = record["statistics"][column][budget][row]
    spread = f" ± {100 * e['std']:.1f}" if e["std"] is not None else ""
    return f"{100 * e['mean']:.1f}{spread} %"


def difference(record: dict[str, Any], column: str, budget: str, row: str) -> str:
    """A paired difference as the prose writes it: ``-6.5 ± 2.3 points``."""
    d = record["statistics"][column][budget][row]["vs-best-baseline"]
    spread = f" ± {100 * d['std']:.1f}" if d["std"] is not None else ""
    return f"{100 * d['mean']:+.1f}{spread} points"


def test_the_pages_tables_are_what_the_script_prints_from_the_record(
        record: dict[str, Any]) -> None:
    module = _module()
    page = _flat(PAGE)
    assert " ".join(module.markdown(record).split()) in page
    assert " ".join(module.costs_markdown(record).split()) in page


def test_the_record_is_what_the_committed_runs_say(record: dict[str, Any]) -> None:
    """Rebuilt from the committed run folders, the statistics are the record's: no cell
    was written or kept by hand."""
    module = _module()
    found = module.collect([RESULTS])
    assert module.statistics_of(found["cells"]) == record["statistics"]
    assert found["missing"] == record["runs"]["missing"]
    assert found["commits"] == record["runs"]["commits"]


def test_every_committed_run_is_a_finished_runner_record_without_its_model() -> None:
    folders = [p for p in RESULTS.iterdir() if p.is_dir()]
    assert folders
    for folder in folders:
        names = {p.name for p in folder.iterdir()}
        assert {"config.json", "metrics.jsonl", "runner.json", "summary.json"} <= names, folder
        assert not any(n.endswith((".pt", ".pth")) for n in names), folder
        runner = json.loads((folder / "runner.json").read_text())
        summary = json.loads((folder / "summary.json").read_text())
        assert runner["status"] == "finished" and runner["returncode"] == 0, folder
        assert summary["status"] == "finished", folder
        assert runner["run-name"] == folder.name


_WORDS = ("no", "one", "two", "three", "four", "five", "six")


def seeds_higher(record: dict[str, Any], column: str, budget: str, row: str) -> str:
    """How the prose counts the seeds where ``row`` scored above the column's best baseline,
    each seed against the same seed's baseline: ``scored higher in one of the three seeds``."""
    cells = record["statistics"][column][budget]
    e = cells[row]
    base = cells[e["vs-best-baseline"]["baseline"]]["seeds"]
    higher = sum(acc > base[seed] for seed, acc in e["seeds"].items() if seed in base)
    paired = sum(seed in base for seed in e["seeds"])
    return f"scored higher in {_WORDS[higher]} of the {_WORDS[paired]} seeds"


def test_the_page_says_where_when_how_and_how_much_of_the_suite(record: dict[str, Any]) -> None:
    page = _flat(PAGE)
    runs = record["runs"]
    facts = [record["cpu"], record["torch"], record["date"], record["command"],
             "results/mixed-capacity/table.json", "python docs/figures.py mixed-capacity",
             f"{runs['finished']} of the suite's {runs['expected']} runs"]
    if not record["complete"]:
        facts.append("not yet in this record")  # what the page says of the missing runs
    missing = [f for f in facts if " ".join(f.split()) not in page]
    assert not missing, f"docs/which-method.md lacks {missing}"


def test_the_run_time_the_page_gives_is_the_runner_records(record: dict[str, Any]) -> None:
    """"the last N runs ... took A to B minutes each": the wall time (``wall-s``) the runner
    wrote for the N runs it launched last, rounded to minutes."""
    page = _flat(PAGE)
    said = re.search(r"the last (\d+) runs of this record, .*? took (\d+) to (\d+) minutes each",
                     page)
    assert said, "docs/which-method.md no longer says how long the last runs took"
    runners = sorted((json.loads((folder / "runner.json").read_text())
                      for folder in RESULTS.iterdir() if folder.is_dir()),
                     key=lambda r: r["launched"])
    last = [r["wall-s"] / 60 for r in runners[-int(said.group(1)):]]
    assert (round(min(last)), round(max(last))) == (int(said.group(2)), int(said.group(3)))


def test_each_number_the_pages_prose_cites_is_a_cell_of_the_record(
        record: dict[str, Any]) -> None:
    page = _flat(PAGE)
    facts = [accuracy(record, *cell) for cell in PAGE_CELLS]
    facts += [difference(record, *cell) for cell in PAGE_DIFFERENCES]
    facts += [seeds_higher(record, *cell) for cell in PAGE_SEED_COUNTS]
    missing = [f for f in facts if f not in page]
    assert not missing, f"docs/which-method.md lacks {missing}"


def test_each_cost_the_pages_prose_cites_is_the_records(record: dict[str, Any]) -> None:
    page = _flat(PAGE)
    costs = record["costs"]
    dense, at = costs["dense"], costs["ratios"]["0.1"]
    spectral, width = at["spectral"], at["width-same-flops"]
    facts = [*(f"{c['tensor-peak-bytes'] / 1e6:.1f} MB" for c in (spectral, dense, width)),
             *(f"{c['bytes-received'] / 1e6:.2f} MB" for c in (spectral, width, dense)),
             f"{dense['bytes-received'] / spectral['bytes-received']:.1f} times fewer",
             f"width {width['width']} of 16"]
    missing = [f for f in facts if f not in page]
    assert not missing, f"docs/which-method.md lacks {missing}"


@pytest.mark.parametrize("path", ["README.md", "docs/sharding.md"])
def test_the_advice_elsewhere_cites_the_same_cells(record: dict[str, Any], path: str) -> None:
    text = _flat(ROOT / path)
    facts = [accuracy(record, *cell) for cell in ADVICE_CELLS]
    missing = [f for f in facts if f not in text]
    assert not missing, f"{path} lacks {missing}"
    assert "which-method.md" in text
    assert "try width slicing at the same compute first" not in text


def test_the_cited_cells_exist_and_the_formats_can_fail(record: dict[str, Any]) -> None:
    """The helpers read real cells and would miss a changed one."""
    cell = record["statistics"][A]["full"]["Small model"]
    assert accuracy(record, A, "full", "Small model").startswith(f"{100 * cell['mean']:.1f}")
    changed = json.loads(json.dumps(record))
    changed["statistics"][A]["full"]["Small model"]["mean"] += 0.01
    assert accuracy(changed, A, "full", "Small model") not in _flat(PAGE)
    # a seed that turns the count changes the words the page must say
    column, budget, row = PAGE_SEED_COUNTS[0]
    said = seeds_higher(record, column, budget, row)
    cells = changed["statistics"][column][budget]
    base = cells[cells[row]["vs-best-baseline"]["baseline"]]["seeds"]
    for seed in cells[row]["seeds"]:
        cells[row]["seeds"][seed] = base[seed] + (0.01 if "in no of" in said else -0.01)
    assert seeds_higher(changed, column, budget, row) != said


def test_the_figure_draws_every_row_of_the_suite_from_the_committed_records(
        tmp_path: Path) -> None:
    """docs/figures.py has a style for each row the suite can put in the record (a new row
    without one would stop the figure), and draws the page's figure from the committed
    results."""
    spec = importlib.util.spec_from_file_location("figures", ROOT / "docs" / "figures.py")
    assert spec is not None and spec.loader is not None
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    from fedshard_lab.experiments.suite import load_suite

    suite = load_suite(ROOT / "experiments" / "mixed-capacity.toml", resolve_comparisons=False)
    assert {run.label for run in suite.runs} <= set(figures.MIXED_STYLES)
    path = figures.figure_mixed_capacity(tmp_path)
    assert path.stat().st_size > 10_000


def test_the_page_names_every_run_whose_code_state_is_not_recorded() -> None:
    """Each run of results/mixed-capacity/ whose config.json records a '-dirty' commit is
    named on the page (row, column, seed), and no other."""
    import collections

    root = Path(__file__).resolve().parents[1]
    dirty: dict[tuple[str, str | None], list[int]] = collections.defaultdict(list)
    for config in sorted((root / "results" / "mixed-capacity").glob("*/config.json")):
        if json.loads(config.read_text()).get("git-commit", "").endswith("-dirty"):
            runner = json.loads((config.parent / "runner.json").read_text())
            dirty[(runner["label"], runner.get("column"))].append(runner["seed"])
    page = " ".join((root / "docs" / "which-method.md").read_text().split())
    start = page.index("**Runs whose code state is not recorded**")
    named = page[start:page.index("- **", start + 10) if "- **" in page[start + 10:] else None]
    for (label, column), seeds in dirty.items():
        seeds_text = ", ".join(map(str, sorted(seeds)))
        where = f"{label}, {column}" if column else label
        assert f"{where}: seed{'s' if len(seeds) > 1 else ''} {seeds_text}" in named, where
    assert f"{sum(len(s) for s in dirty.values())} of the 60 ran" in named
