"""RunConfig parsing/validation, the keep-ratio mixture and the cosine schedule."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; tomli comes with flwr
    import tomli as tomllib

from fedshard import LocalTraining, NodePolicy, ReplyPolicy, Sharding, robust_defaults
from fedshard.app.config import ConfigError, KeepRatioMixture, RunConfig
from fedshard.server.schedule import cosine_lr

ROOT = Path(__file__).resolve().parents[2]


def pyproject_defaults() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def test_pyproject_defaults_are_a_valid_config_with_every_key() -> None:
    defaults = pyproject_defaults()
    cfg = RunConfig.from_mapping(defaults)
    assert set(cfg.as_dict()) == set(defaults), "pyproject and RunConfig keys must match"


def test_every_run_config_key_is_documented_in_the_configuration_page() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = [k for k in pyproject_defaults() if f"| `{k}` |" not in page]
    assert not missing, f"undocumented run-config keys: {missing}"


def test_all_problems_reported_at_once() -> None:
    bad = {"keep-ratios": "0.2:0.5,1.5:0.5", "lr": 0.0, "method": "magic", "design": "srs",
           "fraction-train": 1.5, "clip-lr-tau": 0.5, "model": "vgg", "dataset": "imagenet",
           "num-server-rounds": 0, "batch-size": "big", "no-such-key": 1}
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping(bad)
    text = str(info.value)
    for needle in ("ratio 1.5 is outside (0, 1]", "lr=0.0", "method='magic'", "design='srs'",
                   "fraction-train=1.5", "clip-lr-tau=0.5", "model='vgg'", "dataset='imagenet'",
                   "num-server-rounds=0", "batch-size='big'", "unknown key 'no-such-key'",
                   "no round was started"):
        assert needle in text, needle
    assert len(info.value.problems) == len(bad)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [({"keep-ratios": "0.2:0.5,0.4:0.4"}, "shares sum to 0.9"),
     ({"keep-ratios": "0:1"}, r"ratio 0.0 is outside \(0, 1\]"),
     ({"keep-ratios": "0.2,0.4"}, "has no share"),
     ({"keep-ratios": "a:b"}, "cannot read 'a:b'"),
     ({"lr": -1.0}, "lr=-1.0: expected a finite number ≥ 1.2e-38"),
     ({"fraction-train": 0.0}, r"fraction-train=0.0: expected in \(0, 1\]"),
     ({"method": "unbiased", "scaled": True}, "scaled=true with method='unbiased'"),
     ({"momentum": 1.0}, "momentum=1.0"),
     ({"dirichlet-alpha": -1.0}, "dirichlet-alpha=-1.0"),
     ({"scaled": "yes"}, "scaled='yes': expected bool"),
     ({"method": "anneal-collective", "scaled": True},
      "scaled=true with method='anneal-collective'"),
     ({"anneal-exponent": 0.5}, r"anneal-exponent=0.5: expected γ₀ ≥ 1"),
     ({"anneal-rounds": 0}, "anneal-rounds=0: expected T ≥ 1"),
     ({"clip-lr-tau": 0.5, "clip-lr": False}, "clip-lr-tau=0.5: expected τ ≥ 1"),
     ({"max-num-examples": -1}, r"max-num-examples=-1: expected an integer in \[1, 2\*\*53\]"),
     ({"round-timeout": 0.0}, "round-timeout=0.0: expected > 0 seconds"),
     ({"prism-exponent": -1.0}, "prism-exponent=-1.0: expected k > 0"),
     ({"trim-fraction": 0.5}, r"trim-fraction=0.5: expected in \[0, 0.5\)"),
     ({"init-keep-ratio": 0.0}, r"init-keep-ratio=0.0: expected in \(0, 1\]"),
     ({"init-keep-ratio": 1.5}, r"init-keep-ratio=1.5: expected in \(0, 1\]"),
     ({"fedavg-cosine": 1}, "fedavg-cosine=1: expected bool")],
)
def test_single_problems(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_mapping(overrides)


def test_mixture_assignment_is_deterministic_and_matches_shares() -> None:
    mix = KeepRatioMixture.parse("0.2:0.6,0.4:0.4")
    got = [mix.ratio_for(i, 10) for i in range(10)]
    assert got.count(0.2) == 6 and got.count(0.4) == 4
    assert got == [mix.ratio_for(i, 10) for i in range(10)]
    # largest-remainder rounding keeps the total for awkward sizes
    assert sum(KeepRatioMixture.parse("0.1:0.33,0.2:0.33,0.3:0.34").counts(7)) == 7
    assert KeepRatioMixture.parse("0.3").ratio_for(4, 5) == 0.3
    with pytest.raises(ValueError, match="partition-id=5 is outside"):
        mix.ratio_for(5, 5)


def test_cosine_schedule() -> None:
    assert cosine_lr(0.1, 1, 10) == pytest.approx(0.1)
    assert cosine_lr(0.1, 6, 10) == pytest.approx(0.05)
    vals = [cosine_lr(0.1, r, 10) for r in range(1, 11)]
    assert all(a > b for a, b in itertools.pairwise(vals)) and vals[-1] > 0
    assert vals[-1] == pytest.approx(0.05 * (1 + math.cos(math.pi * 9 / 10)))
    with pytest.raises(ValueError, match="server_round=11"):
        cosine_lr(0.1, 11, 10)


def test_one_problem_per_bad_setting() -> None:
    """round-timeout sets both of NodePolicy's timeouts: one problem, named by its key."""
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping({"round-timeout": -1.0})
    assert info.value.problems == ["round-timeout=-1.0: expected > 0 seconds"]


