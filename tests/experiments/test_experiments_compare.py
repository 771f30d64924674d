"""``[[compare]]``: rows from another suite's finished runs in this suite's report, never run
here; every problem of an entry reported at load time. Numbers are checked against the fake
run folders' hand-computed values (report test helpers)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from test_experiments_report import finish, table_rows

from fedshard_lab.experiments import SuiteError, load_suite, parse_suite, write_report
from fedshard_lab.experiments.compare import suite_file

ROOT = Path(__file__).resolve().parents[2]


def toml_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def write_suite(path: Path, data: dict[str, Any]) -> Path:
    """A suite file from a dict (tables of scalars, arrays of tables)."""
    lines = []
    for key, value in data.items():
        blocks = value if isinstance(value, list) else [value]
        for block in blocks:
            lines.append(f"[[{key}]]" if isinstance(value, list) else f"[{key}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in block.items()]
            lines.append("")
    path.write_text("\n".join(lines))
    return path


def base(name: str, tmp_path: Path, runs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "suite": {"name": name, "results-dir": str(tmp_path / f"res-{name}"),
                  "num-supernodes": 3, "seeds": [0, 1]},
        "defaults": {"model": "mlp", "num-server-rounds": 3, "min-available-nodes": 3},
        "runs": runs,
        **extra,
    }


@pytest.fixture
def table_suite(tmp_path: Path) -> Path:
    """The 'other' suite: a Top-n and a Collective cell at r = 0.1, and a reference row."""
    return write_suite(tmp_path / "table.toml", base("table", tmp_path, [
        {"label": "Top-n", "column": "r = 0.1", "method": "top-n", "keep-ratios": "0.1"},
        {"label": "Collective", "column": "r = 0.1", "method": "collective",
         "keep-ratios": "0.1"},
        {"label": "r = 1", "method": "top-n", "keep-ratios": "1.0"},
    ]))


def new_suite(tmp_path: Path, compare: list[dict[str, Any]], **suite: Any) -> Path:
    data = base("new", tmp_path, [
        {"label": "Low-rank", "column": "r = 0.1", "method": "top-n", "keep-ratios": "0.1",
         "init-keep-ratio": 0.1},
    ], compare=compare)
    data["suite"].update(suite)
    return write_suite(tmp_path / "new.toml", data)


def load_problems(path: Path) -> list[str]:
    with pytest.raises(SuiteError) as info:
        load_suite(path, app_dir=ROOT)
    assert "no run was started" in str(info.value)
    return info.value.problems


def test_compared_rows_show_the_other_suites_runs_and_are_never_run(
        tmp_path: Path, table_suite: Path) -> None:
    path = new_suite(tmp_path, [
        {"suite": "table", "label": "Top-n", "column": "r = 0.1"},
        {"suite": "table.toml", "label": "Collective", "column": "r = 0.1", "as": "Coll (old)"},
        {"suite": str(table_suite), "label": "r = 1"},
    ], rows=["Top-n [table]", "Low-rank", "Coll (old)"])
    suite = load_suite(path, app_dir=ROOT)
    other = load_suite(table_suite, app_dir=ROOT)
    # The runner's list holds this suite's own runs only.
    assert [(r.label, r.seed) for r in suite.runs] == [("Low-rank", 0), ("Low-rank", 1)]
    assert [(c.label, c.column, c.suite, c.row) for c in suite.comparisons] == [
        ("Top-n [table]", "r = 0.1", "table", "Top-n"),
        ("Coll (old)", "r = 0.1", "table", "Collective"),
        ("r = 1 [table]", None, "table", "r = 1"),
    ]
    assert suite.reference_rows == ("r = 1 [table]",)
    assert suite.comparisons[0].runs == other.cell("Top-n", "r = 0.1")
    assert all(r.directory.parent == tmp_path / "res-table" for c in suite.comparisons
               for r in c.runs)

    top, coll, ref = (other.cell(*k) for k in [("Top-n", "r = 0.1"),
                                                ("Collective", "r = 0.1"), ("r = 1", None)])
    finish(top[0], 0.60)
    finish(top[1], 0.70)
    finish(coll[0], 0.80)  # seed 1 not finished: one seed, marked
    finish(ref[0], 0.90)
    finish(ref[1], 0.94)
    own = suite.cell("Low-rank", "r = 0.1")
    finish(own[0], 0.75)
    files = write_report(suite)
    text = files.table.read_text()
    # Top-n [table]: mean(60, 70), stdev sqrt(50); the best cell (bold) may be a compared one.
    assert table_rows(text, "new: final test accuracy (%)") == {
        "Top-n [table]": ["65.00 ± 7.07"], "Low-rank": ["75.00†"], "Coll (old)": ["**80.00**†"],
    }
    assert table_rows(text, "Reference (one setting for every column)") == {
        "r = 1 [table]": ["92.00 ± 2.83"]}
    assert "1 of 2 runs finished" in text  # the compared runs are not this suite's
    assert "Top-n [table] = table's 'Top-n' / 'r = 0.1' (" in text
    data = json.loads(files.results.read_text())
    by_label = {c["label"]: c for c in data["cells"]}
    assert by_label["Top-n [table]"]["from-suite"] == "table"
    assert by_label["Low-rank"]["from-suite"] is None
    assert by_label["Top-n [table]"]["final-test-accuracy"] == pytest.approx([60.0, 70.0])
    milestones = files.milestones.read_text()
    assert re.search(r"\| Top-n \[table\] \| r = 0\.1 \| 1 \| .* \| 70\.00 \(r3\) \| 50\.00 \|",
                     milestones)  # last 5 of 0.1 + 0.6 r/3 (r = 1..3): mean(30, 50, 70)


def test_bold_goes_to_the_best_cell_compared_rows_included(
        tmp_path: Path, table_suite: Path) -> None:
    path = new_suite(tmp_path, [{"suite": "table", "label": "Collective", "column": "r = 0.1"}])
    suite = load_suite(path, app_dir=ROOT)
    other = load_suite(table_suite, app_dir=ROOT)
    for spec, acc in zip(other.cell("Collective", "r = 0.1"), [0.80, 0.82], strict=True):
        finish(spec, acc)
    for spec, acc in zip(suite.cell("Low-rank", "r = 0.1"), [0.70, 0.72], strict=True):
        finish(spec, acc)
    text = write_report(suite).table.read_text()
    assert table_rows(text, "new: final test accuracy (%)") == {
        "Low-rank": ["71.00 ± 1.41"], "Collective [table]": ["**81.00 ± 1.41**"]}


def test_every_problem_of_the_compare_entries_at_once(tmp_path: Path, table_suite: Path) -> None:
    found = load_problems(new_suite(tmp_path, [
        {"suite": "missing", "label": "Top-n", "column": "r = 0.1"},
        {"suite": "table", "label": "Unbiased", "column": "r = 0.1"},
        {"suite": "table", "label": "Top-n", "column": "r = 0.2"},
        {"suite": "table", "label": "Top-n", "column": "r = 0.1", "as": "Low-rank"},
        {"suite": "new", "label": "Low-rank", "column": "r = 0.1"},
        {"suite": "table", "label": "Top-n", "column": "r = 0.1", "seeds": [0]},
        {"label": "Top-n"},
        {"suite": "table", "label": ""},
        {"suite": "table", "label": "Top-n", "column": "r = 0.1"},
    ]))
    expected = [
        r"compare\[0\]: suite 'missing' is .*missing\.toml, which does not exist; expected NAME",
        r"compare\[1\]: suite 'table' .* has no row 'Unbiased' in column 'r = 0\.1'; its cells: "
        r"Collective / r = 0\.1; Top-n / r = 0\.1; r = 1 / \(reference\)",
        r"compare\[2\]: .* has no row 'Top-n' in column 'r = 0\.2'",
        r"compare\[3\]: label 'Low-rank' is a row of this suite's \[\[runs\]\]",
        r"compare\[4\]: compares the suite with itself",
        r"compare\[5\] unknown key 'seeds'; known keys: as, column, label, suite",
        r"compare\[6\]: missing 'suite' \(str\)",
        r"compare\[7\] label='': expected a non-empty string",
        r"compare\[8\]: row 'Top-n \[table\]' and column 'r = 0\.1' are already shown by "
        r"compare\[5\]",
    ]
    for pattern in expected:
        assert any(re.search(pattern, p) for p in found), (pattern, found)
    assert len(found) == len(expected), found


def test_an_invalid_compared_suite_is_named_and_its_own_compares_are_not_followed(
        tmp_path: Path) -> None:
    write_suite(tmp_path / "broken.toml", base("broken", tmp_path, [
        {"label": "X", "column": "c", "method": "no-such-method"}]))
    found = load_problems(new_suite(tmp_path, [{"suite": "broken", "label": "X", "column": "c"}]))
    assert len(found) == 1 and re.search(
        r"compare\[0\]: suite .*broken\.toml is invalid \(1 problem\(s\), first: .*method",
        found[0])
    # A compared suite that itself compares with a missing file still loads: no chains.
    write_suite(tmp_path / "chain.toml", base("chain", tmp_path, [
        {"label": "X", "column": "c", "method": "top-n"}],
        compare=[{"suite": "nowhere", "label": "Y"}]))
    suite = load_suite(new_suite(tmp_path, [{"suite": "chain", "label": "X", "column": "c"}]),
                       app_dir=ROOT)
    assert [c.label for c in suite.comparisons] == ["X [chain]"]
    # ...while loading it on its own reports its own entry.
    assert any("nowhere.toml, which does not exist" in p
               for p in load_problems(tmp_path / "chain.toml"))


def test_tables_may_name_compared_rows_but_not_unknown_ones(
        tmp_path: Path, table_suite: Path) -> None:
    path = new_suite(tmp_path, [{"suite": "table", "label": "Top-n", "column": "r = 0.1"}],
                     rows=["Top-n", "Low-rank"])
    found = load_problems(path)
    assert len(found) == 1 and re.search(
        r"\[suite\] rows names 'Top-n', which no \[\[runs\]\] or \[\[compare\]\] entry with a "
        r"column has; rows with columns: \['Low-rank', 'Top-n \[table\]'\]", found[0])


def test_suite_file_names() -> None:
    here = Path("/x/experiments")
    assert suite_file("fmnist-table", here) == here / "fmnist-table.toml"
    assert suite_file("other/t.toml", here) == here / "other" / "t.toml"
    assert suite_file("t.toml", here) == here / "t.toml"
    assert suite_file("/abs/t.toml", here) == Path("/abs/t.toml")


def test_the_beyond_suite_compares_with_the_fmnist_table_runs() -> None:
    suite = load_suite(ROOT / "experiments" / "beyond.toml")
    table = load_suite(ROOT / "experiments" / "fmnist-table.toml")
    assert suite.comparisons, "beyond.toml shows the table's r = 0.1 rows"
    for comp in suite.comparisons:
        assert comp.suite == "fmnist-table" and comp.column == "r = 0.1"
        assert comp.runs == table.cell(comp.row, "r = 0.1")
        # Same setup as the beyond runs except what the row itself sets.
        mine = suite.runs[0].config.as_dict()
        theirs = comp.runs[0].config.as_dict()
        for key in ("dataset", "model", "model-width", "num-server-rounds", "fraction-train",
                    "dirichlet-alpha", "local-epochs", "batch-size", "lr", "momentum",
                    "frobenius-decay", "keep-ratios", "eval-every"):
            assert theirs[key] == mine[key], key


@pytest.mark.parametrize("key", ["compare", "tables", "runs"])
def test_a_block_key_that_is_not_an_array_of_tables_is_named(key: str) -> None:
    data: dict[str, Any] = {
        "suite": {"name": "t", "results-dir": "results/t", "num-supernodes": 3},
        "defaults": {"model": "mlp", "min-available-nodes": 3},
        "runs": [{"label": "A", "column": "c", "method": "top-n"}],
    }
    data[key] = {"label": "A"}  # a [key] table, not [[key]] blocks
    with pytest.raises(SuiteError) as info:
        parse_suite(data, app_dir=ROOT, source="t.toml")
    assert f"[[{key}]] must be an array of tables ([[{key}]] blocks)" in info.value.problems


def test_a_compared_suite_may_show_rows_of_its_own_compare_entries(
        table_suite: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A suite compares with one that itself shows another suite's rows (its `rows` and
    `[[tables]]` name them): its own cells are found, its comparisons are not followed."""
    middle = base("middle", tmp_path, [
        {"label": "Low-rank", "column": "r = 0.1", "method": "top-n", "keep-ratios": "0.1",
         "init-keep-ratio": 0.1}],
        compare=[{"suite": "table", "label": "Top-n", "column": "r = 0.1"}],
        tables=[{"title": "both", "rows": ["Top-n [table]", "Low-rank"]}])
    middle["suite"]["rows"] = ["Top-n [table]", "Low-rank"]
    write_suite(tmp_path / "middle.toml", middle)
    top = base("top", tmp_path, [
        {"label": "Wide", "column": "r = 0.1", "method": "heterofl", "keep-ratios": "0.1",
         "width-match": "keep-ratio"}],
        compare=[{"suite": "middle", "label": "Low-rank", "column": "r = 0.1"}])
    suite = load_suite(write_suite(tmp_path / "top.toml", top), app_dir=ROOT)
    (comp,) = suite.comparisons
    assert comp.label == "Low-rank [middle]" and [r.seed for r in comp.runs] == [0, 1]
    assert "is in no table" not in caplog.text
    # loaded for itself, the middle suite still checks its rows and tables in full
    assert [c.label for c in load_suite(tmp_path / "middle.toml", app_dir=ROOT).comparisons] \
        == ["Top-n [table]"]
    middle["suite"]["rows"] = ["Top-n [tabel]", "Low-rank"]
    write_suite(tmp_path / "middle.toml", middle)
    assert any("Top-n [tabel]" in p for p in load_problems(tmp_path / "middle.toml"))
