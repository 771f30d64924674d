"""A Flower ``Grid`` that answers a round's messages in this process, as fedshard's ClientApp
would: :class:`EngineGrid`.

The strategy (:class:`~fedshard.server.strategy.SpectralSharding`) and everything around it
(:func:`fedshard.app.run.run_server`: checks, aggregation, central evaluation, results,
checkpoints) are unchanged; only the delivery of its messages is. Where ``flwr run`` sends each
message through the SuperLink to a ClientApp in a Ray worker, which loads the node's data and
calls fedshard's handlers, this grid calls the same handlers directly:

* ``query``: :func:`~fedshard.client.handlers.handle_query` with the node's declared keep ratio
  and its ``partition-id`` as the stable key (what ``client_app.py`` answers);
* ``train``: all of a round's train messages go to one :data:`Trainer` together: one after
  another with :func:`~fedshard.client.handlers.handle_train` (:class:`SequentialTrainer`), or
  clients of the same sub-model shapes as one vectorized model
  (:class:`fedshard.app.engine.batched.BatchedTrainer`);
* ``evaluate``: :func:`~fedshard.client.handlers.handle_evaluate`.

A handler's exception becomes an error reply, as in Flower's runtimes. Each node's data is
read once for the run (:mod:`fedshard.app.engine.clients`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol
from uuid import uuid4

from flwr.app import Error, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity
from torch import nn
from torch.utils.data import Dataset

from fedshard.app.config import RunConfig
from fedshard.app.engine.clients import DataSource, SimulatedNode
from fedshard.app.task import client_dataset
from fedshard.client.handlers import (
    SubmodelCache,
    handle_evaluate,
    handle_query,
    handle_train,
)

__all__ = ["EngineGrid", "SequentialTrainer", "TrainJob", "Trainer"]

logger = logging.getLogger(__name__)

#: One node's train message and its training data.
TrainJob = tuple[Message, Dataset[Any]]


class Trainer(Protocol):
    """Trains a round's jobs; one reply (or the exception that replaces it) per job, in order."""

    def __call__(self, jobs: Sequence[TrainJob]) -> list[Message | Exception]: ...


class SequentialTrainer:
    """The clients one after another with fedshard's handler
    (:func:`~fedshard.client.handlers.handle_train`), as the ClientApp trains each.

    Parameters
    ----------
    model : nn.Module
        The run's model (only read: ``handle_train`` copies what it trains).
    cfg : RunConfig
        The run (its ``compile``, ``cuda-graph``, ``merge-terms`` node options).
    device : str
        Where to train.
    """

    def __init__(self, model: nn.Module, cfg: RunConfig, device: str) -> None:
        self.model, self.cfg, self.device = model, cfg, device
        # one node's sub-model is the next one's of the same shape (no copy of the model)
        self.submodels = SubmodelCache(model)

    def one(self, msg: Message, data: Dataset[Any]) -> Message:
        """One client's reply (raises what the handler raises)."""
        return handle_train(msg, self.model, data, device=self.device, compile=self.cfg.compile,
                            cuda_graph=self.cfg.cuda_graph, merge_terms=self.cfg.merge_terms,
                            submodels=self.submodels)

    def __call__(self, jobs: Sequence[TrainJob]) -> list[Message | Exception]:
        replies: list[Message | Exception] = []
        for msg, data in jobs:
            try:
                replies.append(self.one(msg, data))
            except Exception as err:  # the ClientApp's exception is that node's error reply
                replies.append(err)
        return replies


