"""The settings of spectral model sharding: one frozen, validated dataclass per concern.

- :class:`Sharding` - what is sharded and how (method, sampling design, +Scaled, PriSM's and
  the annealed methods' exponents, the FedAvg-cosine analysis).
- :class:`LocalTraining` - the local-training recipe every node gets (lr and its schedule,
  epochs, batch size, momentum, Frobenius decay, ClipLR's τ, weight decay).
- :class:`ReplyPolicy` - what a node's reply may hold and how the replies are combined.
- :class:`NodePolicy` - which keep ratios nodes may declare and how long to wait for them.
- :class:`Cohort` - which nodes a round is sent to (Flower's ``FedAvg`` sampling: the shares
  and the fewest nodes).
- :class:`Slicing` - width slicing, the alternative to spectral sharding (HeteroFL, FedRolex,
  ordered dropout): how a keep ratio becomes a width, HeteroFL's scaler, ordered dropout's
  widths and distillation.
- :class:`Privacy` - central differential privacy on the server (opt-in): the clipping norm S,
  the noise multiplier σ or the (ε, δ) target it is calibrated to.

The same objects are built by the run config (:class:`fedshard.app.config.RunConfig`), taken
by the strategy (:class:`~fedshard.server.strategy.SpectralSharding`), carried by the wire
codec (:class:`fedshard.protocol.TrainSettings` holds the round's :class:`LocalTraining`) and
read by the node's trainer (:class:`fedshard.client.train.TrainConfig`).

Each setting is declared once, as a field made by :func:`setting`: its name, type and default,
its rule (checked where the value enters, in ``__post_init__``, which reports every problem at
once: :class:`SettingsError`), its run-config key and how a run config writes ``None``, and
whether it travels in every ``train`` message. The run config's keys and defaults
(:class:`fedshard.app.config.RunConfig`, pyproject's ``[tool.flwr.app.config]``) and the wire
keys (:class:`fedshard.protocol.TrainSettings`) are derived from these declarations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any, ClassVar, Literal, get_args, get_type_hints

from fedshard.sampling import SAMPLING_DESIGNS, SCALABLE_METHODS, SHARDING_METHODS
from fedshard.spectral.aggregate import AGGREGATIONS

__all__ = [
    "BOOL",
    "CLIP_LR_TAU",
    "CONCERNS",
    "DEFAULT_LR",
    "FACTOR_STEPS",
    "LR_SCHEDULES",
    "MAX_EXACT_COUNT",
    "MIN_LR",
    "ROUND_LR",
    "UPDATE_POLICIES",
    "WIDTH_MATCHES",
    "WIDTH_METHODS",
    "Cohort",
    "LocalTraining",
    "NodePolicy",
    "Privacy",
    "Problem",
    "ProblemsError",
    "ReplyPolicy",
    "Settings",
    "SettingsError",
    "Sharding",
    "Slicing",
    "encoded_none",
    "finite_real",
    "group_settings",
    "kebab",
    "missing_on_wire",
    "one_of",
    "robust_defaults",
    "rule",
    "rule_of",
    "run_key",
    "setting",
    "value_type",
    "wire_key",
]

#: Width slicing's methods (:class:`fedshard.server.width.WidthSlicing`): HeteroFL's static
#: slices (Diao et al., 2021), FedRolex's rolling window (Alam et al., 2022) and FjORD's
#: ordered dropout (Horváth et al., 2021).
WIDTH_METHODS = ("heterofl", "fedrolex", "ordered-dropout")

#: How width slicing turns a node's keep ratio r into a width: ``"flops"`` (the width whose
#: forward FLOPs are nearest those of the spectral sub-model at r), ``"bytes"`` (nearest in
#: bytes received) or ``"keep-ratio"`` (r itself is the width ratio).
WIDTH_MATCHES = ("flops", "bytes", "keep-ratio")

#: ``cosine`` (the paper's, Sec. 4.1) or ``constant``.
LR_SCHEDULES = ("cosine", "constant")

#: How a node steps the factors ``U``, ``V`` of ``W = U Ω Vᵀ``: ``"plain"`` (the paper's SGD on
#: the factors) or ``"dense"`` (each step moves ``W`` as a dense step would, so the dense
#: model's lr works; :mod:`fedshard.client.train.precondition`).
FACTOR_STEPS = ("plain", "dense")

#: ``"clip"``: scale an update beyond ``max_update_ratio`` down to it; ``"drop"``: drop the reply.
UPDATE_POLICIES = ("clip", "drop")

#: Largest count a float64 holds exactly: weights up to it (times any float32) cannot overflow.
MAX_EXACT_COUNT = 2**53

Style = Literal["python", "run-config"]


class ProblemsError(ValueError):
    """A validation error that lists every problem found, not just the first.

    The message reads ``Invalid <subject> (<k> problem(s)); <consequence>:`` followed by one
    ``  - <problem>`` line each; ``problems`` keeps the list.
    """

    def __init__(self, subject: str, problems: Sequence[str], consequence: str) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"Invalid {subject} ({len(self.problems)} problem(s)); {consequence}:\n{lines}")


@dataclass(frozen=True)
class Problem:
    """One problem of a settings object: the values it is about and what was expected.

    ``about`` holds ``(field, value)`` pairs (two for a bad combination); :meth:`render`
    names them as Python does (``clip_lr_tau=0.5``, ``scaled=True``) or as a run config does
    (``clip-lr-tau=0.5``, ``scaled=true``).
    """

    about: tuple[tuple[str, Any], ...]
    expected: str

    def render(self, style: Style = "python") -> str:
        def show(name: str, value: Any) -> str:
            if style == "run-config":
                if name.isidentifier():  # a field, not a label such as a table entry
                    name = name.replace("_", "-")
                if isinstance(value, bool):
                    return f"{name}={str(value).lower()}"
            return f"{name}={value!r}"

        return " with ".join(show(n, v) for n, v in self.about) + f": {self.expected}"


class SettingsError(ProblemsError):
    """Raised when a settings object is invalid; ``found`` keeps the :class:`Problem` s."""

    def __init__(self, subject: str, found: Sequence[Problem],
                 consequence: str = "no round was started") -> None:
        self.found = list(found)
        super().__init__(subject, [p.render() for p in self.found], consequence)


# ---------------------------------------------------------------------------- the rules
Rule = Callable[[Any], str | None]  # the value -> None if fine, else what was expected


def finite_real(x: Any) -> bool:
    """True for a finite ``int`` or ``float`` (not a ``bool``, NaN or ±inf): how every setting
    that arrives from outside (a run config, a message, an argument) is checked to be a number."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def rule(ok: Callable[[Any], bool], expected: str, optional: bool = False) -> Rule:
    """A rule from a predicate; ``optional``: ``None`` (the documented "off"/"default") is fine."""
    return lambda v: None if (optional and v is None) or ok(v) else expected


