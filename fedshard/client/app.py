"""Flower glue for existing projects: a ``ClientApp`` that declares its keep ratio, and a mod
that turns a FedAvg-style ``train`` reply into a shard reply (see ``docs/integration.md``).

The app is a ClientApp of Flower's Message API: a legacy ``client_fn`` is refused when the app
is built (:class:`~fedshard.protocol.LegacyApiError`), and so are Flower's mods that assume
every node sends the dense model's arrays (:func:`refused_mod`): ``LocalDpMod``, the
central-DP clipping mods and the secure-aggregation mods.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedshard import protocol as P
from fedshard.client.clipping import clip_update_mod
from fedshard.client.handlers import handle_query, keep_ratio_of, node_key_of
from fedshard.client.keep_ratios import KeepRatioMixture, KeepRatios, node_keep_ratio
from fedshard.client.shard import receipt_of, receiving, rules_metrics, shard_reply

__all__ = ["ShardingClientApp", "refused_mod", "sharding_mod"]

#: Why Flower's own mods cannot wrap a fedshard node, by the mod's name (functions) or class.
_REFUSED_MODS = {
    "LocalDpMod": (
        "it clips and noises each reply array against the sent array of the same key (local "
        "DP on the dense model's update), and a shard reply has other keys (ω is left out, the "
        "term indices are echoed) and factor arrays whose change is not the model's change, so "
        "it answers every train message with an error reply (the training is lost). For "
        "differential privacy on a node, train the received sub-model with DP-SGD (Opacus's "
        "PrivacyEngine.make_private on shard.model, then shard.rules.attach(dp_optimizer)): "
        "docs/integration.md, \"Differential privacy and secure aggregation\""),
    "fixedclipping_mod": (
        "it clips the node's update for Flower's central-DP strategy wrappers "
        "(DifferentialPrivacyClientSide*Clipping), which assume every node sends the dense "
        "model's arrays and cannot drive SpectralSharding (the strategy refuses them)"),
    "adaptiveclipping_mod": (
        "it clips the node's update for Flower's central-DP strategy wrappers "
        "(DifferentialPrivacyClientSideAdaptiveClipping), which assume every node sends the "
        "dense model's arrays and cannot drive SpectralSharding (the strategy refuses them)"),
    "secaggplus_mod": (
        "SecAgg+ masks each node's reply so that only the sum over nodes can be read, which "
        "needs every node to send a vector of the same length in the same order; fedshard's "
        "nodes send different terms, of different shapes (and the server averages each term "
        "over the nodes that hold it, not over all). Secure aggregation is not supported"),
    "secagg_mod": (
        "SecAgg masks each node's reply so that only the sum over nodes can be read, which "
        "needs every node to send a vector of the same length in the same order; fedshard's "
        "nodes send different terms, of different shapes. Secure aggregation is not "
        "supported"),
}


def refused_mod(mod: object) -> str | None:
    """Why Flower's mod ``mod`` cannot wrap a fedshard node's handlers, or ``None`` for a mod
    that can (your own, ``arrays_size_mod``, ``message_size_mod``, ...).

    Recognized by name: ``LocalDpMod`` (an instance), ``fixedclipping_mod``,
    ``adaptiveclipping_mod``, ``secagg_mod`` and ``secaggplus_mod``, from ``flwr.clientapp.mod``
    or the legacy ``flwr.client.mod``.
    """
    if isinstance(mod, type):
        return None
    function = inspect.isfunction(mod)
    module = mod.__module__ if function else type(mod).__module__
    if not module.startswith("flwr."):
        return None  # a mod of yours, whatever its name
    return _REFUSED_MODS.get(_mod_name(mod))


def _check_mods(mods: Sequence[Any] | None, where: str) -> list[Any]:
    """``mods`` as a list; ``ValueError`` naming every mod that cannot wrap a fedshard node."""
    mods = list(mods or [])
    found = [(m, refused_mod(m)) for m in mods]
    refused = [(m, why) for m, why in found if why is not None]
    if refused:
        lines = "; ".join(f"{_mod_name(m)}: {why}" for m, why in refused)
        raise ValueError(
            f"{where}(mods=[...]) got Flower's {', '.join(_mod_name(m) for m, _ in refused)}, "
            f"which cannot wrap a node of spectral model sharding: {lines}. No app was built "
            "(nothing was sent): leave these mods out.")
    return mods


def _mod_name(mod: object) -> str:
    """A function's name, else the object's class name (``LocalDpMod(...)``)."""
    return str(mod.__name__) if inspect.isfunction(mod) else type(mod).__name__


def sharding_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """A Flower mod that turns a ``train`` handler written for FedAvg into a fedshard one.

    Your handler loads the sub-model with ``shard = receive(msg, Net())``, attaches the client
    rules to its optimizer (``shard.rules.attach(optimizer)``), trains ``shard.model`` and
    replies as for FedAvg (``ArrayRecord(model.state_dict())`` and a ``MetricRecord`` with
    ``num-examples``); the mod re-encodes that reply in the wire format (ω left out, the term
    indices echoed) with the same checks as :meth:`Shard.reply`, the metric ``clip-lr-terms``
    (with a WARNING when no optimizer step applied the client rules) and the receipt of what
    the node trained with. It learns what the rules did from the shards the handler received
    while the mod waited for it (:func:`fedshard.client.shard.receiving`). Other replies pass
    unchanged.
    """
    with receiving() as received:
        reply = call_next(msg, context)
    if msg.metadata.message_type != "train" or reply.has_error():
        return reply
    sent = msg.content.array_records.get(P.ARRAYS)
    arrays = reply.content.array_records.get(P.ARRAYS)
    if sent is None or arrays is None or not any(k.endswith(".indices") for k in sent) \
            or any(k.endswith(".indices") for k in arrays):
        return reply  # not a shard, or already encoded (Shard.reply)
    metrics = dict(reply.content.metric_records.get(P.METRICS, {}))
    num_examples = metrics.pop(P.NUM_EXAMPLES, None)
    # the shards of this message the handler received; of several (a handler that receives
    # it twice), the last one whose rules applied to an optimizer step
    mine = [s for s in received if s.message is msg or (
        msg.metadata.message_id and s.message.metadata.message_id == msg.metadata.message_id)]
    stepped = [s for s in mine if s.rules.steps]
    rules = (stepped or mine)[-1].rules if mine else None
    receipt = None
    if rules is not None:
        report = rules.report()
        metrics.update(rules_metrics(report, rules.active))
        receipt = receipt_of(report)
    lr = P.TrainSettings.from_record(msg.content.config_records[P.CONFIG]).base_lr
    return shard_reply(msg, {k: P.decode_array(a) for k, a in arrays.items()}, num_examples,
                       metrics, lr, receipt)


class ShardingClientApp(ClientApp):
    """A ``ClientApp`` that takes part in spectral model sharding: it answers the server's
    capability query with the node's keep ratio (the node's ``partition-id`` as its stable key)
    and applies :func:`sharding_mod` to its handlers.

    Drop-in for ``ClientApp()``; register ``train``/``evaluate`` as usual.

    Parameters
    ----------
    default_keep_ratio : float, optional
        The ratio of a node that names none (see :func:`keep_ratio_of`).
    mods : list, optional
        Your Flower mods, after :func:`sharding_mod`. fedshard's capability query is answered
        before them, so they see only your handlers' messages (``train``, ``evaluate``, your
        own queries), each with its ``"config"`` record.
    keep_ratios : str, KeepRatioMixture or callable, optional
        The keep ratios of the simulated nodes in one line: a mix such as
        ``"0.25:0.5,0.5:0.5"`` (half the partitions keep 25 % of the terms, half 50 %; partition
        id p gets the ratio fedshard's own app gives it) or ``f(node_config) -> ratio``. A node
        whose node config has ``keep-ratio`` (a deployed SuperNode) declares that instead; a
        deployed node without one is an error that says what to set
        (:func:`fedshard.client.keep_ratios.node_keep_ratio`). Without it the ratio is
        :func:`keep_ratio_of`'s (node config, run config ``keep-ratio`` or ``keep-ratios``,
        ``default_keep_ratio``).
    clipping_norm : float, optional
        S > 0: every ``train`` update is clipped to L2 norm S before it is sent
        (:func:`~fedshard.client.clipping.clip_update_mod`, placed after the reply is encoded),
        for a server running central DP (``Privacy.clipping_norm``).

    client_fn : callable, optional
        Refused: a ``client_fn`` (Flower's legacy API) raises
        :class:`~fedshard.protocol.LegacyApiError` naming the migration to the Message API.

    Raises
    ------
    ValueError, TypeError
        For a ``keep_ratios`` that cannot be read, or one of Flower's mods that cannot wrap a
        fedshard node (:func:`refused_mod`: ``LocalDpMod``, the DP clipping and
        secure-aggregation mods), in ``mods`` or in a handler's ``@app.train(mods=...)``
        (when the app is built, before any round).
    fedshard.protocol.LegacyApiError
        (a ``TypeError``) for a ``client_fn``.
    """

    def __init__(self, default_keep_ratio: float | None = None,
                 mods: list[Any] | None = None, *, keep_ratios: KeepRatios | None = None,
                 clipping_norm: float | None = None,
                 client_fn: Callable[..., Any] | None = None) -> None:
        if client_fn is not None or callable(default_keep_ratio):
            raise P.legacy_api_error(
                "ShardingClientApp(client_fn=...) got a client_fn, which builds a legacy "
                "NumPyClient/Client",
                "app = ShardingClientApp(); @app.train() def train(msg, context): shard = "
                "receive(msg, Net()); ... return shard.reply(num_examples=...)",
                "No app was built.")
        # the capability query is answered before any mod of yours: your mods see only the
        # messages of your handlers (a mod reading msg.content["config"] keeps working)
        mods = _check_mods(mods, "ShardingClientApp")
        # node-side clipping sees the reply once sharding_mod has encoded it
        clip = [] if clipping_norm is None else [clip_update_mod(clipping_norm)]
        super().__init__(mods=[self._capabilities, *clip, sharding_mod, *mods])
        self.default_keep_ratio = default_keep_ratio
        if isinstance(keep_ratios, str):
            keep_ratios = KeepRatioMixture.parse(keep_ratios)  # a bad mix fails here
        elif keep_ratios is not None and not callable(keep_ratios):
            raise TypeError(f"ShardingClientApp(keep_ratios={keep_ratios!r}): expected a mix "
                            "such as \"0.25:0.5,0.5:0.5\", a KeepRatioMixture or a function "
                            "of the node config; no app was built")
        self.keep_ratios = keep_ratios
        self.query()(self._answer)  # Flower needs a query handler; the mod answers first

    def train(self, action: str = "default", *, mods: list[Any] | None = None) -> Any:
        """Flower's ``@app.train()``; a refused mod (:func:`refused_mod`) raises
        ``ValueError``."""
        return super().train(action, mods=_check_mods(mods, "@app.train") or None)

    def evaluate(self, action: str = "default", *, mods: list[Any] | None = None) -> Any:
        """Flower's ``@app.evaluate()``; a refused mod (:func:`refused_mod`) raises
        ``ValueError``."""
        return super().evaluate(action, mods=_check_mods(mods, "@app.evaluate") or None)

    def query(self, action: str = "default", *, mods: list[Any] | None = None) -> Any:
        """Flower's ``@app.query()``; a refused mod (:func:`refused_mod`) raises
        ``ValueError``."""
        return super().query(action, mods=_check_mods(mods, "@app.query") or None)

    def _capabilities(self, msg: Message, context: Context, call_next: Any) -> Message:
        """A mod, the app's first: answers fedshard's capability query and passes every other
        message on."""
        if not P.is_capability_query(msg):
            return call_next(msg, context)
        return self._answer(msg, context)

    def _answer(self, msg: Message, context: Context) -> Message:
        """This node's keep ratio and stable key (:func:`node_key_of`)."""
        ratio = (keep_ratio_of(context, self.default_keep_ratio) if self.keep_ratios is None
                 else node_keep_ratio(context.node_config, self.keep_ratios))
        return handle_query(msg, ratio, node_key_of(context))
