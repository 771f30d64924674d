"""Flower glue for existing projects: a ``ClientApp`` that declares its keep ratio, and a mod
that turns a FedAvg-style ``train`` reply into a shard reply (see ``docs/integration.md``)."""

from __future__ import annotations

from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedshard import protocol as P
from fedshard.client.handlers import handle_query, keep_ratio_of, node_key_of
from fedshard.client.keep_ratios import KeepRatioMixture, KeepRatios, node_keep_ratio
from fedshard.client.shard import receipt_of, receiving, rules_metrics, shard_reply

__all__ = ["ShardingClientApp", "sharding_mod"]


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

    Raises
    ------
    ValueError, TypeError
        For a ``keep_ratios`` that cannot be read (when the app is built, before any round).
    """

    def __init__(self, default_keep_ratio: float | None = None,
                 mods: list[Any] | None = None, *, keep_ratios: KeepRatios | None = None,
                 ) -> None:
        # the capability query is answered before any mod of yours: your mods see only the
        # messages of your handlers (a mod reading msg.content["config"] keeps working)
        super().__init__(mods=[self._capabilities, sharding_mod, *(mods or [])])
        self.default_keep_ratio = default_keep_ratio
        if isinstance(keep_ratios, str):
            keep_ratios = KeepRatioMixture.parse(keep_ratios)  # a bad mix fails here
        elif keep_ratios is not None and not callable(keep_ratios):
            raise TypeError(f"ShardingClientApp(keep_ratios={keep_ratios!r}): expected a mix "
                            "such as \"0.25:0.5,0.5:0.5\", a KeepRatioMixture or a function "
                            "of the node config; no app was built")
        self.keep_ratios = keep_ratios
        self.query()(self._answer)  # Flower needs a query handler; the mod answers first

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