def test_settings_objects_are_built_from_the_run_config(tmp_path: Path) -> None:
    table = tmp_path / "table.toml"
    table.write_text('"node-0" = 0.5\n')
    cfg = RunConfig.from_mapping({
        "method": "top-n", "scaled": True, "prism-exponent": 0.0, "lr": 0.02,
        "clip-lr": False, "max-num-examples": 0, "aggregation": "median",
        "keep-ratio-table": str(table), "round-timeout": 30.0})
    assert cfg.sharding == Sharding(method="top-n", design="cps", scaled=True)
    assert cfg.sharding.prism_exponent is None  # 0: the paper's default
    assert cfg.training == LocalTraining(lr=0.02, clip_lr_tau=None)
    # the app's defaults are the robust preset; the run config's keys over it
    assert cfg.replies == robust_defaults(max_num_examples=None, aggregation="median")
    assert cfg.node_policy() == NodePolicy(keep_ratio_table={"node-0": 0.5},
                                           query_timeout=30.0, node_wait_timeout=30.0)
    assert RunConfig().training.clip_lr_tau == 10.0
    # and back: the flat run config of these objects gives them again
    assert RunConfig.from_mapping(cfg.as_dict()) == cfg


def test_pyprojects_run_config_is_the_settings_defaults() -> None:
    """pyproject's [tool.flwr.app.config] lists every run-config key with the default its
    setting declares (fedshard.settings, FastOptions, RunConfig), value and type."""
    import tomllib

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    defaults = RunConfig().as_dict()
    assert sorted(listed) == sorted(defaults)
    assert {k: (v, type(v)) for k, v in listed.items()} == {
        k: (v, type(v)) for k, v in defaults.items()}


def test_no_setting_is_declared_twice() -> None:
    """Each setting is one field of one class: the settings objects, the fast options, the
    run config's own keys, the trainer's node options and the wire's per-round fields share
    no field name (a second declaration would be a second default and a second rule)."""
    import inspect
    from dataclasses import fields

    from fedshard.client.train import TrainConfig
    from fedshard.client.train.fast import FastOptions
    from fedshard.protocol import TrainSettings

    owners: dict[str, list[str]] = {}
    # the fields that hold a settings object (RunConfig.training, TrainConfig.recipe, ...)
    holders = {"sharding", "training", "replies", "nodes", "fast", "recipe"}
    for kind in (Sharding, LocalTraining, ReplyPolicy, NodePolicy, FastOptions, RunConfig,
                 TrainConfig, TrainSettings):
        own = set(inspect.get_annotations(kind))  # declared in this class
        for f in fields(kind):
            if f.name in own and f.name not in holders:
                owners.setdefault(f.name, []).append(kind.__name__)
    twice = {name: kinds for name, kinds in owners.items() if len(kinds) > 1}
    assert twice == {}


def test_results_path_is_absolute(tmp_path: Path) -> None:
    cfg = RunConfig(results_dir=str(tmp_path), run_name="x")
    assert cfg.results_path == tmp_path / "x"
    assert RunConfig().results_path.is_absolute()


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "cuda:", "CPU"])
def test_bad_device_is_rejected(value: str) -> None:
    with pytest.raises(ConfigError, match=rf"client-device='{value}': expected 'auto', 'cpu'"):
        RunConfig.from_mapping({"client-device": value})


def test_devices_default_to_auto() -> None:
    cfg = RunConfig.from_mapping({"server-device": "cuda:1"})
    assert cfg.client_device == "auto" and cfg.server_device == "cuda:1"