def one_of(choices: tuple[str, ...]) -> Rule:
    """The rule of a setting that takes one of ``choices``."""
    return rule(lambda v: isinstance(v, str) and v in choices, f"expected one of {choices}")


BOOL = rule(lambda v: isinstance(v, bool), "expected True or False")

#: The rule of the lr a node trains one round with: the schedule's value at that round, which a
#: schedule or a user's round config may take to 0 (then the round changes nothing).
ROUND_LR = rule(lambda v: finite_real(v) and v >= 0, "expected ≥ 0 (a finite number: the "
                "round's scheduled rate)")

#: ClipLR's τ (the strategy's, the wire's and the client rule's): τ ≥ 1, or ``None`` for off.
CLIP_LR_TAU = rule(lambda v: finite_real(v) and v >= 1, "expected τ ≥ 1 (the paper uses 10), "
                   "or None for ClipLR off (clip-lr = false in a run config)", optional=True)

_NO_VALUE = object()


def setting(default: Any, check: Rule | None, *, run: str | bool = True,
            run_none: Any = _NO_VALUE, switch: str | None = None, wire: str | bool = False,
            wire_none: Any = _NO_VALUE, wire_missing: Any = _NO_VALUE) -> Any:
    """Declare one setting: a dataclass field with everything the run config, the wire codec
    and validation need to know of it, so that it is declared nowhere else.

    Parameters
    ----------
    default : object
        The field's default (``dataclasses.MISSING``: none, the value must be given).
    check : callable or None
        Its rule (value -> ``None`` if fine, else ``"expected ..."``); ``None``: any value.
    run : str or bool
        Its key in a Flower run config (``True``: the field's name in kebab case; ``False``:
        not a run-config key).
    run_none : object
        The run-config value that stands for ``None`` (TOML has no null), e.g. ``0``.
    switch : str, optional
        A boolean run-config key that turns the setting off (``None``) when false.
    wire : str or bool
        Whether it travels in every ``train`` message's config (``True``: under its name in
        kebab case; a str: under that key).
    wire_none, wire_missing : object
        The wire value that stands for ``None``; the value a message without the key means
        (a server from before the key existed).
    """
    meta = {"rule": check, "run": None if run is False else run, "run_none": run_none,
            "switch": switch, "wire": None if wire is False else wire, "wire_none": wire_none,
            "wire_missing": wire_missing}
    return field(default=default, metadata=meta)


def _key(f: Field[Any], which: str) -> str | None:
    key = f.metadata.get(which)
    return None if key is None else (kebab(f.name) if key is True else str(key))


def kebab(name: str) -> str:
    """A field's name as a run-config or wire key (``clip_lr_tau`` -> ``clip-lr-tau``)."""
    return name.replace("_", "-")


def run_key(f: Field[Any]) -> str | None:
    """The run-config key of setting ``f`` (``None``: not a run-config key)."""
    return _key(f, "run")


def wire_key(f: Field[Any]) -> str | None:
    """The ``train`` config key of setting ``f`` (``None``: it does not travel)."""
    return _key(f, "wire")


def encoded_none(f: Field[Any], which: str) -> tuple[bool, Any]:
    """Whether setting ``f`` has a stand-in for ``None`` in a run config (``which="run"``)
    or on the wire (``"wire"``), and that value."""
    value = f.metadata.get(f"{which}_none", _NO_VALUE)
    return value is not _NO_VALUE, value


