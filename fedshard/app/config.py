"""Run configuration: one frozen, validated object built from Flower's ``run_config``.

The two apps read ``context.run_config`` once and call :meth:`RunConfig.from_mapping`; library
code never sees the raw mapping. Every problem is collected and reported in a single
:class:`ConfigError`, before any round starts.

A run config is flat (``method = "top-n"``, ``lr = 0.05``, ...): its keys are the library's
settings, each declared once in :mod:`fedshard.settings` (and
:class:`fedshard.client.train.fast.FastOptions`) with its run-config key and how TOML writes its
``None``, plus the app's own keys declared here. :class:`RunConfig` holds the settings objects
(``cfg.sharding``, ``cfg.training``, ``cfg.replies``, ``cfg.nodes``, ``cfg.fast``) and the
app's fields; :meth:`RunConfig.as_dict` is the flat mapping again (what pyproject's
``[tool.flwr.app.config]`` lists, and what a checkpoint records).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from fedshard.client.keep_ratios import KeepRatioMixture  # re-exported: run-config `keep-ratios`
from fedshard.client.train.fast import FastOptions
from fedshard.sampling import SAMPLING_DESIGNS, SHARDING_METHODS
from fedshard.server.nodes import load_keep_ratio_table
from fedshard.settings import (  # ProblemsError: re-exported
    DEFAULT_LR,
    WIDTH_METHODS,
    LocalTraining,
    NodePolicy,
    Privacy,
    ProblemsError,
    ReplyPolicy,
    Settings,
    SettingsError,
    Sharding,
    Slicing,
    encoded_none,
    kebab,
    robust_defaults,
    rule_of,
    run_key,
    value_type,
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
WIDTH_MODELS = ("mlp", "resnet18", "chargpt")  # the models width slicing can narrow
DATASETS = ("fashion-mnist", "cifar10", "cifar100", "tinyimagenet", "shakespeare")


class ConfigError(ProblemsError):
    """Raised when a run configuration is invalid; lists every problem at once."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("fedshard run configuration", problems, "no round was started")


