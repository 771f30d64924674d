"""Suite files: parsing, validation (every problem at once), and the repository's suites."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from fedshard.app.config import RunConfig
from fedshard_lab.experiments import SuiteError, load_suite, parse_suite, run_name
from fedshard_lab.experiments.suite import RunSpec, app_defaults

ROOT = Path(__file__).resolve().parents[2]


def suite_data(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "suite": {"name": "t", "results-dir": "results/t", "num-supernodes": 4, "seeds": [0, 1]},
        "defaults": {"model": "mlp", "num-server-rounds": 3, "min-available-nodes": 4},
        "runs": [
            {"label": "Top-n", "column": "r = 0.1", "method": "top-n", "keep-ratios": "0.1"},
            {"label": "Collective", "column": "r = 0.1", "method": "collective",
             "keep-ratios": "0.1", "seeds": [5]},
            {"label": "r = 1", "method": "top-n", "keep-ratios": "1.0",
             "num-server-rounds": 2},
        ],
    }
    data.update(changes)
    return data


def parse(data: dict[str, Any], tmp_path: Path | None = None) -> Any:
    return parse_suite(data, app_dir=ROOT, source="test.toml",
                       results_dir=None if tmp_path is None else tmp_path / "res")


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(SuiteError) as info:
        parse(data)
    return info.value.problems


def test_runs_are_entries_times_seeds_in_file_order() -> None:
    suite = parse(suite_data())
    assert [(r.label, r.column, r.seed) for r in suite.runs] == [
        ("Top-n", "r = 0.1", 0), ("Top-n", "r = 0.1", 1), ("Collective", "r = 0.1", 5),
        ("r = 1", None, 0), ("r = 1", None, 1),
    ]
    assert [r.index for r in suite.runs] == [0, 1, 2, 3, 4]
    assert [r.name for r in suite.runs] == [
        "top-n__r-0-1__seed0", "top-n__r-0-1__seed1", "collective__r-0-1__seed5",
        "r-1__seed0", "r-1__seed1",
    ]
    # relative results-dir is taken from the app directory, not the working directory
    assert suite.results_dir == ROOT / "results" / "t"
    assert suite.runs[0].directory == ROOT / "results" / "t" / "top-n__r-0-1__seed0"
    assert suite.main_rounds == 3 and suite.seeds == (0, 1)
    assert suite.reference_rows == ("r = 1",)
    assert suite.tables[0].rows == ("Top-n", "Collective")
    assert suite.tables[0].columns == ("r = 0.1",)


def test_run_config_is_defaults_then_entry_then_runner_keys(tmp_path: Path) -> None:
    suite = parse(suite_data(), tmp_path)
    run = suite.runs[1]
    assert run.run_config == {
        "model": "mlp", "num-server-rounds": 3, "min-available-nodes": 4,
        "method": "top-n", "keep-ratios": "0.1",
        "seed": 1, "results-dir": str(tmp_path / "res"), "run-name": "top-n__r-0-1__seed1",
        "num-partitions": 4,
    }
    # the entry overrides [defaults]; the full config starts from pyproject's app defaults
    ref = suite.runs[3]
    assert ref.num_rounds == 2 and ref.config.keep_ratios == "1.0"
    app = app_defaults(ROOT)
    assert app["lr"] == 0.05 and "lr" not in ref.run_config  # from pyproject.toml
    assert ref.config == RunConfig.from_mapping({**app, **ref.run_config})
    assert ref.config.results_path == tmp_path / "res" / "r-1__seed0"


def test_run_name_is_a_slug_of_label_column_and_seed() -> None:
    assert run_name("PriSM + Wallenius + ClipLR", "60 % r = 0.2 / 40 % r = 0.4", 1) == (
        "prism-wallenius-cliplr__60-r-0-2-40-r-0-4__seed1")
    assert run_name("No sharding", None, 0) == "no-sharding__seed0"


def test_unknown_run_config_key_is_reported() -> None:
    data = suite_data()
    data["runs"][0]["learning-rate"] = 0.1
    (msg,) = problems(data)
    assert re.search(r"runs\[0\] \(Top-n / r = 0.1\): unknown key 'learning-rate'", msg)


def test_bad_values_and_types_are_all_reported_at_once() -> None:
    data = suite_data()
    data["runs"][0]["method"] = "topn"
    data["runs"][1]["lr"] = "fast"
    data["defaults"]["local-epochs"] = 0
    with pytest.raises(SuiteError, match=r"\(3 problem\(s\)\); no run was started") as info:
        parse(data)
    found = info.value.problems
    assert re.search(r"^\[defaults\] local-epochs=0: expected an integer ≥ 1", found[0])
    # the entries inherit local-epochs=0, but it is reported once, for [defaults]
    assert re.search(r"^runs\[0\] \(Top-n / r = 0.1\): method='topn': expected one of", found[1])
    assert re.search(r"^runs\[1\] \(Collective / r = 0.1\): lr='fast': expected float", found[2])


def test_duplicate_run_names_are_rejected() -> None:
    data = suite_data()
    data["runs"].append({"label": "top n", "column": "R = 0.1", "method": "top-n",
                         "keep-ratios": "0.1"})
    found = problems(data)
    assert len(found) == 2  # seeds 0 and 1
    assert re.search(r"runs\[3\] \(top n / R = 0.1\): run name 'top-n__r-0-1__seed0' \(seed 0\) "
                     r"is also the name of a run of runs\[0\]", found[0])


def test_duplicate_cell_is_rejected() -> None:
    data = suite_data()
    data["runs"].append({"label": "Top-n", "column": "r = 0.1", "method": "top-n",
                         "seeds": [7]})
    (msg,) = problems(data)
    assert re.search(r"row 'Top-n' and column 'r = 0.1' are already defined by runs\[0\]", msg)


def test_runner_keys_and_structure_errors() -> None:
    data = suite_data()
    data["defaults"]["seed"] = 3
    data["runs"][0]["results-dir"] = "/tmp/x"
    data["suite"]["seeds"] = [0, 0]
    data["suite"]["colour"] = "blue"
    data["suite"].pop("name")
    data["extra"] = {}
    found = "\n".join(problems(data))
    for pattern in [
        r"\[defaults\] sets 'seed': the runner sets num-partitions, results-dir, run-name, seed",
        r"runs\[0\] \(Top-n / r = 0.1\) sets 'results-dir'",
        r"\[suite\] seeds=\[0, 0\]: a seed is listed twice",
        r"\[suite\] unknown key 'colour'",
        r"\[suite\]: missing 'name' \(str\)",
        r"unknown table \[extra\]",
    ]:
        assert re.search(pattern, found), pattern


def test_min_available_nodes_above_supernodes_is_rejected() -> None:
    data = suite_data()
    data["runs"][1]["min-available-nodes"] = 10
    (msg,) = problems(data)
    assert re.search(r"runs\[1\] \(Collective / r = 0.1\): min-available-nodes=10 exceeds "
                     r"num-supernodes=4", msg)


def test_tables_must_name_existing_rows_and_columns() -> None:
    data = suite_data(tables=[{"title": "x", "rows": ["Top-n", "Unbiased"],
                               "columns": ["r = 0.2"]}])
    data["suite"]["rows"] = ["Collective", "r = 1"]
    found = "\n".join(problems(data))
    assert re.search(r"tables\[0\] rows names 'Unbiased', which no \[\[runs\]\] or "
                     r"\[\[compare\]\] entry", found)
    assert re.search(r"tables\[0\] columns names 'r = 0.2'", found)
    assert re.search(r"\[suite\] rows names 'r = 1'", found)  # a reference row has no column


def test_invalid_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[suite\nname = 1\n")
    with pytest.raises(SuiteError, match=r"(?s)bad.toml .*not valid TOML: Expected ']'"):
        load_suite(path, app_dir=ROOT)


# ---------------------------------------------------------------------- the repository's suites
def test_smoke_suite_is_valid() -> None:
    suite = load_suite(ROOT / "experiments" / "smoke.toml")
    assert suite.app_dir == ROOT
    assert len(suite.runs) == 2
    assert {r.config.sharding.method for r in suite.runs} == {"top-n", "collective"}
    assert all(r.config.model == "mlp" and r.num_rounds == 2 for r in suite.runs)


def test_fmnist_table_suite_holds_the_papers_rows_columns_and_setup() -> None:
    suite = load_suite(ROOT / "experiments" / "fmnist-table.toml")
    paper_rows = ("Top-n", "Top-n + Scaled", "PriSM", "PriSM + Scaled", "PriSM + Wallenius",
                  "PriSM + Wallenius + ClipLR", "Unbiased", "Collective")
    columns = ("r = 0.1", "r = 0.2", "60 % r = 0.2 / 40 % r = 0.4")
    main = suite.tables[0]
    assert main.rows == paper_rows and main.columns == columns
    assert set(suite.reference_rows) == {"r = 1", "No sharding"}
    for label in paper_rows:
        for column in columns:
            assert suite.cell(label, column), (label, column)
    for column in ("r = 0.1", "r = 0.2"):
        assert suite.cell("Unbiased w/o ClipLR", column)
    # the priority cells come first, with 100 rounds and 2 seeds
    priority = {("Top-n", "r = 0.1"), ("PriSM", "r = 0.1"),
                ("PriSM + Wallenius + ClipLR", "r = 0.1"), ("Unbiased", "r = 0.1"),
                ("Collective", "r = 0.1"), ("r = 1", None)}
    first = suite.runs[: 2 * len(priority)]
    assert {(r.label, r.column) for r in first} == priority
    assert all(r.num_rounds >= 100 and r.config.model == "resnet18" for r in first)
    assert all(len(suite.cell(r.label, r.column)) == 2 for r in first)
    # setup of section 2
    cfg = first[0].config
    assert (suite.num_supernodes, cfg.fraction_train, cfg.dirichlet_alpha,
            cfg.training.local_epochs, cfg.dataset) == (100, 0.1, 1.0, 2, "fashion-mnist")
    # ClipLR only where the paper uses it; +Scaled only on Top-n and PriSM rows
    for r in suite.runs:
        clip_lr = r.config.training.clip_lr_tau is not None
        assert clip_lr == (r.label in ("PriSM + Wallenius + ClipLR", "Unbiased",
                                       "Collective")), r.name
        assert r.config.sharding.scaled == r.label.endswith("+ Scaled"), r.name
    # the budget arithmetic stated in the file's comments: ≤ 8 h
    def per_round(r: RunSpec) -> float:
        if r.config.sharding.method == "none":
            return 12.0
        if r.config.keep_ratios == "1.0":
            return 14.5
        return 9.8 if r.config.keep_ratios == "0.1" else 10.5

    seconds = sum(r.num_rounds * per_round(r) + 15 for r in suite.runs)
    assert seconds == pytest.approx(27_680) and seconds <= 8 * 3600
    # the r = 0.1 cells all run 100 rounds, so every row pairs with Top-n's seed 0
    assert all(r.num_rounds == 100 for r in suite.runs if r.column in (None, "r = 0.1"))


def test_client_gpu_share_is_read_and_checked() -> None:
    assert parse(suite_data()).client_num_gpus == 0.0
    data = suite_data()
    data["suite"]["client-num-gpus"] = 0.25
    assert parse(data).client_num_gpus == 0.25
    data["suite"]["client-num-gpus"] = -1
    assert any("client-num-gpus=-1.0: expected ≥ 0" in p for p in problems(data))


def test_beyond_suites_share_the_tables_setup_and_state_their_runs() -> None:
    """The beyond-the-paper suites: the table's defaults at r = 0.1, 100 rounds and seeds 0
    and 1 for the main rows, 30 rounds of seed 0 with fedavg-cosine for four strategies (3 in
    the pilot)."""
    suite = load_suite(ROOT / "experiments" / "beyond.toml")
    table = load_suite(ROOT / "experiments" / "fmnist-table.toml")
    shared = ("dataset", "model", "model-width", "fraction-train", "min-available-nodes",
              "dirichlet-alpha", "local-epochs", "batch-size", "lr", "momentum",
              "frobenius-decay", "num-partitions")
    ref = table.cell("Top-n", "r = 0.1")[0].config.as_dict()
    main = [r for r in suite.runs if r.column == "r = 0.1"]
    assert {r.label for r in main} >= {"Top-n", "Collective", "Top-n, low-rank start",
                                       "Anneal-Collective"}
    for run in main:
        cfg = run.config.as_dict()
        assert {k: cfg[k] for k in shared} == {k: ref[k] for k in shared}, run.label
        assert run.num_rounds == 100 and cfg["keep-ratios"] == "0.1" and cfg["diagnostics"]
    assert {r.seed for r in main} == {0, 1}
    cosine = [r for r in suite.runs if r.config.sharding.fedavg_cosine]
    methods = {"top-n", "collective", "unbiased", "prism"}
    assert {r.config.sharding.method for r in cosine} == methods
    assert all(r.num_rounds == 30 and r.seed == 0 for r in cosine)
    pilot = load_suite(ROOT / "experiments" / "beyond-pilot.toml")
    assert {r.config.sharding.method for r in pilot.runs} == methods
    assert all(r.config.sharding.fedavg_cosine and r.num_rounds == 3 for r in pilot.runs)


def test_width_suites_compare_both_families_on_one_setup() -> None:
    """width-table: every row at every budget, two seeds, 100 rounds, one training recipe for
    spectral and width rows; width-resnet: its width rows share the compared fmnist-table
    and beyond cells' setup; width-cifar10 is the same table at the paper's scale."""
    shared = ("dataset", "model", "model-width", "fraction-train", "min-available-nodes",
              "dirichlet-alpha", "local-epochs", "batch-size", "lr", "momentum",
              "num-partitions", "num-server-rounds", "max-update-spread", "max-weight-ratio",
              "align-factors")
    suite = load_suite(ROOT / "experiments" / "width-table.toml")
    runs = [r for r in suite.runs if r.column is not None]
    assert {(r.label, r.column) for r in runs} == {
        (row, col) for row in suite.tables[0].rows for col in suite.tables[0].columns}
    assert len(suite.tables[0].rows) == 6 and len(suite.tables[0].columns) == 3
    first = runs[0].config.as_dict()
    for run in suite.runs:
        cfg = run.config.as_dict()
        assert {k: cfg[k] for k in shared} == {k: first[k] for k in shared}, run.label
        assert run.num_rounds == 100
        if cfg["method"] in ("heterofl", "fedrolex", "ordered-dropout"):
            assert cfg["width-match"] == "flops" and not cfg["od-distill"]
    assert {r.seed for r in suite.runs} == {0, 1}
    resnet = load_suite(ROOT / "experiments" / "width-resnet.toml")
    ref = resnet.comparisons[0].runs[0].config.as_dict()
    for run in resnet.runs:
        cfg = run.config.as_dict()
        assert {k: cfg[k] for k in shared} == {k: ref[k] for k in shared}, run.label
        assert cfg["keep-ratios"] == "0.1" and cfg["method"] in ("heterofl", "fedrolex",
                                                                 "ordered-dropout")
    assert [c.label for c in resnet.comparisons] == [
        "Collective [fmnist-table]", "Unbiased [fmnist-table]",
        "Top-n, low-rank start [beyond]", "No sharding [fmnist-table]"]
    cifar = load_suite(ROOT / "experiments" / "width-cifar10.toml")
    assert {r.config.dataset for r in cifar.runs} == {"cifar10"}
    assert {r.seed for r in cifar.runs} == {0, 1, 2} and len(cifar.runs) == 57


def test_shakespeare_reduced_is_the_papers_column_with_capped_steps() -> None:
    suite = load_suite(ROOT / "experiments" / "shakespeare-reduced.toml")
    assert {r.config.sharding.method for r in suite.runs} == {
        "top-n", "prism", "prism-wallenius", "unbiased", "collective", "none"}
    for run in suite.runs:
        cfg = run.config
        assert (cfg.dataset, cfg.model, cfg.training.batch_size, cfg.training.lr) == (
            "shakespeare", "chargpt", 10, 0.1)
        assert cfg.training.max_steps == 20 and cfg.num_partitions == 672


def test_the_shakespeare_pilots_small_model_has_the_r01_sub_models_flops() -> None:
    # The small GPT is the width (a multiple of its 3 heads) whose forward FLOPs are nearest
    # those of the whole GPT's spectral sub-model at r = 0.1, counted here from the models.
    import torch

    from fedshard.models import char_transformer
    from fedshard.spectral import sharded_layer_names
    from fedshard.spectral.budget import forward_flops, sharding_budget

    suite = load_suite(ROOT / "experiments" / "shakespeare-pilot.toml")
    widths = {r.label: r.config.model_width for r in suite.runs}
    assert widths == {"Whole model, every node": 48, "Small model": 21}
    assert {r.seed for r in suite.runs} == {0, 1}
    assert {r.config.sharding.method for r in suite.runs} == {"none"}
    whole = char_transformer(81, n_embd=48)
    x = torch.zeros(1, 80, dtype=torch.long)
    target = sharding_budget(whole, sharded_layer_names(whole), [0.1],
                             example_input=x).at(0.1).forward_flops
    nearest = min(range(3, 48, 3),
                  key=lambda w: abs(forward_flops(char_transformer(81, n_embd=w), x) - target))
    assert nearest == 21


def test_the_shakespeare_mixed_capacity_suite_is_the_pilots_setup_with_every_row() -> None:
    """Every row of the Shakespeare suite trains on the pilot's setup (so the pilot's regime
    holds for it), its small model is the pilot's, and column "a" has every row of the
    Fashion-MNIST suite's column "a"."""
    shared = ("dataset", "model", "min-available-nodes", "local-epochs", "max-steps",
              "batch-size", "lr", "momentum", "frobenius-decay", "lr-schedule",
              "num-server-rounds", "num-partitions", "test-max-examples", "max-update-spread",
              "max-weight-ratio", "align-factors")
    suite = load_suite(ROOT / "experiments" / "mixed-capacity-shakespeare.toml")
    pilot = load_suite(ROOT / "experiments" / "shakespeare-pilot.toml").runs[0].config.as_dict()
    for run in suite.runs:
        cfg = run.config.as_dict()
        assert {k: cfg[k] for k in shared} == {k: pilot[k] for k in shared}, run.label
        if cfg["method"] == "none" and run.label == "Small model":
            assert cfg["model-width"] == 21
        else:
            assert cfg["model-width"] == 48
    assert {r.seed for r in suite.runs} == {0, 1, 2}
    fmnist = load_suite(ROOT / "experiments" / "mixed-capacity.toml")
    col_a = "20 % r = 1 / 80 % r = 0.1"
    assert ({r.label for r in suite.runs if r.column in (col_a, None)}
            == {r.label for r in fmnist.runs if r.column in (col_a, None)})
    strong = next(r for r in suite.runs if r.label == "Strong devices only, 10 a round")
    assert int(134 * strong.config.fraction_train) == 10
