"""milestones.md and diagnostics.png from fake run folders: numbers against hand computation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from test_experiments_report import ROOT, png_size

from fedshard_lab.experiments import parse_suite, write_report
from fedshard_lab.experiments.diagnostics import metric_curves


def _suite(tmp_path: Path, rounds: int = 25) -> Any:
    data = {"suite": {"name": "d", "results-dir": str(tmp_path / "res"), "num-supernodes": 3,
                      "seeds": [0, 1]},
            "defaults": {"model": "mlp", "num-server-rounds": rounds, "min-available-nodes": 3},
            "runs": [{"label": "A", "column": "c", "method": "top-n"},
                     {"label": "B", "column": "c", "method": "collective"}]}
    return parse_suite(data, app_dir=ROOT, source="d.toml")


def _finish(spec: Any, acc: dict[int, float], extra: dict[str, dict[int, float]]) -> None:
    rows = []
    for r in range(spec.num_rounds + 1):
        row: dict[str, Any] = {"round": r}
        if r in acc:
            row["test-accuracy"] = acc[r]
        for metric, values in extra.items():
            if r in values:
                row[metric] = values[r]
        rows.append(row)
    spec.directory.mkdir(parents=True)
    (spec.directory / "config.json").write_text(json.dumps({"config": spec.config.as_dict()}))
    (spec.directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    last = max(acc)
    (spec.directory / "summary.json").write_text(json.dumps({
        "rounds-completed": spec.num_rounds, "final-test-accuracy": acc[last],
        "best-test-accuracy": max(acc.values()), "wall-s": 1.0}))


def test_milestones_and_diagnostics(tmp_path: Path) -> None:
    suite = _suite(tmp_path)
    runs = {(r.label, r.seed): r for r in suite.runs}
    every5 = [0, 5, 10, 15, 20, 25]
    # A: accuracy = round / 100 at every evaluation (rounds 0, 5, ..., 25)
    for seed in (0, 1):
        _finish(runs["A", seed], {r: r / 100 + seed / 100 for r in every5},
                {"untrained-energy": {r: 0.8 for r in range(1, 26)},
                 "test-accuracy-top-n": {r: 0.5 for r in every5}})
    _finish(runs["B", 0], {r: 0.3 for r in every5}, {})
    files = write_report(suite)
    text = files.milestones.read_text()
    per_run = {tuple(c.strip() for c in line.strip("|").split("|")[:3]): line
               for line in text.splitlines() if line.startswith("| A") or line.startswith("| B")}
    # A seed 1: round 10 -> 11 %, round 20 -> 21 %, last (r25) 26 %, last five = 6..26 step 5
    a1 = [c.strip() for c in per_run["A", "c", "1"].strip("|").split("|")]
    assert a1[3:] == ["11.00", "21.00", "26.00 (r25)", f"{(6 + 11 + 16 + 21 + 26) / 5:.2f}"]
    # the per-cell means: A over seeds 0 and 1 at round 10 = (10 + 11) / 2
    summary = next(line for line in text.split("Mean over the seeds", 1)[1].splitlines()
               if line.startswith("| A"))
    assert [c.strip() for c in summary.strip("|").split("|")][2:4] == ["2", "10.50"]
    b0 = [c.strip() for c in per_run["B", "c", "0"].strip("|").split("|")]
    assert b0[3:5] == ["30.00", "30.00"]
    assert files.diagnostics_plot is not None and png_size(files.diagnostics_plot)[0] > 400


def test_no_diagnostics_no_plot(tmp_path: Path) -> None:
    suite = _suite(tmp_path, rounds=3)
    for spec in suite.runs:
        _finish(spec, {0: 0.1, 3: 0.5}, {})
    files = write_report(suite)
    assert files.diagnostics_plot is None
    assert "| A | c | 0 | — | — | 50.00 (r3) | 50.00 |" in files.milestones.read_text()


def test_per_seed_plot_has_one_panel_per_seed_that_finished(tmp_path: Path) -> None:
    suite = _suite(tmp_path, rounds=3)
    assert write_report(suite).per_seed_plot is None  # nothing finished: no empty figure
    runs = {(r.label, r.seed): r for r in suite.runs}
    _finish(runs["A", 0], {0: 0.1, 3: 0.5}, {})
    one = png_size(write_report(suite, tmp_path / "one").per_seed_plot)  # type: ignore[arg-type]
    _finish(runs["B", 1], {0: 0.1, 3: 0.6}, {})
    two = png_size(write_report(suite, tmp_path / "two").per_seed_plot)  # type: ignore[arg-type]
    # 5.6 in per panel at 120 dpi: seeds {0} -> 1 panel, seeds {0, 1} -> 2 panels
    assert one[0] == round(5.6 * 120) and two[0] == round(2 * 5.6 * 120)


def test_fedavg_cosine_table_and_plot(tmp_path: Path) -> None:
    """Block means of the cosine metrics against hand computation; no cosine, no files."""
    suite = _suite(tmp_path)
    runs = {(r.label, r.seed): r for r in suite.runs}
    assert write_report(suite).cosine_table is None
    every5 = [0, 5, 10, 15, 20, 25]
    # A seed 0: cosine = round / 100 over all parameters, 0.5 on the sharded layers from round 3
    _finish(runs["A", 0], {r: 0.5 for r in every5},
            {"fedavg-cosine": {r: r / 100 for r in range(1, 26)},
             "fedavg-cosine-sharded": {r: 0.5 for r in range(3, 26)}})
    _finish(runs["B", 0], {r: 0.3 for r in every5}, {})  # no cosine: not in the table
    files = write_report(suite)
    assert files.cosine_table is not None and files.cosine_plot is not None
    assert png_size(files.cosine_plot)[0] > 400
    text = files.cosine_table.read_text()
    assert "| Strategy | Column | Seed | rounds 1–10 | rounds 11–20 | rounds 21–25 | all rounds |" \
        in text
    rows = [line for line in text.splitlines() if line.startswith("| A")]
    assert len(rows) == 2 and not any(line.startswith("| B") for line in text.splitlines())
    # rounds 1-10: mean 5.5 / 100; 11-20: 15.5 / 100; 21-25: 23 / 100; 1-25: 13 / 100
    assert rows[0] == "| A | c | 0 | 0.055 | 0.155 | 0.230 | 0.130 |"
    assert rows[1] == "| A | c | 0 | 0.500 | 0.500 | 0.500 | 0.500 |"


def test_metric_curves_skip_lines_they_cannot_place(tmp_path: Path) -> None:
    """A damaged metrics.jsonl (a torn line, a JSON list, a bad round, NaN) gives the curves of
    its good rows instead of raising (the report reads every run's file)."""
    lines = [
        '{"round": 5, "test-accuracy": 0.25, "anme": 0.5}',
        '{"round": 10, "test-acc',  # torn write
        '[1, 2, 3]',
        '{"round": "ten", "test-accuracy": 0.9}',
        '{"round": null, "test-accuracy": 0.9}',
        '{"round": 15, "test-accuracy": NaN, "anme": 0.4}',
        '{"round": 20, "test-accuracy": 0.5}',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    curves = metric_curves(tmp_path, ["test-accuracy", "anme", "absent"])
    assert curves == {"test-accuracy": [(5, 25.0), (20, 50.0)], "anme": [(5, 0.5), (15, 0.4)]}