def default_results_dir() -> Path:
    """``$XDG_CACHE_HOME/fedshard/runs`` (``~/.cache/fedshard/runs`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedshard" / "runs"


def _run_training() -> LocalTraining:
    return LocalTraining(lr=DEFAULT_LR)  # a run config always names its lr


def _app(default: Any, key: str | None = None) -> Any:
    """One of the app's own run-config keys (``key``: when it is not the field's name)."""
    return field(default=default, metadata={"run": key or True})


@dataclass(frozen=True)
class RunConfig:
    """Everything a fedshard run needs, validated.

    The settings objects (:mod:`fedshard.settings`) hold the library's settings; the other
    fields are the app's own (model, data, rounds, where results go). Field names are the
    run-config keys in snake case, except ``keep_ratio_file`` (``keep-ratio-table``).
    """

    sharding: Sharding = field(default_factory=Sharding)
    training: LocalTraining = field(default_factory=_run_training)
    # the app's runs are robust by default (the library's ReplyPolicy() is the paper's mean)
    replies: ReplyPolicy = field(default_factory=robust_defaults)
    nodes: NodePolicy = field(default_factory=NodePolicy)  # the table: node_policy()
    slicing: Slicing = field(default_factory=Slicing)
    privacy: Privacy = field(default_factory=Privacy)
    fast: FastOptions = field(default_factory=FastOptions)
    keep_ratios: str = _app("0.1:0.6,0.2:0.4")
    num_server_rounds: int = _app(6)
    fraction_train: float = _app(1.0)
    fraction_evaluate: float = _app(0.0)
    min_available_nodes: int = _app(1)
    round_timeout: float = _app(600.0)
    num_partitions: int = _app(0)
    dirichlet_alpha: float = _app(0.0)
    model: str = _app("mlp")
    model_width: int = _app(896)
    dataset: str = _app("fashion-mnist")
    data_dir: str = _app("")
    download: bool = _app(True)
    test_max_examples: int = _app(0)
    eval_every: int = _app(1)
    seed: int = _app(0)
    results_dir: str = _app("")
    run_name: str = _app("")
    resume: bool = _app(False)
    client_device: str = _app("auto")
    server_device: str = _app("auto")
    overwrite: bool = _app(False)
    keep_ratio_file: str = _app("", "keep-ratio-table")
    tensorboard: bool = _app(False)
    init_keep_ratio: float = _app(1.0)
    diagnostics: bool = _app(False)
    eval_at_budgets: bool = _app(False)
    reference_run: str = _app("")
    trusted_data: int = _app(0)
    trusted_data_dir: str = _app("")

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ConfigError(problems)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_mapping(cls, run_config: Mapping[str, Any]) -> RunConfig:
        """Build from a Flower ``run_config`` (kebab-case keys); unknown keys are errors.

        Each key is routed to the setting that declares it (:func:`_keys`); a setting's
        object is built with the values given over its run-config default and checks itself.
        """
        keys = _keys()
        defaults = cls()
        problems: list[str] = []
        values: dict[str | None, dict[str, Any]] = {}
        switches: dict[tuple[str, str], bool] = {}
        for key, value in run_config.items():
            route = keys.get(key)
            if route is None:
                problems.append(f"unknown key {key!r}; known keys: {', '.join(sorted(keys))}")
                continue
            concern, f, kind, role = route
            default = _encode(defaults, concern, f)[key]
            try:
                value = _coerce(value, kind)
            except (TypeError, ValueError):
                problems.append(f"{key}={value!r}: expected {kind.__name__} "
                                f"(default {default!r})")
                continue
            if role == "switch":
                switches[(concern or "", f.name)] = value
                continue
            has_none, none = encoded_none(f, "run")
            values.setdefault(concern, {})[f.name] = None if has_none and value == none else value
        for (concern, name), on in switches.items():
            if on:
                continue
            given = values.setdefault(concern, {})
            if given.get(name) is not None:  # a value given for a setting switched off
                f = next(f for c, f in _settings_fields() if (c or "") == concern
                         and f.name == name)
                expected = f.metadata["rule"](given[name])
                if expected is not None:
                    problems.append(f"{run_key(f)}={given[name]!r}: {expected}")
            given[name] = None
        kwargs: dict[str, Any] = dict(values.pop(None, {}))
        for concern, given in values.items():
            assert concern is not None
            try:
                kwargs[concern] = replace(getattr(defaults, concern), **given)
            except SettingsError as err:
                problems.extend(_render(err, concern))
        if problems:
            # Report these together with the problems of the app's own values.
            try:
                cls(**{k: v for k, v in kwargs.items() if not _is_concern(k)})
            except ConfigError as err:
                problems.extend(err.problems)
            raise ConfigError(problems)
        return cls(**kwargs)

    def as_dict(self) -> dict[str, Any]:
        """The flat run-config mapping of this configuration (kebab-case keys, every key)."""
        out: dict[str, Any] = {}
        for concern, f in _settings_fields():
            out.update(_encode(self, concern, f))
        return out

    # ------------------------------------------------------------------ derived values
    @property
    def mixture(self) -> KeepRatioMixture:
        return KeepRatioMixture.parse(self.keep_ratios)

    def node_policy(self) -> NodePolicy:
        """:attr:`nodes` with the table read from ``keep-ratio-table`` (a file that is no
        table raises ``ValueError``) and ``round-timeout`` for both waits."""
        table = load_keep_ratio_table(self.keep_ratio_file) if self.keep_ratio_file else None
        return replace(self.nodes, keep_ratio_table=table, query_timeout=self.round_timeout,
                       node_wait_timeout=self.round_timeout)

    @property
    def results_path(self) -> Path:
        """Absolute directory of this run's results."""
        base = Path(self.results_dir).expanduser() if self.results_dir else default_results_dir()
        name = self.run_name or (
            f"{self.dataset}-{self.model}{self.model_width}-{self.sharding.method}"
            f"{'-scaled' if self.sharding.scaled else ''}-{self.sharding.design}"
            f"-r{self.keep_ratios.replace(':', '_')}"
            f"-seed{self.seed}"
        )
        return (base / name).resolve()

    # ------------------------------------------------------------------ validation
    def _problems(self) -> list[str]:
        p: list[str] = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                p.append(msg)

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
        timeout = rule_of(NodePolicy, "query_timeout")(self.round_timeout)  # both waits
        need(timeout is None, f"round-timeout={self.round_timeout}: {timeout}")
        need(
            self.min_available_nodes >= 1,
            f"min-available-nodes={self.min_available_nodes}: expected ≥ 1",
        )
        need(self.num_partitions >= 0,
             f"num-partitions={self.num_partitions}: expected ≥ 1, or 0 for one partition per "
             "simulated node (the simulation's node count)")
        need(
            math.isfinite(self.dirichlet_alpha) and self.dirichlet_alpha >= 0,
            f"dirichlet-alpha={self.dirichlet_alpha}: expected > 0, or 0 for the data set's "
            "paper value",
        )
        need(self.model in MODELS, f"model={self.model!r}: expected one of {MODELS}")
        need(self.model_width >= 1, f"model-width={self.model_width}: expected ≥ 1")
        if self.model == "chargpt":
            need(self.model_width % CHARGPT_HEADS == 0,
                 f"model-width={self.model_width}: the chargpt model's embedding width must be "
                 f"a multiple of its {CHARGPT_HEADS} attention heads; expected e.g. "
                 "model-width=48 (minGPT's gpt-nano, the paper's 3-block GPT); no model built")
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
        if self.sharding.method in WIDTH_METHODS:
            need(self.model in WIDTH_MODELS,
                 f"method={self.sharding.method!r} with model={self.model!r}: width slicing "
                 f"is defined here for {', '.join(WIDTH_MODELS)} (their width sets every "
                 "hidden layer); the CCT's tokenizer and LeNet's fixed layers have no width "
                 "family in fedshard")
            need(self.init_keep_ratio == 1,
                 f"init-keep-ratio={self.init_keep_ratio} with method="
                 f"{self.sharding.method!r}: the low-rank start truncates the SVD terms of "
                 "spectral sharding; width slicing starts from the full model (1)")
            need(not self.diagnostics,
                 f"diagnostics=true with method={self.sharding.method!r}: the diagnostics "
                 "measure spectral terms (untrained energy, the Top-n truncation); width "
                 "slicing has none")
            need(self.replies.aggregation == "mean",
                 f"aggregation={self.replies.aggregation!r} with method="
                 f"{self.sharding.method!r}: width slicing averages each element over the "
                 "nodes that trained it; expected 'mean'")
            fast_on = [f"{run_key(f)}=true" for f in fields(FastOptions)
                       if run_key(f) and getattr(self.fast, f.name) is True]
            need(self.sharding.method != "ordered-dropout" or not fast_on,
                 f"{' and '.join(fast_on)} with method='ordered-dropout': ordered dropout "
                 "trains with its own step (a width drawn per batch), which the fast path "
                 "cannot run; expected them off for this method (HeteroFL and FedRolex "
                 "train with them)")
        need(0 <= self.trusted_data <= 100_000,
             f"trusted-data={self.trusted_data}: expected 0 (off) or the number of training "
             "examples held out for the server's reference update (FLTrust uses 100-500)")
        need(not self.trusted_data_dir or Path(self.trusted_data_dir).expanduser().is_dir(),
             f"trusted-data-dir={self.trusted_data_dir!r}: no such folder (expected the "
             "server's clean examples in the data set's layout, or empty)")
        need(not (self.trusted_data and self.trusted_data_dir),
             f"trusted-data={self.trusted_data} with trusted-data-dir="
             f"{self.trusted_data_dir!r}: expected one of them (a held-out share of the "
             "training data in simulation, or a folder of the server's own)")
        need(not (self.trusted_data and self.dataset == "shakespeare"),
             "trusted-data with dataset='shakespeare': its split is by speaking role; give "
             "the server a folder of its own (trusted-data-dir)")
        need(not self.keep_ratio_file or Path(self.keep_ratio_file).expanduser().is_file(),
             f"keep-ratio-table={self.keep_ratio_file!r}: no such file (expected a TOML file "
             "of '\"<node key>\" = <ratio>' lines, or empty for no table)")
        return p

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


