"""The report from fake run folders: table numbers against hand-computed means and sample
standard deviations, bold and dagger rules, results.json, and valid PNG plots."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from fedshard_lab.experiments import Suite, parse_suite, write_report
from fedshard_lab.experiments.suite import RunSpec

ROOT = Path(__file__).resolve().parents[2]


def make_suite(tmp_path: Path) -> Suite:
    data: dict[str, Any] = {
        "suite": {"name": "t", "results-dir": str(tmp_path / "res"), "num-supernodes": 3,
                  "seeds": [0, 1]},
        "defaults": {"model": "mlp", "num-server-rounds": 3, "min-available-nodes": 3},
        "runs": [
            {"label": "A", "column": "c1", "method": "top-n"},
            {"label": "B", "column": "c1", "method": "collective"},
            {"label": "A", "column": "c2", "method": "top-n"},
            {"label": "B", "column": "c2", "method": "collective"},
            {"label": "C", "column": "c2", "method": "unbiased", "num-server-rounds": 2,
             "seeds": [0]},
            {"label": "Ref", "method": "top-n", "keep-ratios": "1.0"},
        ],
        "tables": [{"title": "A against C", "rows": ["A", "C"], "columns": ["c2"]}],
    }
    data["suite"]["rows"] = ["A", "B", "C"]
    return parse_suite(data, app_dir=ROOT, source="t.toml")


def finish(spec: RunSpec, final: float, anme: list[float] | None = None, *,
           summary: bool = True) -> None:
    """A finished run folder in RunRecorder's documented format; accuracies rise linearly
    from 0.1 at round 0 to ``final`` at the last round."""
    rounds = spec.num_rounds
    rows: list[dict[str, Any]] = []
    for r in range(rounds + 1):
        row: dict[str, Any] = {"round": r, "round-s": 1.0,
                               "test-accuracy": 0.1 + (final - 0.1) * r / rounds}
        if anme is not None:
            row["anme"] = anme[r]
        rows.append(row)
    spec.directory.mkdir(parents=True)
    (spec.directory / "config.json").write_text(json.dumps({"config": spec.config.as_dict()}))
    (spec.directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary:
        (spec.directory / "summary.json").write_text(json.dumps({
            "rounds-completed": rounds, "final-test-accuracy": final,
            "best-test-accuracy": final, "wall-s": 12.5}))


def populate(suite: Suite) -> None:
    runs = {(r.label, r.column, r.seed): r for r in suite.runs}
    finish(runs["A", "c1", 0], 0.80, [float("nan"), 0.0, 0.0, 0.0])
    finish(runs["A", "c1", 1], 0.84, [float("nan"), 0.0, 0.0, 0.0])
    finish(runs["B", "c1", 0], 0.85, [float("nan"), 0.4, 0.6, 0.8])  # ANME mean 0.6
    finish(runs["B", "c1", 1], 0.86, [float("nan"), 0.5, 0.5, 0.5])  # ANME mean 0.5
    finish(runs["A", "c2", 0], 0.70)
    finish(runs["A", "c2", 1], 0.74)
    finish(runs["B", "c2", 0], 0.75)
    finish(runs["B", "c2", 1], 0.99, summary=False)  # interrupted: not counted
    finish(runs["C", "c2", 0], 0.90)  # best number, but 2 rounds instead of 3
    finish(runs["Ref", None, 0], 0.90)
    finish(runs["Ref", None, 1], 0.92)


def table_rows(text: str, header: str) -> dict[str, list[str]]:
    """Rows of the Markdown table after ``## header``: label -> cells."""
    lines = text.split(f"## {header}\n", 1)[1].strip().splitlines()
    while lines and not lines[0].startswith("|"):  # a paragraph before the table
        lines.pop(0)
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data.endswith(b"IEND\xaeB`\x82"), f"{path} is truncated"
    return width, height


@pytest.fixture
def report(tmp_path: Path) -> tuple[Suite, Any]:
    suite = make_suite(tmp_path)
    populate(suite)
    return suite, write_report(suite)