def missing_on_wire(f: Field[Any]) -> tuple[bool, Any]:
    """Whether a ``train`` config may lack setting ``f`` (an older server), and what that means."""
    value = f.metadata.get("wire_missing", _NO_VALUE)
    return value is not _NO_VALUE, value


#: Each settings class's resolved annotations (``typing.get_type_hints``), by class.
_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def value_type(owner: type, name: str) -> type:
    """The type of field ``name`` of the dataclass ``owner`` with ``None`` left out (what a
    run config or a message carries: ``float | None`` -> ``float``).

    A class's annotations are resolved once (``typing.get_type_hints`` costs about 2 ms a
    class, and every received ``train`` message reads the type of each of its settings; a
    class's annotations do not change once it is defined)."""
    hints = _TYPE_HINTS.get(owner)
    if hints is None:
        hints = _TYPE_HINTS[owner] = get_type_hints(owner)
    hint = hints[name]
    args = [a for a in get_args(hint) if a is not type(None)]
    return args[0] if args else hint


class Settings:
    """The base of fedshard's settings dataclasses (frozen, one per concern): every field
    declared with :func:`setting` is checked by its rule when the object is built (a subclass
    may give a field another rule in ``_RULES``), then :meth:`_combinations`; all problems
    are raised at once (:class:`SettingsError`)."""

    _RULES: ClassVar[dict[str, Rule]] = {}

    def __post_init__(self) -> None:
        found = self.problems()
        if found:
            raise SettingsError(type(self).__name__, found)

    def problems(self) -> list[Problem]:
        """Every problem of these settings (empty: fine)."""
        found = []
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            check = self._RULES.get(f.name, f.metadata.get("rule"))
            expected = check(value) if check is not None else None
            if expected is not None:
                found.append(Problem(((f.name, value),), expected))
        return found + self._combinations()

    def _combinations(self) -> list[Problem]:
        return []


def rule_of(kind: type, name: str) -> Rule:
    """The rule of setting ``name`` of the settings class ``kind``, e.g.
    ``rule_of(LocalTraining, "clip_lr_tau")(0.5)`` -> ``"expected τ ≥ 1 ..."``."""
    own: dict[str, Rule] = getattr(kind, "_RULES", {})
    if name in own:
        return own[name]
    for f in fields(kind):
        if f.name == name and f.metadata.get("rule") is not None:
            return f.metadata["rule"]
    raise KeyError(f"{kind.__name__} has no setting {name!r} with a rule")


# ---------------------------------------------------------------------------- the concerns
#: The strategy's lr when ``LocalTraining.lr`` is ``None`` (and a round's config sets none).
DEFAULT_LR = 0.05
#: The smallest lr accepted: float32's smallest normal number, 2⁻¹²⁶ ≈ 1.2e-38. Below it a
#: float32 step ``lr·g`` is zero or subnormal for every gradient under 1 (lr 5e-324 is 0 in
#: float32), so every update of a float32 model vanishes and the run would train nothing.
MIN_LR = 2.0**-126

_POSITIVE_INT = rule(lambda v: _integer(v) and v >= 1, "expected an integer ≥ 1")


@dataclass(frozen=True)
class Sharding(Settings):
    """What is sharded and how.

    Attributes
    ----------
    method : str
        ``"unbiased"`` (Theorem 1, ω = 1/π), ``"collective"`` (Theorem 2, C = group size),
        ``"top-n"`` (FedHM), ``"prism"`` (successive sampling ∝ λᵏ, ω = 1),
        ``"prism-wallenius"`` (ω = 1/π, π the Wallenius mean), ``"anneal-unbiased"`` /
        ``"anneal-collective"`` (Theorem 1 / 2 on ``λ^γ_t``, γ annealed from
        ``anneal_exponent`` to 1 over ``anneal_rounds`` rounds: :mod:`fedshard.sampling.anneal`)
        or ``"none"`` (FedAvg); or a width-slicing method (:data:`WIDTH_METHODS`:
        ``"heterofl"``, ``"fedrolex"``, ``"ordered-dropout"``), which
        :class:`~fedshard.server.width.WidthSlicing` runs instead (:class:`Slicing`).
    design : str
        ``"cps"`` (conditional Poisson), ``"brewer"`` or ``"min-support"``, for unbiased and
        collective (PriSM samples successively, Top-n is deterministic).
    scaled : bool
        +Scaled (ω_i = sqrt(Σλ²/Σ_sampled λ²)); only with ``top-n`` or ``prism``.
    prism_exponent : float or None
        PriSM's k > 0; ``None``: 4 if n/N ≤ 0.2 else 2.5 (0 in a run config).
    anneal_exponent : float
        γ₀ ≥ 1 of the annealed methods (ignored by the others).
    anneal_rounds : int
        T ≥ 1, the rounds over which γ anneals to 1 (ignored by the other methods).
    fedavg_cosine : bool
        The paper's post-gradient analysis (:mod:`fedshard.server.fedavg_cosine`): nodes also
        train a dense copy and each round's metrics get ``fedavg-cosine``. Doubles the nodes'
        work.
    """

    method: str = setting("collective", one_of(SHARDING_METHODS + WIDTH_METHODS))
    design: str = setting("cps", one_of(SAMPLING_DESIGNS))
    scaled: bool = setting(False, BOOL)
    prism_exponent: float | None = setting(
        None, rule(lambda v: finite_real(v) and v > 0, "expected k > 0, or None for the "
                   "paper's default: 4 if n/N ≤ 0.2 else 2.5 (0 in a run config)",
                   optional=True), run_none=0.0)
    anneal_exponent: float = setting(8.0, rule(lambda v: finite_real(v) and v >= 1,
                                               "expected γ₀ ≥ 1 (1: no annealing)"))
    anneal_rounds: int = setting(30, rule(lambda v: _integer(v) and v >= 1,
                                          "expected T ≥ 1 rounds"))
    fedavg_cosine: bool = setting(False, BOOL)

    def _combinations(self) -> list[Problem]:
        if self.method in WIDTH_METHODS and self.fedavg_cosine is True:
            return [Problem((("fedavg_cosine", True), ("method", self.method)),
                            "the FedAvg-cosine analysis compares spectral sub-models with the "
                            "dense model; width slicing has no terms")]
        if self.scaled is not True:
            return []
        about = (("scaled", True), ("method", self.method))
        if self.method == "none" or self.method in WIDTH_METHODS:
            return [Problem(about, "there are no terms to scale")]
        if self.method in SHARDING_METHODS and self.method not in SCALABLE_METHODS:
            return [Problem(about, "+Scaled replaces the method's own multipliers ω; use it "
                                   "with 'top-n' or 'prism'")]
        return []


