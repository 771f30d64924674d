"""Run configuration: one frozen, validated object built from Flower's ``run_config``.

The two apps read ``context.run_config`` once and call :meth:`RunConfig.from_mapping`; library
code never sees the raw mapping. Every problem is collected and reported in a single
:class:`ConfigError`, before any round starts.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from fedshard.client.keep_ratios import KeepRatioMixture  # re-exported: run-config `keep-ratios`
from fedshard.sampling import SAMPLING_DESIGNS, SHARDING_METHODS
from fedshard.server.nodes import load_keep_ratio_table
from fedshard.settings import (  # ProblemsError: re-exported
    LocalTraining,
    NodePolicy,
    ProblemsError,
    ReplyPolicy,
    SettingsError,
    Sharding,
)

__all__ = [
    "DESIGNS",
    "METHODS",
    "ConfigError",
    "KeepRatioMixture",
    "ProblemsError",
    "RunConfig",
    "default_results_dir",
]

METHODS = SHARDING_METHODS  # the run-config names are the library's (fedshard.sampling)
DESIGNS = SAMPLING_DESIGNS
MODELS = ("resnet18", "cct", "chargpt", "mlp", "lenet")
DATASETS = ("fashion-mnist", "cifar10", "cifar100", "tinyimagenet", "shakespeare")


class ConfigError(ProblemsError):
    """Raised when a run configuration is invalid; lists every problem at once."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("fedshard run configuration", problems, "no round was started")