def test_table_cells_are_mean_and_sample_std_over_seeds(report: tuple[Suite, Any]) -> None:
    _, files = report
    text = files.table.read_text()
    main = table_rows(text, "t: final test accuracy (%)")
    # A/c1: mean(80, 84) = 82, stdev = sqrt(((80-82)² + (84-82)²) / 1) = sqrt(8) = 2.828
    # B/c1: mean(85, 86) = 85.5, stdev = sqrt(0.5) = 0.707  -> best of c1
    # A/c2: 72 ± 2.83; B/c2: one finished seed (75) -> †, but best among 3-round cells;
    # C/c2: 90 but 2 rounds -> † and not bold; C/c1: no run
    assert main == {
        "A": ["82.00 ± 2.83", "72.00 ± 2.83"],
        "B": ["**85.50 ± 0.71**", "**75.00**†"],
        "C": ["—", "90.00†"],
    }
    extra = table_rows(text, "A against C")
    assert extra == {"A": ["**72.00 ± 2.83**"], "C": ["90.00†"]}
    ref = table_rows(text, "Reference (one setting for every column)")
    assert ref == {"Ref": ["91.00 ± 1.41"]}  # stdev(90, 92) = sqrt(2)
    assert "† Fewer seeds or other rounds than the main setting (3 rounds, 2 seeds): " \
           "B, c2: 1 seed; C, c2: 1 seed, 2 rounds." in text
    assert "10 of 11 runs finished" in text


def test_results_json_has_the_per_seed_numbers(report: tuple[Suite, Any]) -> None:
    _, files = report
    data = json.loads(files.results.read_text())
    cells = {(c["label"], c["column"]): c for c in data["cells"]}
    b1 = cells["B", "c1"]
    assert b1["final-test-accuracy"] == pytest.approx([85.0, 86.0])
    assert b1["mean"] == pytest.approx(85.5)
    assert b1["std"] == pytest.approx(0.5**0.5)
    assert b1["anme-mean"] == pytest.approx([0.6, 0.5])  # rounds 1..3, round 0 left out
    assert b1["wall-s"] == [12.5, 12.5] and not b1["marked"]
    b2 = cells["B", "c2"]
    assert b2["seeds-planned"] == [0, 1] and b2["seeds-finished"] == [0]
    assert b2["std"] is None and b2["marked"] and b2["note"] == "1 seed"
    assert cells["Ref", None]["reference"] is True
    assert data["main-setting"] == {"num-server-rounds": 3, "seeds": [0, 1]}
    assert (data["runs-finished"], data["runs-total"]) == (10, 11)


def test_plots_are_png_with_one_panel_per_column(report: tuple[Suite, Any]) -> None:
    _, files = report
    # figure sizes in inches × 120 dpi: accuracy 4.8 per column × 6 (legends below the panels);
    # anme max(6, 2.4·2+2) × 4.2
    assert png_size(files.accuracy_plot) == (1152, 720)
    assert png_size(files.anme_plot) == (816, 504)


def test_report_of_a_suite_without_finished_runs(tmp_path: Path) -> None:
    suite = make_suite(tmp_path)
    files = write_report(suite)
    main = table_rows(files.table.read_text(), "t: final test accuracy (%)")
    assert main == {"A": ["—", "—"], "B": ["—", "—"], "C": ["—", "—"]}
    assert "†" not in files.table.read_text()
    png_size(files.accuracy_plot)
    png_size(files.anme_plot)


def test_stale_runs_are_left_out(tmp_path: Path) -> None:
    suite = make_suite(tmp_path)
    populate(suite)
    spec = suite.cell("A", "c1")[0]
    config = json.loads((spec.directory / "config.json").read_text())
    config["config"]["lr"] = 0.5
    (spec.directory / "config.json").write_text(json.dumps(config))
    files = write_report(suite)
    main = table_rows(files.table.read_text(), "t: final test accuracy (%)")
    assert main["A"][0] == "84.00†"