# ---------------------------------------------------------------------------- the keys
def _is_concern(name: str) -> bool:
    return name in _CONCERNS


def _settings_fields() -> list[tuple[str | None, Field[Any]]]:
    """Every run-config setting: ``(concern, field)`` of the settings objects' fields with a
    run-config key (``concern`` the :class:`RunConfig` field that holds the object), and
    ``(None, field)`` of the app's own."""
    out: list[tuple[str | None, Field[Any]]] = []
    for f in fields(RunConfig):
        if f.name in _CONCERNS:
            out += [(f.name, g) for g in fields(_CONCERNS[f.name])  # type: ignore[arg-type]
                    if run_key(g) is not None]
        else:
            out.append((None, f))
    return out


@functools.cache
def _keys() -> dict[str, tuple[str | None, Field[Any], type, str]]:
    """Run-config key -> ``(concern, field, type, role)``; role ``"value"``, or ``"switch"``
    for a boolean key that turns its setting off."""
    out: dict[str, tuple[str | None, Field[Any], type, str]] = {}
    for concern, f in _settings_fields():
        owner = _CONCERNS[concern] if concern else RunConfig
        key = run_key(f)
        assert key is not None and key not in out, key
        out[key] = (concern, f, value_type(owner, f.name), "value")
        switch = f.metadata.get("switch")
        if switch:
            out[switch] = (concern, f, bool, "switch")
    return out