class EngineGrid(Grid):
    """A Flower ``Grid`` of simulated nodes answered in process (see the module docstring).

    Parameters
    ----------
    cfg : RunConfig
        The run's validated configuration (what every simulated ClientApp would read).
    nodes : list of SimulatedNode
        The federation (:func:`~fedshard.app.engine.clients.simulated_nodes`).
    model : nn.Module
        The run's model as the ClientApp builds it (:func:`fedshard.app.task.build_model`);
        only read.
    trainer : Trainer, optional
        How a round's train messages are trained; default :class:`SequentialTrainer`.
    device : str
        Where the nodes train and evaluate (the run's resolved ``client-device``).
    data : DataSource, optional
        A node's training data by ``(partition-id, num-partitions)``; default the run's
        (:func:`fedshard.app.task.client_dataset`).

    Attributes
    ----------
    replies_sent : int
        Replies produced so far (error replies included).
    """

    def __init__(self, cfg: RunConfig, nodes: list[SimulatedNode], model: nn.Module, *,
                 trainer: Trainer | None = None, device: str = "cpu",
                 data: DataSource | None = None) -> None:
        self.cfg = cfg
        self.nodes = {node.node_id: node for node in nodes}
        self.model = model
        self.device = device
        self.trainer: Trainer = trainer or SequentialTrainer(model, cfg, device)
        self.data: DataSource = data or (lambda pid, num: client_dataset(cfg, pid, num))
        self._eval_model: nn.Module | None = None
        self._replies: dict[str, Message] = {}
        self.replies_sent = 0
        try:  # a Message needs the process's task identity; a ServerApp process has one
            _ = TaskIdentity.run_id
        except RuntimeError:
            TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1

    # ------------------------------------------------------------------ the Grid interface
    def set_run(self, run: Any) -> None:
        """Nothing to do: the engine serves one run."""

    @property
    def run(self) -> Any:
        """Not available: the engine has no SuperLink run record."""
        raise NotImplementedError("the in-process engine has no SuperLink run record")

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        """A message (Flower's deprecated helper; the strategy uses ``Message(...)``)."""
        return Message(content, dst_node_id=dst_node_id, message_type=message_type,
                       group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The simulated nodes' ids."""
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Answer ``messages`` now; their replies wait for :meth:`pull_messages`."""
        batch = list(messages)
        ids = []
        jobs: list[TrainJob] = []
        train_ids: list[str] = []
        for msg in batch:
            mid = uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            msg.metadata.__dict__["_src_node_id"] = 0
            ids.append(mid)
            node = self.nodes.get(msg.metadata.dst_node_id)
            if node is None:
                continue  # an unknown node never answers, as on a real SuperLink
            try:
                if msg.metadata.message_type == MessageType.TRAIN:
                    jobs.append((msg, node.training_data(self.cfg, self.data, self.device)))
                    train_ids.append(mid)
                    continue
                reply = self._answer(msg, node)
            except Exception as err:
                reply = self._error(msg, err)
            self._keep(mid, node, reply)
        if jobs:
            for mid, (msg, _), out in zip(train_ids, jobs, self.trainer(jobs), strict=True):
                node = self.nodes[msg.metadata.dst_node_id]
                self._keep(mid, node, self._error(msg, out) if isinstance(out, Exception)
                           else out)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` that are ready (all of them, in this engine)."""
        return [self._replies.pop(m) for m in message_ids if m in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages`` and return their replies (``timeout`` is not needed: the replies
        are ready when the push returns)."""
        return list(self.pull_messages(self.push_messages(messages)))

    # ------------------------------------------------------------------ the nodes' side
    def _answer(self, msg: Message, node: SimulatedNode) -> Message:
        kind = msg.metadata.message_type
        if kind == MessageType.QUERY:
            if node.keep_ratio is None:
                raise ValueError(node.keep_ratio_error)
            return handle_query(msg, node.keep_ratio, str(node.partition_id))
        if kind == MessageType.EVALUATE:
            if self._eval_model is None:  # handle_evaluate loads the weights into it
                self._eval_model = copy.deepcopy(self.model)
            return handle_evaluate(msg, self._eval_model,
                                   node.training_data(self.cfg, self.data, self.device),
                                   device=self.device)
        raise ValueError(f"message type {kind!r}: fedshard's ClientApp answers query, train "
                         "and evaluate messages only")

    def _error(self, msg: Message, err: Exception) -> Message:
        logger.warning("node %d: %s: %s (its reply is an error)", msg.metadata.dst_node_id,
                       type(err).__name__, err)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(err)),
                       reply_to=msg)

    def _keep(self, mid: str, node: SimulatedNode, reply: Message) -> None:
        reply.metadata.__dict__["_src_node_id"] = node.node_id
        self._replies[mid] = reply
        self.replies_sent += 1