def test_missing_matplotlib_is_a_clear_error(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    suite = make_suite(tmp_path)
    populate(suite)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ModuleNotFoundError,
                       match=r"report's plots need matplotlib.*pip install 'fedshard\[plots\]'"):
        write_report(suite)
    # the table and the numbers do not need it and were written first
    assert (suite.results_dir / "table.md").is_file()
    assert (suite.results_dir / "results.json").is_file()


def test_per_run_table_and_paired_differences(report: tuple[Suite, Any]) -> None:
    _, files = report
    text = files.table.read_text()
    lines = text.split("## Per run\n", 1)[1].split("\n## ", 1)[0].strip().splitlines()
    rows = {}
    for line in lines[3:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0], cells[1], cells[2]] = cells[3:]
    # A/c1 seed 0: accuracy 10 + 70·r/3 at rounds 1..3 -> 33.33, 56.67, 80 -> mean 56.67
    assert rows["A", "c1", "0"] == ["3", "80.00", "56.67 (1–3)", "80.00", "—"]
    # B/c1 seed 0: 35, 60, 85 -> mean 60; final 85 − A's 80 on seed 0
    assert rows["B", "c1", "0"] == ["3", "85.00", "60.00 (1–3)", "85.00", "+5.00"]
    assert rows["B", "c1", "1"][-1] == "+2.00"  # 86 − 84
    assert rows["C", "c2", "0"][-1] == "—"  # 2 rounds: not paired with A's 3-round runs
    assert rows["Ref", "(reference)", "1"][:2] == ["3", "92.00"]
    assert ("B", "c2", "1") not in rows  # unfinished
    paired = table_rows(text, "Paired difference to A (final accuracy, points)")
    assert paired == {"B": ["+3.50 [2]", "+5.00 [1]"], "C": ["—", "—"]}
    data = json.loads(files.results.read_text())
    a1 = next(c for c in data["cells"] if (c["label"], c["column"]) == ("A", "c1"))
    assert a1["last-5-mean"] == pytest.approx([170 / 3, 10 + 74 * 2 / 3])


def test_plot_colours_give_ten_labels_ten_distinct_hues() -> None:
    """With more than ten labels the first ten still get the ten tab10 hues (a paper table has
    eleven rows); taking tab20 in its own order gave Unbiased and Collective two reds."""
    matplotlib = pytest.importorskip("matplotlib")
    from fedshard_lab.experiments.plots import _colors

    labels = [f"row {i}" for i in range(11)]
    colours = _colors(labels)
    tab10 = {tuple(c) for c in matplotlib.colormaps["tab10"].colors}
    first_ten = {tuple(colours[lb][:3]) for lb in labels[:10]}
    assert first_ten == tab10
    assert tuple(colours["row 10"][:3]) not in tab10


def test_a_column_without_main_setting_cells_bolds_its_best(tmp_path: Path) -> None:
    """Suites mid-way (or by design) may have columns whose cells all ran fewer rounds: the
    best of those is bold, and the footnote says so."""
    suite = make_suite(tmp_path)
    runs = {(r.label, r.column, r.seed): r for r in suite.runs}
    finish(runs["C", "c2", 0], 0.60)  # the only cell of the "A against C" table's column
    text = write_report(suite).table.read_text()
    table = text.split("## A against C")[1].split("##")[0]
    assert "| C | **60.00**† |" in table
    assert "in a column without such cells, among all of its cells" in text


@pytest.mark.parametrize("build", ["_accuracy_figure", "_anme_figure"])
def test_plot_legends_lie_outside_the_data(tmp_path: Path, build: str) -> None:
    """With a paper-sized table (11 rows) a legend inside the axes hides curves or bars; every
    legend must sit outside every panel's plotting area."""
    from fedshard_lab.experiments import plots as plot_module
    from fedshard_lab.experiments import report as report_module

    suite = make_suite(tmp_path)
    populate(suite)
    fig = getattr(plot_module, build)(suite, report_module.collect(suite))
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)  # the constrained layout places the legends at draw time
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends, "no legend drawn"
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), (build, ax.get_title())
