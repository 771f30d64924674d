"""The paper's client rules (Sec. 3.3), written once for every trainer and every optimizer:
:class:`ClientRules`.

Around each step of the optimizer that moves the factors ``U``, ``V`` of the sharded layers:

- **Frobenius decay** adds ``∂/∂U γ‖U Ω Vᵀ‖²_F`` to the factors' gradients before the step
  (it is a term of the loss, so every optimizer sees it as such);
- the **dense factor step** (``factor_step="dense"``) transforms the factors' gradients before
  the step (:mod:`fedshard.client.train.precondition`);
- **ClipLR** scales what the step moved factor column ``i`` by ``min(1, τ/ω_i)``, after the
  step: a per-term learning-rate scale, so it means the same under SGD, SGD with momentum,
  Adam, AdamW or RMSprop (an adaptive optimizer divides a scaled *gradient* by its own scaled
  magnitude, so scaling the gradient would do nothing there).

The rules act on the optimizers they are attached to, and on nothing else:
:meth:`ClientRules.attach` registers a step pre- and post-hook on the optimizer it is given
(that object's ``register_step_pre_hook`` / ``register_step_post_hook``) and returns a
:class:`RulesHandle`; nothing is registered for the whole process, so two models trained in one
process (or two shards received one after another) keep two independent rule sets.
fedshard's own step attaches them to the optimizer it builds, a user's loop to its own
(``shard.rules.attach(optimizer)``), a framework through the function that builds its
optimizers (:meth:`ClientRules.attaching`), and the batched engine to the optimizer of its
stacked factors. :meth:`ClientRules.report` tells what was applied.

**DP-SGD (Opacus).** Attached to the ``DPOptimizer`` that ``PrivacyEngine.make_private``
returns, the rules act on the optimizer it wraps, that is on the privatized gradient (each
example's gradient clipped, the sum noised and averaged), right before the wrapped optimizer
moves the factors: the ``DPOptimizer`` rebuilds every ``.grad`` from the per-example gradients
inside its own ``step()``, so a rule applied before that would be overwritten. What the rules
add or change (Frobenius decay, the dense factor step, ClipLR's scale) depends on the factors
and ω only, never on the data: post-processing of the private gradient, which costs no privacy.
The report, and so the reply's receipt, says the node trained with DP-SGD, its noise multiplier
and clipping norm.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fedshard.client.train.hooks import before_step
from fedshard.client.train.precondition import DAMPING, dense_layer_gradients
from fedshard.protocol.receipts import dp_sgd_problem
from fedshard.settings import LocalTraining, SettingsError, finite_real
from fedshard.spectral.layers import SpectralLayer
from fedshard.spectral.per_sample import register_grad_samplers

__all__ = ["ClientRules", "Factors", "RulesHandle", "RulesReport"]

logger = logging.getLogger(__name__)


class Factors(Protocol):
    """A sharded layer's trainable factors and multipliers, as the rules read them:
    ``u`` ``(..., rows, n)``, ``v`` ``(..., rows', n)``, ``omega`` ``(..., n)`` (a leading
    client axis where the batched engine stacks clients). :class:`SpectralLayer` is one."""

    @property
    def u(self) -> torch.Tensor: ...

    @property
    def v(self) -> torch.Tensor: ...

    @property
    def omega(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class RulesReport:
    """What the rules did (:meth:`ClientRules.report`).

    Attributes
    ----------
    steps : int
        Optimizer steps the rules applied to.
    frobenius_decay, clip_lr_tau, factor_step
        The rules' settings (γ, τ or ``None``, ``"plain"``/``"dense"``).
    scaled_columns : int
        Factor columns (terms, over the layers; over the clients for stacked factors) whose
        moves ClipLR scales, those with ``ω_i > τ``; 0 when ClipLR is off.
    columns : int
        All factor columns.
    optimizer : str
        The class of the optimizer whose first step the rules applied to ("" before it); under
        DP-SGD the optimizer Opacus wraps (e.g. ``"SGD"``).
    lr : float or None
        That optimizer's learning rate at its first step (of the first parameter group that
        holds factors).
    dp_sgd : bool
        Whether that step's gradients were privatized by Opacus's ``DPOptimizer``.
    noise_multiplier, max_grad_norm : float or None
        The ``DPOptimizer``'s noise multiplier σ and per-example clipping norm C at that step
        (the noise's standard deviation is σ·C); ``None`` without DP-SGD, or when the rules
        were attached to the optimizer Opacus wraps rather than to the ``DPOptimizer`` itself
        (then only ``dp_sgd`` is known).
    """

    steps: int
    frobenius_decay: float
    clip_lr_tau: float | None
    factor_step: str
    scaled_columns: int
    columns: int
    optimizer: str = ""
    lr: float | None = None
    dp_sgd: bool = False
    noise_multiplier: float | None = None
    max_grad_norm: float | None = None


Built = TypeVar("Built")


class RulesHandle:
    """The client rules attached to one optimizer (what :meth:`ClientRules.attach` returns).

    Attributes
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer the rules were attached to (an Opacus ``DPOptimizer``: the rules' hooks
        are on the optimizer it wraps, see :meth:`ClientRules.attach`).
    layers : int
        How many of the rules' sharded layers it steps (those whose ``u`` or ``v`` it holds).
    attached : bool
        Whether hooks were registered (``False`` when the rules have nothing to do, or after
        :meth:`remove`).
    """

    def __init__(self, rules: ClientRules, optimizer: torch.optim.Optimizer, layers: int,
                 hooks: Sequence[RemovableHandle],
                 stepping: torch.optim.Optimizer | None = None) -> None:
        self._rules = weakref.ref(rules)
        self.optimizer = optimizer
        self.layers = layers
        self._hooks = list(hooks)
        self._stepping = optimizer if stepping is None else stepping  # where the hooks are

    @property
    def attached(self) -> bool:
        """Whether the rules act on :attr:`optimizer`'s steps now."""
        return bool(self._hooks)

    def remove(self) -> None:
        """Detach the rules from :attr:`optimizer` (its later steps are plain); idempotent."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        rules = self._rules()
        if rules is not None and rules._attached.get(self._stepping) is self:
            del rules._attached[self._stepping]

    def __enter__(self) -> RulesHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (f"RulesHandle(optimizer={type(self.optimizer).__name__}, layers={self.layers}, "
                f"attached={self.attached})")


class ClientRules:
    """Frobenius decay, the dense factor step and ClipLR on the factors of some layers, for
    any torch optimizer.

    Parameters
    ----------
    layers : sequence of Factors
        The sharded layers (their ``u``, ``v``, ``omega``); :meth:`of` takes them from a
        model.
    frobenius_decay : float
        γ ≥ 0 (0: none).
    clip_lr_tau : float or None
        τ ≥ 1 (``None``: ClipLR off).
    factor_step : str
        ``"plain"`` (the paper's) or ``"dense"``.
    damping : float
        δ of the dense factor step (:data:`~fedshard.client.train.precondition.DAMPING`).

    Raises
    ------
    fedshard.settings.SettingsError
        (a ``ValueError``) if a setting breaks its rule in :mod:`fedshard.settings`, the same
        rules the server checks.

    Notes
    -----
    Paper, Sec. 3.3. Frobenius decay: with ``G_U = UᵀU``, ``G_V = VᵀV`` the penalty
    ``γ‖U Ω Vᵀ‖²_F = γ tr(Ω G_U Ω G_V)`` has gradients ``∂/∂U = U (2γ ωωᵀ ⊙ G_V)`` and
    ``∂/∂V = V (2γ ωωᵀ ⊙ G_U)``, added to the factors' gradients (after ``backward()``,
    before the step; with several ``backward()`` per step, once per step). ClipLR ("Effective
    learning rate"): ``∂L/∂U = (∂L/∂Ŵ) V Ω``, so ω_i scales the effective learning rate of
    term i; the rule bounds it by τ times the nominal rate, scaling column i's move by
    ``s_i = min(1, τ/ω_i)``: ``u_i ← u_i + s_i (u_i' − u_i)`` with ``u_i'`` the optimizer's
    result. For SGD with momentum this equals the paper's gradient scaling exactly (the
    momentum buffer is linear in the gradients and ``s`` is constant within a round: the
    buffer of scaled gradients is ``s`` times the buffer of unscaled ones); columns with
    ``s_i = 1`` are left exactly as the optimizer moved them. The factors are read at each
    step; what ω gives (``2γ ωωᵀ``, the scales) is computed once per value of ω (ω may be
    overwritten between steps: a new value is noticed by its version counter), and on a CPU
    a step that scales no column skips ClipLR's copy and blend. Nothing waits for an
    accelerator, and a captured CUDA graph of the step computes it all from ω, so its
    replays apply the rules too.
    """

    def __init__(self, layers: Sequence[Factors], *, frobenius_decay: float = 0.0,
                 clip_lr_tau: float | None = None, factor_step: str = "plain",
                 damping: float = DAMPING) -> None:
        try:  # the server's rules for the same settings
            LocalTraining(frobenius_decay=frobenius_decay, clip_lr_tau=clip_lr_tau,
                          factor_step=factor_step)
        except SettingsError as err:
            raise SettingsError("ClientRules", err.found, "no rule was attached") from None
        if not (finite_real(damping) and damping >= 0):
            raise ValueError(f"ClientRules damping={damping!r}: expected a finite number ≥ 0 "
                             f"(default {DAMPING}); no rule was attached.")
        self.layers = list(layers)
        self.gamma = float(frobenius_decay)
        self.tau = clip_lr_tau
        self.dense = factor_step == "dense"
        self.damping = damping
        self.steps = 0
        self.optimizer = ""  # what the first step it applied to was, its lr, and DP-SGD
        self.lr: float | None = None
        self.dp_sgd = False
        self.noise_multiplier: float | None = None
        self.max_grad_norm: float | None = None
        self._dp_told: set[str] = set()
        self._saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # what each layer's ω gives the rules, kept while that ω is unchanged (_OmegaTerms)
        self._terms: dict[int, _OmegaTerms] = {}
        # the optimizers these rules are attached to (each holds its handle): per object, so
        # that attaching twice to one optimizer (every rule applied twice) is refused
        self._attached: weakref.WeakKeyDictionary[torch.optim.Optimizer, RulesHandle] = \
            weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model: nn.Module, recipe: LocalTraining) -> ClientRules:
        """The rules of ``recipe`` (γ, τ, factor step) on every
        :class:`~fedshard.spectral.SpectralLayer` of ``model``."""
        return cls([m for m in model.modules() if isinstance(m, SpectralLayer)],
                   frobenius_decay=recipe.frobenius_decay, clip_lr_tau=recipe.clip_lr_tau,
                   factor_step=recipe.factor_step)

    @property
    def active(self) -> bool:
        """Whether there is anything to do (some layer and some rule)."""
        return bool(self.layers) and (self.gamma != 0 or self.tau is not None or self.dense)

    # ------------------------------------------------------------------ the rule
    @torch.no_grad()
    def before_step(self, layers: Iterable[Factors] | None = None) -> None:
        """Before the optimizer's step: add Frobenius decay's gradient, transform the
        gradients for the dense factor step, and keep the factors for ClipLR."""
        self._saved = []
        for layer in self.layers if layers is None else layers:
            terms = self._omega_terms(layer)
            if self.gamma:
                self._add_decay(layer, terms.decay)
            if self.dense:
                new = dense_layer_gradients(layer, self.damping)  # both read before either is set
                for factor, grad in zip((layer.u, layer.v), new, strict=True):
                    if grad is not None:
                        assert factor.grad is not None
                        factor.grad.copy_(grad)
            if terms.scale is not None and terms.scaled is not None and terms.clips:
                # (else the optimizer's result stays as it is)
                for factor in (layer.u, layer.v):
                    if factor.grad is not None:
                        self._saved.append((factor, factor.detach().clone(), terms.scale,
                                            terms.scaled))

    @torch.no_grad()
    def after_step(self) -> None:
        """After the optimizer's step: scale each column's move by ClipLR's ``min(1, τ/ω_i)``
        (columns it does not scale keep the optimizer's result exactly)."""
        for factor, old, scale, scaled in self._saved:
            clipped = torch.lerp(old, factor, scale)  # old + s (new − old)
            torch.where(scaled, clipped, factor, out=factor)
        self._saved = []
        self.steps += 1

    def _omega_terms(self, layer: Factors) -> _OmegaTerms:
        """What ``layer``'s ω gives the rules (Frobenius decay's ``2γ ωωᵀ``, ClipLR's scale
        and whether it scales any column), computed once per value of ω.

        ω is constant within a round, so these are the same numbers at every step: they are
        kept and computed again only when ω is another tensor or was written in place (its
        version counter, which every in-place write advances). Whether ClipLR scales any
        column is read back once per value of ω; a step that scales none is left exactly as
        the optimizer moved it (what ``where(scale < 1, ...)`` gives). That is read only where
        ω is in host memory (a CPU); on an accelerator it is not (a step never waits for the
        device) and every step applies the scale. While a CUDA graph is being captured,
        nothing is kept: the captured step computes all of it from ω, so that its replays
        follow ω's later values."""
        omega = layer.omega
        on_host = omega.device.type == "cpu"
        if omega.is_cuda and torch.cuda.is_current_stream_capturing():
            return _OmegaTerms.of(omega, self.gamma, self.tau, read_back=False)
        kept = self._terms.get(id(layer))
        if kept is not None and kept.omega is omega and kept.version == omega._version:
            return kept
        kept = _OmegaTerms.of(omega, self.gamma, self.tau, read_back=on_host)
        self._terms[id(layer)] = kept
        return kept

    def _add_decay(self, layer: Factors, weight: torch.Tensor | None = None) -> None:
        """Add Frobenius decay's gradient to ``layer``'s factors' gradients; ``weight``:
        ``2γ ωωᵀ`` (computed from ω when not given)."""
        u, v = layer.u, layer.v  # (a module's attributes are looked up each time)
        if weight is None:
            omega = layer.omega
            weight = 2.0 * self.gamma * (omega.unsqueeze(-1) * omega.unsqueeze(-2))  # 2γ ωωᵀ
        gram_u, gram_v = u.mT @ u, v.mT @ v  # (..., n, n) each
        # U's gradient mixes with V's Gram matrix and vice versa
        for factor, gram in ((u, gram_v), (v, gram_u)):
            grad = factor.grad
            if grad is None:
                if not factor.requires_grad:  # frozen: nothing to decay
                    continue
                factor.grad = grad = torch.zeros_like(factor)
            if factor.ndim == 2:
                grad.addmm_(factor, gram * weight)  # (rows, n) += (rows, n) @ (n, n)
            else:
                grad.add_(factor @ (gram * weight))  # stacked: (C, rows, n)

    # ------------------------------------------------------------------ where it runs
    def attach(self, optimizer: torch.optim.Optimizer) -> RulesHandle:
        """Apply the rules around every ``step()`` of ``optimizer``, and of no other optimizer.

        Registers a step pre-hook (Frobenius decay, the dense factor step, and the factors
        kept for ClipLR) and a step post-hook (ClipLR) on ``optimizer`` itself, for the layers
        whose factors it steps; ``step(closure)`` is supported, L-BFGS's repeated closures are
        not. Attach the rules once to each optimizer that steps the factors (two optimizers,
        e.g. one for ``U`` and one for ``V``, take one attachment each).

        Parameters
        ----------
        optimizer : torch.optim.Optimizer
            Any torch optimizer over (some of) the layers' factors, e.g.
            ``torch.optim.SGD(shard.model.parameters(), ...)``, or the ``DPOptimizer`` that
            Opacus's ``make_private`` returns: the hooks then go on the optimizer it wraps, so
            that the rules act on the privatized gradient (see the module docstring), and
            fedshard's grad samplers are registered with Opacus
            (:func:`fedshard.spectral.register_grad_samplers`).

        Returns
        -------
        RulesHandle
            ``handle.remove()`` (or leaving ``with rules.attach(opt):``) detaches the rules.
            No hook is registered when there is nothing to do (:attr:`active` false).

        Raises
        ------
        TypeError
            If ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError
            If it steps none of these rules' factors (an optimizer of another model), or if
            these rules are already attached to it (they would apply twice).
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"ClientRules attach to a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}; nothing was attached.")
        stepping = _wrapped(optimizer)  # the optimizer whose step() moves the factors
        held = self._layers_of(stepping)
        if self.layers and not held:
            raise ValueError(
                f"ClientRules.attach: the {type(optimizer).__name__} optimizer steps none of "
                f"the factors (u, v) of the {len(self.layers)} sharded layer(s) these rules "
                "were made for; expected an optimizer over the model the rules came with "
                "(e.g. torch.optim.SGD(shard.model.parameters(), ...)), not over a copy of it "
                "(Opacus's ModuleValidator.fix returns a copy: a received sub-model needs no "
                "fix, fix the model given to receive() instead). Nothing was attached.")
        if stepping in self._attached:
            wraps = "" if stepping is optimizer else \
                f" (the {type(stepping).__name__} that this {type(optimizer).__name__} wraps)"
            raise ValueError(
                f"ClientRules.attach: these rules are already attached to this "
                f"{type(optimizer).__name__} optimizer{wraps}; a second attachment would apply "
                "every rule twice per step. Nothing was attached (remove the first handle to "
                "attach again).")
        if stepping is not optimizer:  # a DPOptimizer (Opacus is loaded)
            register_grad_samplers()
            self._note_dp(optimizer)
        if not self.active:
            return RulesHandle(self, optimizer, len(held), [], stepping)

        def rewrite() -> None:
            self._note(stepping, held, optimizer)
            self.before_step(held)

        pre = stepping.register_step_pre_hook(before_step(rewrite))
        post = stepping.register_step_post_hook(lambda *_: self.after_step())
        handle = RulesHandle(self, optimizer, len(held), [pre, post], stepping)
        self._attached[stepping] = handle
        return handle

    def attaching(self, build: Callable[..., Built]) -> Callable[..., Built]:
        """``build`` (a function that builds optimizers) with these rules attached to every
        torch optimizer it returns: for a framework that builds the optimizer itself.

        The result of ``build`` is returned unchanged; the optimizers found in it (the result
        itself, or inside a list, tuple or dict, as PyTorch Lightning's
        ``configure_optimizers`` may return them) get :meth:`attach`. For example, with a
        Lightning module::

            model.configure_optimizers = shard.rules.attaching(model.configure_optimizers)

        Raises
        ------
        TypeError
            When called, if ``build`` returned no torch optimizer (nothing to attach to).
        """

        @functools.wraps(build)
        def built(*args: Any, **kwargs: Any) -> Built:
            result = build(*args, **kwargs)
            found = _optimizers_in(result)
            if not found:
                raise TypeError(
                    f"ClientRules.attaching({getattr(build, '__qualname__', build)!r}): it "
                    f"returned {type(result).__name__}, with no torch.optim.Optimizer in it; "
                    "expected an optimizer (or a list, tuple or dict holding some). No rule "
                    "was attached.")
            for optimizer in found:
                self.attach(optimizer)
            return result

        return built

    def detach(self) -> None:
        """Remove the rules from every optimizer they are attached to."""
        for handle in list(self._attached.values()):
            handle.remove()

    def _note(self, optimizer: torch.optim.Optimizer, layers: Sequence[Factors],
              attached: torch.optim.Optimizer | None = None) -> None:
        """Keep the optimizer of the first step, its lr and whether its gradients were
        privatized by DP-SGD (for the reply's receipt); ``attached``: the optimizer the rules
        were attached to (a ``DPOptimizer`` around ``optimizer``)."""
        if self.optimizer:
            return
        self.optimizer = type(optimizer).__name__
        if attached is not None and attached is not optimizer:  # Opacus's DPOptimizer
            self._note_dp(attached)
        else:  # attached to the optimizer a DPOptimizer wraps: Opacus has just summed the
            # clipped per-example gradients into summed_grad (reset by its zero_grad)
            self.dp_sgd = self.dp_sgd or any(getattr(f, "summed_grad", None) is not None
                                             for layer in layers for f in (layer.u, layer.v))
        ids = {id(f) for layer in layers for f in (layer.u, layer.v)}
        for group in optimizer.param_groups:
            if any(id(p) in ids for p in group["params"]):
                lr = group.get("lr")
                self.lr = float(lr) if isinstance(lr, (int, float)) else None
                return

    def _note_dp(self, dp_optimizer: torch.optim.Optimizer) -> None:
        """Keep an Opacus ``DPOptimizer``'s noise multiplier and clipping norm (read at
        attachment and again at the first step: the values the round trained with)."""
        self.dp_sgd = True
        self.noise_multiplier = _number(getattr(dp_optimizer, "noise_multiplier", None))
        self.max_grad_norm = _number(getattr(dp_optimizer, "max_grad_norm", None))
        problem = dp_sgd_problem(self.noise_multiplier, self.max_grad_norm)
        if problem is not None and problem not in self._dp_told:
            self._dp_told.add(problem)
            logger.warning("DP-SGD (Opacus) is attached, but its %s. Set a noise multiplier "
                           "(make_private(noise_multiplier=...) or target_epsilon=...) and a "
                           "clipping norm (max_grad_norm) near the per-example gradient norms.",
                           problem)

    def _layers_of(self, optimizer: torch.optim.Optimizer) -> list[Factors]:
        """The layers whose factors ``optimizer`` steps, in the rules' order."""
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [m for m in self.layers if id(m.u) in ids or id(m.v) in ids]

    # ------------------------------------------------------------------ what was applied
    @torch.no_grad()
    def report(self) -> RulesReport:
        """What the rules did so far (reads ω: waits for the device once)."""
        scaled = columns = 0
        for layer in self.layers:
            columns += int(layer.omega.numel())
            if self.tau is not None:
                scaled += int((layer.omega > self.tau).sum())
        return RulesReport(self.steps, self.gamma, self.tau,
                           "dense" if self.dense else "plain", scaled, columns,
                           self.optimizer, self.lr, self.dp_sgd, self.noise_multiplier,
                           self.max_grad_norm)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layers={len(self.layers)}, frobenius_decay={self.gamma}, "
                f"clip_lr_tau={self.tau}, factor_step={'dense' if self.dense else 'plain'!r})")


@dataclass(frozen=True)
class _OmegaTerms:
    """What one value of a layer's ω gives the rules (:meth:`ClientRules._omega_terms`).

    Attributes
    ----------
    omega : torch.Tensor
        The ω they were computed from, ``(..., n)``, and its ``version`` then.
    decay : torch.Tensor or None
        Frobenius decay's ``2γ ωωᵀ``, ``(..., n, n)`` (``None`` without decay).
    scale, scaled : torch.Tensor or None
        ClipLR's ``min(1, τ/ω_i)`` and ``scale < 1``, ``(..., 1, n)`` (``None``: ClipLR off).
    clips : bool
        Whether ClipLR scales some column (``True`` when not read back).
    """

    omega: torch.Tensor
    version: int
    decay: torch.Tensor | None
    scale: torch.Tensor | None
    scaled: torch.Tensor | None
    clips: bool

    @classmethod
    def of(cls, omega: torch.Tensor, gamma: float, tau: float | None, *,
           read_back: bool) -> _OmegaTerms:
        """The terms of ``omega`` (the same operations, in the same order, as every step
        computed them before they were kept: the same numbers bit for bit)."""
        decay = 2.0 * gamma * (omega.unsqueeze(-1) * omega.unsqueeze(-2)) if gamma else None
        scale = scaled = None
        clips = True
        if tau is not None:
            scale = torch.clamp(tau / omega, max=1.0).unsqueeze(-2)  # (..., 1, n)
            scaled = scale < 1
            if read_back:
                clips = bool(scaled.any())
        return cls(omega, omega._version, decay, scale, scaled, clips)


def _wrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``step()`` moves the parameters: ``optimizer`` itself, or, for an
    Opacus ``DPOptimizer`` (recognized by its ``original_optimizer``, ``noise_multiplier`` and
    ``max_grad_norm``, without importing Opacus), the optimizer it wraps (innermost)."""
    while True:
        inner = getattr(optimizer, "original_optimizer", None)
        if not (isinstance(inner, torch.optim.Optimizer) and inner is not optimizer
                and hasattr(optimizer, "noise_multiplier")
                and hasattr(optimizer, "max_grad_norm")):
            return optimizer
        optimizer = inner


def _number(value: Any) -> float | None:
    """``value`` as a float if it is a real number, else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _optimizers_in(result: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers in what an optimizer-building function returned (itself, or in a
    list, tuple or dict, nested), each once."""
    found: list[torch.optim.Optimizer] = []
    stack = [result]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.optim.Optimizer):
            if not any(item is f for f in found):
                found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found
