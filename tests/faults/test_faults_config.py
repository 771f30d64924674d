"""Where a run writes: results-dir must be absolute, run-name a plain folder, resume xor
overwrite."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedshard.app.config import ConfigError, RunConfig


@pytest.mark.parametrize("results_dir", ["results", "./runs", "../runs", "runs/sub"])
def test_a_relative_results_dir_is_refused(results_dir: str) -> None:
    with pytest.raises(ConfigError, match=(
        rf"results-dir='{results_dir}': expected an absolute path \(or ~/...\); a relative one "
        r"would be taken from wherever the ServerApp process runs"
    )):
        RunConfig.from_mapping({"results-dir": results_dir})


def test_absolute_and_home_results_dirs_are_accepted(tmp_path: Path) -> None:
    assert RunConfig(results_dir=str(tmp_path), run_name="r").results_path == tmp_path / "r"
    home = RunConfig(results_dir="~/runs", run_name="r").results_path
    assert home == (Path.home() / "runs" / "r").resolve()
    assert RunConfig().results_path.is_absolute()  # empty: the default root


@pytest.mark.parametrize("run_name", ["..", "../escape", "a/b", "/abs", "a\\b", ".hidden", ".",
                                      "x/../../y", "a..b"])
def test_a_run_name_that_escapes_or_hides_is_refused(tmp_path: Path, run_name: str) -> None:
    with pytest.raises(ConfigError, match=(
        r"run-name=.*: expected a plain folder name \(no path separator, no '\.\.', not "
        r"starting with '\.'\), so that the run stays a visible folder inside results-dir"
    )):
        RunConfig(results_dir=str(tmp_path), run_name=run_name)


@pytest.mark.parametrize("run_name", ["run", "top-n__r-0-1__seed0", "a.b", "exp 1", "r_0.2"])
def test_plain_run_names_stay_inside_results_dir(tmp_path: Path, run_name: str) -> None:
    path = RunConfig(results_dir=str(tmp_path), run_name=run_name).results_path
    assert path.parent == tmp_path.resolve() and path.name == run_name


def test_the_derived_run_name_is_a_plain_name() -> None:
    cfg = RunConfig.from_mapping({"keep-ratios": "0.2:0.6,0.4:0.4", "scaled": True,
                                  "method": "top-n"})
    assert cfg.results_path.parent == RunConfig().results_path.parent


def test_overwrite_is_a_key_defaulting_to_false() -> None:
    assert RunConfig().overwrite is False
    assert RunConfig.from_mapping({"overwrite": True}).overwrite is True
    with pytest.raises(ConfigError, match=r"overwrite='yes': expected bool \(default False\)"):
        RunConfig.from_mapping({"overwrite": "yes"})


def test_resume_and_overwrite_together_are_refused() -> None:
    with pytest.raises(ConfigError, match=(
        r"resume=true with overwrite=true: resume continues the run in its folder, overwrite "
        r"deletes it; set one of them"
    )):
        RunConfig.from_mapping({"resume": True, "overwrite": True})


def test_a_run_config_num_partitions_the_simulation_does_not_use_is_refused() -> None:
    from fedshard.app.config import RunConfig
    from fedshard.app.task import node_partition

    cfg = RunConfig.from_mapping({"num-partitions": 10})
    assert node_partition(cfg, {"partition-id": 3, "num-partitions": 10}) == (3, 10)
    with pytest.raises(ValueError, match=r"run config num-partitions=10, but this simulation "
                       r"has 100 nodes"):
        node_partition(cfg, {"partition-id": 3, "num-partitions": 100})
    # a deployed node (declares its own keys) may split its own data its own way
    assert node_partition(cfg, {"partition-id": 0, "num-partitions": 1,
                                "keep-ratio": 0.2}) == (0, 1)