@dataclass(frozen=True)
class LocalTraining(Settings):
    """The local-training recipe every node gets (its round's lr is scheduled by the server).

    Attributes
    ----------
    lr : float or None
        SGD learning rate ≥ :data:`MIN_LR` (≈ 1.2e-38) of round 1 (the base of
        ``lr_schedule``); ``None``:
        :data:`DEFAULT_LR` (0.05). A node gets its round's scheduled rate
        (:class:`fedshard.protocol.TrainSettings`), unless the round's config sets ``lr`` (the
        caller's ``train_config`` or a ``configure_train`` override): that value wins (see
        :class:`fedshard.SpectralSharding`'s Notes).
    lr_schedule : str
        ``"cosine"`` (the paper's, over the run's rounds) or ``"constant"``.
    local_epochs : int
        Passes over the node's data per round, ≥ 1.
    batch_size : int
        Batch size ≥ 1 of the node's loader (a ``DataLoader`` the node built keeps its own).
    momentum : float
        SGD momentum in ``[0, 1)``; the paper uses 0.9.
    frobenius_decay : float
        γ ≥ 0; adds ``γ ‖U Ω Vᵀ‖²_F`` per sharded layer to the loss (paper: 1e-4).
    clip_lr_tau : float or None
        ClipLR's τ ≥ 1: term i's learning rate is scaled by ``min(1, τ/ω_i)`` (paper: 10);
        ``None``: ClipLR off (``clip-lr = false`` in a run config).
    weight_decay : float
        Ordinary (L2) weight decay ≥ 0 of the dense parameters (never of the factors).
    factor_step : str
        ``"plain"`` (the paper's recipe): SGD on the factors ``U``, ``V``, whose step moves
        ``W = U Ω Vᵀ`` by up to about ``2 ω² λ`` times a dense step, so the sharded model
        needs a smaller lr than the dense one. ``"dense"``: each step moves ``W`` by the
        dense step projected onto what the factors can express (the dense step itself with
        all terms), so the dense model's lr works (:mod:`fedshard.client.train.precondition`).
    max_steps : int
        At most this many optimizer steps per round (the ``local_epochs`` passes stop there);
        0: no cap. For a run at reduced scale on nodes with much data (a node's weight stays
        its data size).
    """

    lr: float | None = setting(None, rule(
        lambda v: finite_real(v) and v >= MIN_LR,
        "expected a finite number ≥ 1.2e-38 (float32's smallest normal number; below it "
        "every update of a float32 model vanishes, so nothing would train)"), wire=True)
    lr_schedule: str = setting("cosine", one_of(LR_SCHEDULES))
    local_epochs: int = setting(1, _POSITIVE_INT, wire=True)
    batch_size: int = setting(32, _POSITIVE_INT, wire=True)
    momentum: float = setting(0.9, rule(lambda v: finite_real(v) and 0 <= v < 1,
                                        "expected in [0, 1)"), wire=True)
    frobenius_decay: float = setting(1e-4, rule(lambda v: finite_real(v) and v >= 0,
                                                "expected a finite number ≥ 0"), wire=True)
    clip_lr_tau: float | None = setting(10.0, CLIP_LR_TAU, switch="clip-lr", wire=True,
                                        wire_none=0.0)
    weight_decay: float = setting(0.0, rule(lambda v: finite_real(v) and v >= 0,
                                            "expected a finite number ≥ 0"), wire=True)
    factor_step: str = setting("plain", one_of(FACTOR_STEPS), wire=True, wire_missing="plain")
    max_steps: int = setting(0, rule(lambda v: _integer(v) and v >= 0,
                                     "expected an integer ≥ 0 (0: no cap)"), wire=True,
                             wire_missing=0)

    @property
    def base_lr(self) -> float:
        """``lr``, or :data:`DEFAULT_LR` when it is ``None``."""
        return self.lr if self.lr is not None else DEFAULT_LR

    def problems(self) -> list[Problem]:
        found = super().problems()
        # lr=None ("not given") means DEFAULT_LR.
        return [p for p in found if not (self.lr is None and p.about[0][0] == "lr")]


