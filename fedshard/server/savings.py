"""What sharding bought a run: per client, the bytes it received and sent and its sub-model's
forward FLOPs against the dense model; the final accuracy against an r = 1 reference run.

Every run of the library's strategies ends with it (:class:`SavingsReport`, one of their
default callbacks: the log line; forward FLOPs where the strategy was given an example input,
``from_model(..., example_input=...)``); fedshard's app also writes it to ``summary.json``'s
``"sharding"`` entry. Bytes are the ones measured on the round's real
messages (the ``bytes-sent-ratio-r<r>`` and ``bytes-received-ratio-r<r>`` columns of
``metrics.jsonl``, averaged over the rounds); FLOPs are counted by
:class:`torch.utils.flop_counter.FlopCounterMode` on the sub-model a client at keep ratio ``r``
trains (``⌈rN⌉`` terms of each sharded layer), by the same functions as the budget the
strategy logs before the first round (:func:`fedshard.spectral.sharding_budget`).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord
from torch import nn

from fedshard.server.callbacks import RoundCallback

# the counting lives with the budget that the strategy logs before the first round
from fedshard.spectral import forward_flops, submodel_at

__all__ = ["SavingsReport", "forward_flops", "reference_summary", "savings_line",
           "sharding_savings", "submodel_at"]

logger = logging.getLogger(__name__)

_RATIO_KEY = re.compile(r"^bytes-sent-ratio-r(.+)$")


def sharding_savings(rows: Sequence[Mapping[str, Any]], model: nn.Module | None,
                     layers: Sequence[str],
                     example_input: torch.Tensor | None,
                     reference: Mapping[str, Any] | None = None, *,
                     submodel: Callable[[float], nn.Module] | None = None) -> dict[str, Any]:
    """The ``"sharding"`` entry of ``summary.json``.

    Parameters
    ----------
    rows : sequence of mapping
        The run's ``metrics.jsonl`` rows; the keep ratios are those of the
        ``bytes-sent-ratio-r<r>`` columns (every ratio some node was sent).
    model : nn.Module or None
        The run's dense model (not modified; only its shapes matter); needed for FLOPs only.
    layers : sequence of str
        Its sharded layers.
    example_input : torch.Tensor or None
        One example's input (batch of 1); ``None``: FLOPs are not counted (the entries'
        ``forward-flops`` are left out).
    reference : mapping or None
        :func:`reference_summary`'s result, or ``None`` (no reference run named).
    submodel : callable, optional
        ``submodel(r)``: the model a client at keep ratio ``r`` trains, whose FLOPs are
        counted (width slicing: its narrow model); default :func:`submodel_at` of ``layers``.

    Returns
    -------
    dict
        ``dense``: ``bytes`` (the model's arrays) and ``forward-flops``; ``clients``: per keep
        ratio ``r<r>``, per client and round, ``bytes-received`` (server → client),
        ``bytes-sent`` (client → server), ``forward-flops`` (per example), each with its
        ``-ratio`` to the dense model, and ``nodes-per-round``; ``reference`` as given, with
        this run's ``final-test-accuracy`` and the ``accuracy-difference`` added.
    """
    x = example_input.cpu() if example_input is not None and model is not None else None
    dense_model = copy.deepcopy(model).cpu() if x is not None and model is not None else None
    dense_flops = forward_flops(dense_model, x) if dense_model is not None else None
    dense_bytes = [float(r["dense-bytes"]) for r in rows if "dense-bytes" in r]
    clients: dict[str, dict[str, float]] = {}
    ratios = sorted({float(m.group(1)) for r in rows for k in r if (m := _RATIO_KEY.match(k))})
    for ratio in ratios:
        key = f"r{ratio:g}"
        down = [float(r[f"bytes-sent-ratio-{key}"]) * float(r["dense-bytes"]) for r in rows
                if f"bytes-sent-ratio-{key}" in r]
        up = [float(r[f"bytes-received-ratio-{key}"]) * float(r["dense-bytes"]) for r in rows
              if f"bytes-received-ratio-{key}" in r]
        entry = {"bytes-received": _mean(down), "bytes-sent": _mean(up)}
        if dense_model is not None and x is not None:
            trained = (submodel(ratio) if submodel is not None
                       else submodel_at(dense_model, layers, ratio))
            flops = forward_flops(trained, x)
            entry["forward-flops"] = float(flops)
        if dense_bytes:
            entry["bytes-received-ratio"] = entry["bytes-received"] / dense_bytes[-1]
            entry["bytes-sent-ratio"] = entry["bytes-sent"] / dense_bytes[-1]
        if "forward-flops" in entry:
            entry["forward-flops-ratio"] = flops / dense_flops if dense_flops else math.nan
        clients[key] = entry
    out: dict[str, Any] = {
        "dense": {"bytes": dense_bytes[-1] if dense_bytes else None,
                  **({"forward-flops": float(dense_flops)} if dense_flops is not None else {})},
        "clients": clients,
        "reference": None,
    }
    if reference is not None:
        accs = [float(r["test-accuracy"]) for r in rows if "test-accuracy" in r]
        final = accs[-1] if accs else None
        ref = dict(reference)
        ref["final-test-accuracy-here"] = final
        ref_acc = ref.get("final-test-accuracy")
        ref["accuracy-difference"] = (final - ref_acc if final is not None
                                      and isinstance(ref_acc, (int, float)) else None)
        out["reference"] = ref
    return out


def reference_summary(name: str, results_dir: Path) -> dict[str, Any]:
    """The reference run's final accuracy: ``name`` is a run name in ``results_dir`` or a
    path; its ``summary.json`` gives ``final-test-accuracy``.

    Returns ``{"run": <path>, "final-test-accuracy": <float or None>, "problem": <str or
    None>}``: a reference that cannot be read is reported, never fatal (the run is done).
    """
    path = Path(name).expanduser()
    if not path.is_absolute():
        path = results_dir / path
    out: dict[str, Any] = {"run": str(path), "final-test-accuracy": None, "problem": None}
    try:
        summary = json.loads((path / "summary.json").read_text())
        acc = summary.get("final-test-accuracy") if isinstance(summary, dict) else None
        if not isinstance(acc, (int, float)) or isinstance(acc, bool):
            out["problem"] = (f"{path / 'summary.json'} holds no final-test-accuracy "
                              f"(found {acc!r})")
        else:
            out["final-test-accuracy"] = float(acc)
    except (OSError, ValueError) as err:
        out["problem"] = f"{path / 'summary.json'} cannot be read ({err})"
    return out


def savings_line(savings: Mapping[str, Any]) -> str:
    """One log line: per keep ratio, MB received/sent and forward FLOPs (where counted)
    against dense, and the accuracy against the reference."""
    parts = []
    for key, c in savings["clients"].items():
        part = (f"{key.replace('r', 'r = ', 1)}: received {c['bytes-received'] / 1e6:.3g} MB "
                f"({c.get('bytes-received-ratio', math.nan):.2f}x), sent "
                f"{c['bytes-sent'] / 1e6:.3g} MB ({c.get('bytes-sent-ratio', math.nan):.2f}x)")
        if "forward-flops" in c:
            part += (f", forward {c['forward-flops'] / 1e6:.3g} MFLOP/example "
                     f"({c['forward-flops-ratio']:.2f}x)")
        parts.append(part)
    dense = savings["dense"]
    flops = (f", {dense['forward-flops'] / 1e6:.3g} MFLOP/example"
             if "forward-flops" in dense else "")
    line = ("what sharding bought, per client and round against the dense model ("
            f"{(dense['bytes'] or math.nan) / 1e6:.3g} MB{flops}): " + "; ".join(parts))
    ref = savings.get("reference")
    if ref:
        if ref.get("accuracy-difference") is not None:
            line += (f"; final test accuracy {ref['final-test-accuracy-here']:.2%} vs "
                     f"{ref['final-test-accuracy']:.2%} at r = 1 ({ref['run']}): "
                     f"{100 * ref['accuracy-difference']:+.1f} points")
        else:
            line += f"; no accuracy comparison: {ref.get('problem') or 'no test accuracy'}"
    return line


class SavingsReport(RoundCallback):
    """Ends a run with what sharding bought (:func:`savings_line`, logged at INFO): per keep
    ratio, the bytes a node received and sent per round against the dense model, measured on
    the rounds' real messages, and, where the strategy has its model and an example input
    (``from_model(..., example_input=...)``), the forward FLOPs of the model it trained.
    :attr:`savings` keeps the result (:func:`sharding_savings`). A run whose length is unknown
    has no end, and nothing is said."""

    def __init__(self) -> None:
        self.savings: dict[str, Any] | None = None

    def on_end(self, strategy: Any, arrays: ArrayRecord) -> None:
        rows = [dict(metrics, round=r) for r, metrics in sorted(strategy.history.items())]
        if not any(_RATIO_KEY.match(k) for row in rows for k in row):
            return  # no round sent anything: the stop callbacks say why
        # SpectralSharding.from_model keeps its model as budget_model, WidthSlicing as model
        model = getattr(strategy, "budget_model", None) or getattr(strategy, "model", None)
        x = getattr(strategy, "example_input", None) if model is not None else None
        narrow = None
        family = getattr(strategy, "family", None)
        if family is not None and hasattr(strategy, "width_of"):
            def narrow(r: float) -> nn.Module:
                return family(strategy.width_of(r).width)
        try:
            self.savings = sharding_savings(rows, model, strategy.sharded_layers, x,
                                            submodel=narrow)
        except Exception as err:  # a report at the end must not fail a finished run
            logger.warning("what sharding bought could not be counted (%s: %s)",
                           type(err).__name__, err)
            return
        logger.info("%s", savings_line(self.savings))


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else math.nan