def default_results_dir() -> Path:
    """``$XDG_CACHE_HOME/fedshard/runs`` (``~/.cache/fedshard/runs`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedshard" / "runs"


@dataclass(frozen=True)
class RunConfig:
    """Everything a fedshard run needs, validated (field names = run-config keys, kebab→snake)."""

    method: str = "collective"
    design: str = "cps"
    keep_ratios: str = "0.2:0.6,0.4:0.4"
    scaled: bool = False
    clip_lr: bool = True
    clip_lr_tau: float = 10.0
    prism_exponent: float = 0.0
    frobenius_decay: float = 1e-4
    weight_decay: float = 0.0
    lr: float = 0.05
    momentum: float = 0.9
    batch_size: int = 32
    local_epochs: int = 1
    num_server_rounds: int = 7
    fraction_train: float = 1.0
    fraction_evaluate: float = 0.0
    min_available_nodes: int = 2
    round_timeout: float = 600.0
    num_partitions: int = 10
    dirichlet_alpha: float = 0.0
    model: str = "mlp"
    model_width: int = 256
    dataset: str = "fashion-mnist"
    data_dir: str = ""
    download: bool = False
    test_max_examples: int = 0
    eval_every: int = 1
    seed: int = 0
    results_dir: str = ""
    run_name: str = ""
    resume: bool = False
    client_device: str = "auto"
    compile: bool = False
    cuda_graph: bool = False
    merge_terms: bool = False
    server_device: str = "auto"
    overwrite: bool = False
    max_update_ratio: float = 10.0
    update_policy: str = "clip"
    max_num_examples: int = 0
    aggregation: str = "mean"
    trim_fraction: float = 0.1
    max_keep_ratio: float = 1.0
    keep_ratio_table: str = ""
    lr_schedule: str = "cosine"
    factor_step: str = "plain"
    tensorboard: bool = False
    anneal_exponent: float = 8.0
    anneal_rounds: int = 30
    init_keep_ratio: float = 1.0
    diagnostics: bool = False
    fedavg_cosine: bool = False
    max_weight_ratio: float = 10.0
    trust_declared_keys: bool = False
    align_factors: bool = True
    max_update_spread: float = 5.0
    max_diverged_fraction: float = 0.5
    reference_run: str = ""

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ConfigError(problems)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_mapping(cls, run_config: Mapping[str, Any]) -> RunConfig:
        """Build from a Flower ``run_config`` (kebab-case keys); unknown keys are errors."""
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        problems: list[str] = []
        kwargs: dict[str, Any] = {}
        for key, value in run_config.items():
            field = known.get(key)
            if field is None:
                problems.append(f"unknown key {key!r}; known keys: {', '.join(sorted(known))}")
                continue
            default = field.default
            try:
                kwargs[field.name] = _coerce(value, type(default))
            except (TypeError, ValueError):
                problems.append(
                    f"{key}={value!r}: expected {type(default).__name__} "
                    f"(default {default!r})"
                )
        if problems:
            # Report type problems together with the value problems of what did parse.
            try:
                cls(**kwargs)
            except ConfigError as err:
                problems.extend(err.problems)
            raise ConfigError(problems)
        return cls(**kwargs)

    # ------------------------------------------------------------------ derived values
    @property
    def mixture(self) -> KeepRatioMixture:
        return KeepRatioMixture.parse(self.keep_ratios)

    @property
    def sharding(self) -> Sharding:
        """What is sharded and how (``prism-exponent = 0``: the paper's default, ``None``)."""
        return Sharding(method=self.method, design=self.design, scaled=self.scaled,
                        prism_exponent=self.prism_exponent or None,
                        anneal_exponent=self.anneal_exponent, anneal_rounds=self.anneal_rounds,
                        fedavg_cosine=self.fedavg_cosine)

    @property
    def training(self) -> LocalTraining:
        """The local-training recipe (``clip-lr = false``: ``clip_lr_tau=None``)."""
        recipe = self._recipe()
        return recipe if self.clip_lr else replace(recipe, clip_lr_tau=None)

    @property
    def replies(self) -> ReplyPolicy:
        """Reply bounds and the averaging rule (``max-num-examples = 0``: no cap, ``None``)."""
        return ReplyPolicy(max_update_ratio=self.max_update_ratio,
                           update_policy=self.update_policy,
                           max_num_examples=self.max_num_examples or None,
                           aggregation=self.aggregation, trim_fraction=self.trim_fraction,
                           max_weight_ratio=self.max_weight_ratio,
                           align_factors=self.align_factors,
                           max_update_spread=self.max_update_spread,
                           max_diverged_fraction=self.max_diverged_fraction)

    @property
    def nodes(self) -> NodePolicy:
        """The keep-ratio rules (the table read from ``keep-ratio-table``; a file that is no
        table raises ``ValueError``) and ``round-timeout`` for both waits."""
        table = load_keep_ratio_table(self.keep_ratio_table) if self.keep_ratio_table else None
        return self._node_policy(table)

    def _recipe(self) -> LocalTraining:
        return LocalTraining(lr=self.lr, lr_schedule=self.lr_schedule,
                             local_epochs=self.local_epochs, batch_size=self.batch_size,
                             momentum=self.momentum, frobenius_decay=self.frobenius_decay,
                             clip_lr_tau=self.clip_lr_tau, weight_decay=self.weight_decay,
                             factor_step=self.factor_step)

    def _node_policy(self, table: Mapping[str, float] | None) -> NodePolicy:
        return NodePolicy(max_keep_ratio=self.max_keep_ratio, keep_ratio_table=table,
                          query_timeout=self.round_timeout, node_wait_timeout=self.round_timeout,
                          trust_declared_keys=self.trust_declared_keys)

    @property
    def results_path(self) -> Path:
        """Absolute directory of this run's results."""
        base = Path(self.results_dir).expanduser() if self.results_dir else default_results_dir()
        name = self.run_name or (
            f"{self.dataset}-{self.model}{self.model_width}-{self.method}"
            f"{'-scaled' if self.scaled else ''}-{self.design}"
            f"-r{self.keep_ratios.replace(':', '_')}"
            f"-seed{self.seed}"
        )
        return (base / name).resolve()

    def as_dict(self) -> dict[str, Any]:
        """Kebab-case mapping of every field (what the run used)."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}

    # ------------------------------------------------------------------ validation
    def _problems(self) -> list[str]:
        p: list[str] = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                p.append(msg)

        p.extend(self._settings_problems())
        try:
            KeepRatioMixture.parse(self.keep_ratios)
        except ValueError as err:
            p.append(str(err))
        need(self.num_server_rounds >= 1,
             f"num-server-rounds={self.num_server_rounds}: expected ≥ 1")
        need(
            0 < self.fraction_train <= 1,
            f"fraction-train={self.fraction_train}: expected in (0, 1]",
        )
        need(
            0 <= self.fraction_evaluate <= 1,
            f"fraction-evaluate={self.fraction_evaluate}: expected in [0, 1]",
        )
        need(
            self.min_available_nodes >= 1,
            f"min-available-nodes={self.min_available_nodes}: expected ≥ 1",
        )
        need(self.num_partitions >= 1, f"num-partitions={self.num_partitions}: expected ≥ 1")
        need(
            math.isfinite(self.dirichlet_alpha) and self.dirichlet_alpha >= 0,
            f"dirichlet-alpha={self.dirichlet_alpha}: expected > 0, or 0 for the data set's "
            "paper value",
        )
        need(self.model in MODELS, f"model={self.model!r}: expected one of {MODELS}")
        need(self.model_width >= 1, f"model-width={self.model_width}: expected ≥ 1")
        if self.model_width >= 1 and self.model in WIDE_MODELS and self.dataset in DATASETS:
            p.extend(_model_size_problems(self))
        need(self.dataset in DATASETS, f"dataset={self.dataset!r}: expected one of {DATASETS}")
        if self.dataset in DATASETS and self.model in MODELS:
            text = self.dataset == "shakespeare"
            need(
                text == (self.model == "chargpt"),
                f"model={self.model!r} with dataset={self.dataset!r}: 'chargpt' is the model for "
                "'shakespeare' (next-character prediction), the others are image models",
            )
        need(self.test_max_examples >= 0,
             f"test-max-examples={self.test_max_examples}: expected ≥ 0 (0 = all)")
        need(self.eval_every >= 0, f"eval-every={self.eval_every}: expected ≥ 0 (0 = never)")
        need(self.seed >= 0, f"seed={self.seed}: expected a non-negative integer")
        for key in ("client_device", "server_device"):
            value = getattr(self, key)
            need(_is_device(value), f"{key.replace('_', '-')}={value!r}: expected 'auto', 'cpu', "
                 "'cuda' or 'cuda:<index>' ('auto': the GPU when torch sees one, else the CPU)")
        p.extend(self._location_problems())
        need(0 < self.init_keep_ratio <= 1,
             f"init-keep-ratio={self.init_keep_ratio}: expected in (0, 1] (1: full-rank start)")
        need(not self.keep_ratio_table or Path(self.keep_ratio_table).expanduser().is_file(),
             f"keep-ratio-table={self.keep_ratio_table!r}: no such file (expected a TOML file "
             "of '\"<node key>\" = <ratio>' lines, or empty for no table)")
        return p

    def _settings_problems(self) -> list[str]:
        """The problems of the settings objects, named by their run-config keys (each
        object checks its own fields: one rule per setting, in :mod:`fedshard.settings`)."""
        keys = {"query_timeout": "round_timeout", "node_wait_timeout": "round_timeout"}
        found: dict[str, str] = {}  # one problem per run-config key
        for build in (lambda: self.sharding, self._recipe, lambda: self.replies,
                      lambda: self._node_policy(None)):
            try:
                build()
            except SettingsError as err:
                for problem in err.found:
                    about = tuple((keys.get(k, k), v) for k, v in problem.about)
                    found.setdefault(" ".join(k for k, _ in about),
                                     replace(problem, about=about).render("run-config"))
        return list(found.values())

    def _location_problems(self) -> list[str]:
        """Problems of ``results-dir``, ``run-name``, ``resume`` and ``overwrite``."""
        p: list[str] = []
        if self.results_dir and not Path(self.results_dir).expanduser().is_absolute():
            p.append(
                f"results-dir={self.results_dir!r}: expected an absolute path (or ~/...); a "
                "relative one would be taken from wherever the ServerApp process runs"
            )
        seps = {"/", "\\", os.sep, *([os.altsep] if os.altsep else [])}
        if self.run_name and (
            any(s in self.run_name for s in seps) or ".." in self.run_name
            or self.run_name.startswith(".") or "\0" in self.run_name
        ):
            p.append(
                f"run-name={self.run_name!r}: expected a plain folder name (no path separator, "
                "no '..', not starting with '.'), so that the run stays a visible folder inside "
                "results-dir"
            )
        if self.resume and self.overwrite:
            p.append(
                "resume=true with overwrite=true: resume continues the run in its folder, "
                "overwrite deletes it; set one of them"
            )
        return p


#: The models whose size ``model-width`` sets (cct and chargpt have fixed sizes).
WIDE_MODELS = ("resnet18", "mlp")


@functools.lru_cache(maxsize=64)
def _parameter_count(model: str, width: int, dataset: str) -> int:
    """Parameters of ``model`` at ``width`` for ``dataset``, counted on the ``meta`` device
    (nothing is allocated, so any width can be counted); the same builders and arguments as
    :func:`fedshard.app.task.build_model`. 0 for a data set the model cannot take (refused
    by another rule)."""
    import torch

    from fedshard.data import dataset_info
    from fedshard.models import mlp, resnet18

    info = dataset_info(dataset)
    if info.task != "image":
        return 0
    with torch.device("meta"):
        net = (resnet18(num_classes=info.num_classes, in_channels=info.in_channels, width=width)
               if model == "resnet18" else
               mlp(info.in_channels * info.image_size**2, info.num_classes, width=width))
    return sum(p.numel() for p in net.parameters())


def _model_size_problems(cfg: RunConfig) -> list[str]:
    """A problem when ``cfg``'s model cannot fit in this machine's memory as float32 (the
    server also holds its SVD, and a simulated node a copy: this is a lower bound)."""
    params = _parameter_count(cfg.model, cfg.model_width, cfg.dataset)
    need = 4 * params
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not every system reports it
        return []
    if need <= memory:
        return []
    return [f"model-width={cfg.model_width}: the {cfg.model} model would have {params:,} "
            f"parameters ({need / 1e9:,.1f} GB as float32), more than this machine's "
            f"{memory / 1e9:,.1f} GB of memory; expected a width whose model fits (the run "
            "would fail allocating it before round 1)"]


def _is_device(value: str) -> bool:
    kind, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda"):
        return True
    return kind == "cuda" and index.isdecimal() and index.isascii()


def _coerce(value: Any, kind: type) -> Any:
    """Coerce a TOML value to the field's type (ints are accepted for floats, not vice versa)."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise TypeError(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise TypeError(value)
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(value)
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise TypeError(value)
        return value
    raise TypeError(kind)