_BOUND = rule(lambda v: finite_real(v) and (v == 0 or v >= 1),
              "expected 0 (off) or a finite number ≥ 1")
#: a median cosine under which a node is named (-1: never)
_COSINE = rule(lambda v: finite_real(v) and -1 <= v <= 1, "expected a cosine in [-1, 1] (-1: off)")


@dataclass(frozen=True)
class ReplyPolicy(Settings):
    """What a ``train`` reply may hold and how the valid replies become the new model.

    Attributes
    ----------
    max_update_ratio : float
        ρ: a returned term may differ from the one sent by at most ρ times the sent norm, per
        factor column ``‖u'_i − u_i‖ ≤ ρ·max(‖u_i‖, ‖U‖_F/√n)`` (and the same for v); a dense
        array by ``‖x' − x‖ ≤ ρ·max(‖x‖, 0.1·√size)``. 0 disables the bound. A term ``u'v'ᵀ``
        can still grow by up to ``(1+ρ)²``; honest replies stay below ρ = 1 (the golden-run
        configs: ≤ 0.65), so the default 10 never touches them.
    update_policy : str
        ``"clip"``: scale the excess change down to the bound; ``"drop"``: drop the reply.
    max_num_examples : int or None
        Largest ``num-examples`` accepted (``None``: up to 2**53, the exact float64 range;
        0 in a run config).
    max_weight_ratio : float
        ≥ 1 (0 by default: FedAvg's weights, the paper's mean; :func:`robust_defaults`: 2): a
        reply's ``num-examples`` above this multiple of the round's median
        (the lower median of the accepted replies) is clipped to it and counted
        (``clipped-num-examples``), however large the claim, and the nodes above the median
        share one budget of ``max_weight_ratio − 1`` medians of extra weight, so colluders
        gain at most that together (no threshold a claim can sit under for more weight;
        :func:`~fedshard.server.robust.bounded_weights`); a node beyond
        100 × the median is also named in a WARNING (``implausible-num-examples``), the others
        are listed in one INFO line per round. The spread bound judges a node's update
        against this weight, not its claim. Honest nodes of equal size never reach it; one
        honest node holding more than twice the median's data is weighted as twice the
        median, several share that one extra median.
    aggregation : str
        Per term and dense entry: ``"mean"`` (the paper's weighted mean), ``"median"`` or
        ``"trimmed-mean"`` (:mod:`fedshard.spectral.aggregate`); or over each reply's whole
        dense-equivalent model, Flower's own rules: ``"dense-median"`` (``FedMedian``),
        ``"dense-trimmed-mean"`` (``FedTrimmedAvg``) or ``"krum"`` (``Krum``)
        (:mod:`fedshard.server.robust`).
    trim_fraction : float
        In ``[0, 0.5)``: the share of the holders dropped at each end by ``"trimmed-mean"``
        and ``"dense-trimmed-mean"``; for ``"krum"``, the share of replies assumed dishonest.
    align_factors : bool
        Off by default (:func:`robust_defaults`: on). Before averaging, re-express every
        returned term ``(u'_i, v'_i)`` with the sign (and, where its two factors' growths
        differ more than 4-fold, the balance) of the term it was sent, which leaves its
        product ``u'_i v'_iᵀ`` unchanged
        (:func:`fedshard.spectral.aggregate.align_factors`; each change logged and counted in
        ``re-signed-terms`` / ``rebalanced-terms``). A no-op for honest replies; it undoes a
        re-signing ``U, V → −U, −V`` (which changes no product), which the separate averages
        of ``U`` and ``V`` would otherwise turn into a shrunken model.
    max_update_spread : float
        κ ≥ 1 (0 by default: off; :func:`robust_defaults`: 2): a node's change of a sharded
        layer (its ``u`` and ``v`` together) or of a dense entry, relative to what it was
        sent, above κ times the round's median (over the nodes, at least 3) is shrunk to it,
        logged and counted (``clipped-update-spread``): one step of centred clipping around
        the sent model (:mod:`fedshard.server.robust`). A node whose update is out of line
        as a whole, further than the data it reports explains, is aggregated as a typical
        node: each change shrunk to the round's median change, its weight to the median
        weight (``update-spread-held``).
    distrust_below : float
        In ``[-1, 1]`` (default 0.02), with trusted data: a node whose updates' cosine with
        the server's trusted reference update has a median below this over its last rounds
        (at least 3 of the last 10 it took part in) is named in a WARNING with its cosines
        (:mod:`fedshard.server.trust_record`; counted in ``distrusted-nodes``). -1: never named.
    distrust_below_aggregate : float
        In ``[-1, 1]`` (default -0.5), without trusted data: the same rule on each node's
        cosine with the aggregate of the round's other accepted nodes. Honest nodes on
        non-IID data have medians about 0 there (they point as far from the others as a
        negated update), so only nodes that pull against the others' consensus round after
        round (IPM) are named (docs/robustness.md). -1: never named.
    exclude_distrusted : bool
        Off by default. On: a node once named (under ``distrust_below`` or
        ``distrust_below_aggregate``) is no longer sampled
        for training (each such node logged once, with why; a round left with fewer nodes
        than ``min-train-nodes`` says so in a WARNING; one that would leave every connected
        node out stops the run with an ERROR), and a reply of it that still arrives is not
        aggregated (``distrusted-excluded``). The left-out nodes are checkpointed.
    max_diverged_fraction : float
        In ``[0, 1]``: the run stops (``TrainingDivergedError``, logged as an ERROR) after a
        round in which more than this share of the nodes that replied, and at least two of
        them, report that their training diverged (NaN or inf): a learning rate too large for
        the sub-models is a setting to change, not a fault to average around. One node alone
        never stops a run (``StopOnDivergence``). 1: never stop.
    """

    max_update_ratio: float = setting(10.0, rule(lambda v: finite_real(v) and v >= 0,
                                                 "expected a finite number ≥ 0 (0 = no bound)"))
    update_policy: str = setting("clip", one_of(UPDATE_POLICIES))
    max_num_examples: int | None = setting(
        None, rule(lambda v: _integer(v) and 1 <= v <= MAX_EXACT_COUNT,
                   "expected an integer in [1, 2**53], or None for no cap (0 in a run config)",
                   optional=True), run_none=0)
    aggregation: str = setting("mean", one_of(AGGREGATIONS))
    trim_fraction: float = setting(0.1, rule(lambda v: finite_real(v) and 0 <= v < 0.5,
                                             "expected in [0, 0.5)"))
    max_weight_ratio: float = setting(0.0, _BOUND)
    align_factors: bool = setting(False, BOOL)
    max_update_spread: float = setting(0.0, _BOUND)
    distrust_below: float = setting(0.02, _COSINE)
    distrust_below_aggregate: float = setting(-0.5, _COSINE)
    exclude_distrusted: bool = setting(False, BOOL)
    max_diverged_fraction: float = setting(
        0.5, rule(lambda v: finite_real(v) and 0 <= v <= 1,
                  "expected a share in [0, 1] (1: never stop)"))