def _encode(cfg: RunConfig, concern: str | None, f: Field[Any]) -> dict[str, Any]:
    """The run-config entries of setting ``f`` (of ``cfg``'s ``concern`` object, or the app's):
    ``None`` as its stand-in, a switched-off setting as its switch ``false`` and its default."""
    value = getattr(getattr(cfg, concern) if concern else cfg, f.name)
    key = run_key(f)
    assert key is not None
    switch = f.metadata.get("switch")
    if switch:
        return {switch: value is not None, key: value if value is not None else f.default}
    has_none, none = encoded_none(f, "run")
    return {key: none if value is None and has_none else value}


def _render(err: SettingsError, concern: str) -> list[str]:
    """A settings object's problems, named by their run-config keys."""
    names = {f.name: run_key(f) or kebab(f.name)
             for f in fields(_CONCERNS[concern])}  # type: ignore[arg-type]
    return [replace(p, about=tuple((names.get(k, k), v) for k, v in p.about)).render("run-config")
            for p in err.found]


#: The RunConfig fields that hold settings objects -> their class.
_CONCERNS: dict[str, type[Settings]] = {"sharding": Sharding, "training": LocalTraining,
                                        "replies": ReplyPolicy, "nodes": NodePolicy,
                                        "slicing": Slicing, "privacy": Privacy,
                                        "fast": FastOptions}


#: The models whose size ``model-width`` sets (cct has a fixed size; for chargpt it is the
#: embedding width ``n_embd``, a multiple of its :data:`CHARGPT_HEADS` heads).
WIDE_MODELS = ("resnet18", "mlp", "chargpt")
CHARGPT_HEADS = 3


@functools.lru_cache(maxsize=64)
def _parameter_count(model: str, width: int, dataset: str) -> int:
    """Parameters of ``model`` at ``width`` for ``dataset``, counted on the ``meta`` device
    (nothing is allocated, so any width can be counted); the same builders and arguments as
    :func:`fedshard.app.task.build_model`. 0 for a data set the model cannot take (refused
    by another rule)."""
    import torch

    from fedshard.data import dataset_info
    from fedshard.models import char_transformer, mlp, resnet18

    info = dataset_info(dataset)
    if (info.task == "next-char") != (model == "chargpt"):
        return 0
    with torch.device("meta"):
        if model == "chargpt":
            net: torch.nn.Module = char_transformer(info.num_classes, n_embd=width,
                                                    n_head=CHARGPT_HEADS)
        elif model == "resnet18":
            net = resnet18(num_classes=info.num_classes, in_channels=info.in_channels,
                           width=width)
        else:
            net = mlp(info.in_channels * info.image_size**2, info.num_classes, width=width)
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