def robust_defaults(**changes: Any) -> ReplyPolicy:
    """The reply rules fedshard's app runs by default against dishonest nodes: the
    ``num-examples`` cap (``max_weight_ratio`` 2), factor alignment and the spread bound
    with its hold rule (``max_update_spread`` 2), over :class:`ReplyPolicy`'s defaults, which
    are the paper's plain data-weighted mean. ``changes`` override any field.

    Examples
    --------
    >>> robust_defaults().max_update_spread, ReplyPolicy().max_update_spread
    (2.0, 0.0)
    >>> robust_defaults(aggregation="median").aggregation
    'median'
    """
    return ReplyPolicy(**{"max_weight_ratio": 2.0, "align_factors": True,
                          "max_update_spread": 2.0, **changes})


_KEEP_RATIO = rule(lambda v: finite_real(v) and 0 < v <= 1, "expected a keep ratio in (0, 1]")


@dataclass(frozen=True)
class NodePolicy(Settings):
    """Which keep ratios the operator allows, and how long to wait for nodes.

    Attributes
    ----------
    max_keep_ratio : float
        Largest keep ratio in ``(0, 1]``; a node declaring more is clipped to it (warned).
    min_keep_ratio : float
        Smallest keep ratio that trains, in ``[0, 1]`` (0, the default: every node trains).
        A node declaring less is never sampled for training: it stays idle, and the round's
        sample is ``fraction_train`` of the nodes that may train. With ``min_keep_ratio = 1``
        and ``method = "none"`` only the devices able to train the whole model train it
        (what a federation does without sharding). Logged once per idle node.
    keep_ratio_table : mapping of str to float, optional
        Node key (``node-key``) or public key (hex of ``NodeInfo.public_key``) -> the only
        keep ratio that node may declare. With a table, a node in neither column is refused.
        A public-key entry matches only the key Flower authenticated the node with
        (``NodeInfo.public_key``); a name matches the ``node-key`` a node declares only with
        ``trust_declared_keys``. (In a run config: ``keep-ratio-table``, the path of a TOML
        file of such entries.)
    trust_declared_keys : bool
        Whether a declared ``node-key`` may select a (non-public-key) table entry. Off by
        default: any node can declare any name.
    query_timeout : float
        Seconds to wait for the nodes' answers to the capability query (in a run config:
        ``round-timeout``).
    node_wait_timeout : float or None
        Seconds to wait for enough nodes to connect (``None``: forever, as FedAvg does; in a
        run config: ``round-timeout``).
    """

    max_keep_ratio: float = setting(1.0, _KEEP_RATIO)
    min_keep_ratio: float = setting(0.0, rule(lambda v: finite_real(v) and 0 <= v <= 1,
                                              "expected a keep ratio in [0, 1] (0: every "
                                              "node trains)"))
    keep_ratio_table: Mapping[str, float] | None = setting(None, None, run=False)
    query_timeout: float = setting(600.0, rule(lambda v: finite_real(v) and v > 0,
                                               "expected > 0 seconds"), run=False)
    node_wait_timeout: float | None = setting(
        600.0, rule(lambda v: finite_real(v) and v > 0,
                    "expected > 0 seconds, or None to wait forever", optional=True), run=False)
    trust_declared_keys: bool = setting(False, BOOL)

    def _combinations(self) -> list[Problem]:
        out = [Problem(((f"keep-ratio table entry {key!r}", ratio),),
                       "expected a keep ratio in (0, 1]")
               for key, ratio in (self.keep_ratio_table or {}).items()
               if _KEEP_RATIO(ratio) is not None]
        if (finite_real(self.min_keep_ratio) and finite_real(self.max_keep_ratio)
                and self.min_keep_ratio > self.max_keep_ratio):
            out.append(Problem((("min_keep_ratio", self.min_keep_ratio),
                                ("max_keep_ratio", self.max_keep_ratio)),
                               "expected the smallest keep ratio that trains to be at most "
                               "the largest allowed (else no node could train)"))
        return out


_FRACTION = rule(lambda v: finite_real(v) and 0 <= v <= 1, "expected a share in [0, 1]")
_COUNT = rule(lambda v: _integer(v) and v >= 0, "expected an integer ≥ 0")


@dataclass(frozen=True)
class Cohort(Settings):
    """Which nodes a round is sent to: Flower's ``FedAvg`` sampling, with ``FedAvg``'s defaults.

    Attributes
    ----------
    fraction_train : float
        Share in ``[0, 1]`` of the connected nodes that may train (see
        :attr:`NodePolicy.min_keep_ratio`) sampled for each training round; 0: no training.
    fraction_evaluate : float
        Share in ``[0, 1]`` of the connected nodes sampled for each round's evaluation on the
        nodes; 0: none.
    min_train_nodes, min_evaluate_nodes : int
        Fewest nodes (≥ 0) a training / evaluation round samples when the share gives fewer.
    min_available_nodes : int
        Nodes (≥ 0) that must be connected before a round starts (the wait is bounded by
        :attr:`NodePolicy.node_wait_timeout`).
    """

    fraction_train: float = setting(1.0, _FRACTION, run=False)
    fraction_evaluate: float = setting(1.0, _FRACTION, run=False)
    min_train_nodes: int = setting(2, _COUNT, run=False)
    min_evaluate_nodes: int = setting(2, _COUNT, run=False)
    min_available_nodes: int = setting(2, _COUNT, run=False)


@dataclass(frozen=True)
class Slicing(Settings):
    """Width slicing (:class:`~fedshard.server.width.WidthSlicing`): how a node's keep ratio
    becomes the width it trains, and the methods' own options.

    Attributes
    ----------
    width_match : str
        ``"flops"`` (default): a node at keep ratio r trains the width whose forward FLOPs are
        nearest those of the spectral sub-model at r (the same compute per node);
        ``"bytes"``: nearest in bytes received (the same download); ``"keep-ratio"``: r is the
        width ratio (HeteroFL's own meaning of a node's rate). The widths are counted from the
        model and logged once per keep ratio (:mod:`fedshard.width.budget`).
    width_scaler : bool
        HeteroFL's scaler (Diao et al., 2021, Sec. 3.2): while a node trains, every hidden
        Linear/Conv2d's output is divided by the node's width ratio (identity when
        evaluating); for ``"heterofl"`` and ``"fedrolex"`` (FedRolex builds on HeteroFL's
        code). Ordered dropout never scales.
    od_widths : int
        Ordered dropout's width grid: the ratios ``1/D, 2/D, ..., 1`` (FjORD's uniform
        ``P``, D = 5 in the paper); a node samples, per batch, one of those below its own
        width ratio or its own (Horváth et al., 2021, Sec. 3.1).
    od_distill : bool
        FjORD's self-distillation (Sec. 3.3): each batch also trains the node's full width
        on the labels, and the sampled width against its outputs (KL divergence). Off by
        default: it adds a full-width step to every batch, so the node computes more than its
        budget.
    """

    width_match: str = setting("flops", one_of(WIDTH_MATCHES))
    width_scaler: bool = setting(True, BOOL)
    od_widths: int = setting(5, rule(lambda v: _integer(v) and 1 <= v <= 64,
                                     "expected an integer D in [1, 64] (the ratios 1/D..1)"))
    od_distill: bool = setting(False, BOOL)


#: The largest target ε central DP takes.
MAX_EPSILON = 1000.0
#: The range of a central-DP noise multiplier σ and clipping norm S.
DP_RANGE = (1e-6, 1e6)


@dataclass(frozen=True)
class Privacy(Settings):
    """Central differential privacy on the server (:mod:`fedshard.server.central_dp`), off by
    default: on with a ``target_epsilon`` (σ calibrated to it) or a ``noise_multiplier``.

    Each node's whole update (the change of its factor columns ``u``, ``v`` and dense entries;
    of its slice for width slicing) is clipped to L2 norm S; every per-term and per-entry sum
    over its holders gets Gaussian noise N(0, σ²S²) before the division by the holder count.
    The spent (ε, δ) is accounted with Opacus's RDP accountant (the ``dp`` extra) and logged
    every round (``dp-epsilon`` in the round's metrics).

    Attributes
    ----------
    target_epsilon : float or None
        ε > 0 the whole run may spend; σ is the smallest that keeps the run's ``num_rounds``
        rounds at the round-1 sampling rate within (ε, ``target_delta``). ``None``: no target
        (0 in a run config: ``dp-target-epsilon``).
    target_delta : float
        δ in (0, 1) of the target and of the ε reported (``dp-target-delta``); below 1 / the
        number of nodes is the usual choice.
    clipping_norm : float or None
        S > 0, the L2 bound on each node's whole update; needed when DP is on
        (``dp-clipping-norm``, 0: none).
    noise_multiplier : float or None
        σ > 0 given directly instead of a target (``dp-noise-multiplier``, 0: none); the
        spent ε is still reported.
    min_holders : int
        m₀ ≥ 1: a term (a dense entry, a width-slicing element) that fewer than m₀ of the
        round's replies hold keeps its value this round instead of taking a mean whose noise
        is σS / m, as large as σS for a term one node holds (``dp-min-holders``). The
        holder counts are drawn by the server, not from the data: this costs no privacy.
        1 (default): every held term is updated.
    """

    target_epsilon: float | None = setting(
        None, rule(lambda v: finite_real(v) and 0 < v <= MAX_EPSILON,
                   f"expected ε in (0, {MAX_EPSILON:g}] (a larger ε bounds nothing: a "
                   "likelihood ratio above e^1000), or None for no target (0 in a run config)",
                   optional=True), run="dp-target-epsilon", run_none=0.0)
    target_delta: float = setting(1e-5, rule(lambda v: finite_real(v) and 0 < v < 1,
                                             "expected δ in (0, 1), e.g. 1e-5"),
                                  run="dp-target-delta")
    clipping_norm: float | None = setting(
        None, rule(lambda v: finite_real(v) and DP_RANGE[0] <= v <= DP_RANGE[1],
                   f"expected S in [{DP_RANGE[0]:g}, {DP_RANGE[1]:g}] (an update clipped "
                   "below moves no float32 weight of a model's size; above, the noise σS "
                   "swamps every weight), or None (0 in a run config)", optional=True),
        run="dp-clipping-norm", run_none=0.0)
    noise_multiplier: float | None = setting(
        None, rule(lambda v: finite_real(v) and DP_RANGE[0] <= v <= DP_RANGE[1],
                   f"expected σ in [{DP_RANGE[0]:g}, {DP_RANGE[1]:g}] (below, no noise a "
                   "float32 sum holds; above, the accountant overflows and every update is "
                   "noise), or None to calibrate it to target_epsilon (0 in a run config)",
                   optional=True),
        run="dp-noise-multiplier", run_none=0.0)
    min_holders: int = setting(1, _POSITIVE_INT, run="dp-min-holders")

    @property
    def enabled(self) -> bool:
        """Whether central DP is on (a target ε or a noise multiplier is given)."""
        return self.target_epsilon is not None or self.noise_multiplier is not None

    def _combinations(self) -> list[Problem]:
        out = []
        if self.target_epsilon is not None and self.noise_multiplier is not None:
            out.append(Problem((("target_epsilon", self.target_epsilon),
                                ("noise_multiplier", self.noise_multiplier)),
                               "expected one of them: σ is either calibrated to the target "
                               "or given"))
        if self.enabled and self.clipping_norm is None:
            out.append(Problem((("clipping_norm", None),),
                               "expected S > 0: central DP clips every node's update to S "
                               "before the noise N(0, σ²S²) is added"))
        if not self.enabled and self.clipping_norm is not None:
            out.append(Problem((("clipping_norm", self.clipping_norm),),
                               "expected a target_epsilon or a noise_multiplier with it: "
                               "clipping without noise is no differential privacy (central "
                               "DP stays off)"))
        return out


CONCERNS: dict[str, type[Settings]] = {
    "sharding": Sharding, "training": LocalTraining, "replies": ReplyPolicy,
    "nodes": NodePolicy, "cohort": Cohort, "slicing": Slicing, "privacy": Privacy,
}
"""Argument name -> settings class, as :class:`~fedshard.server.strategy.SpectralSharding`
takes them."""


def group_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """Route flat setting names to their objects, for short calls.

    ``{"method": "top-n", "lr": 0.01, "seed": 1}`` becomes ``{"sharding":
    Sharding(method="top-n"), "training": LocalTraining(lr=0.01), "seed": 1}``. A flat name
    replaces that field of an object given under its argument name (``sharding=...``); names
    that are no setting's are returned unchanged.
    """
    out = dict(options)
    for arg, kind in CONCERNS.items():
        names = {f.name for f in fields(kind)}  # type: ignore[arg-type]
        flat = {k: out.pop(k) for k in list(out) if k in names}
        base = out.get(arg)
        if flat:
            out[arg] = replace(base, **flat) if base is not None else kind(**flat)
    return out
