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
  (:class:`fedshard_lab.engine.batched.BatchedTrainer`);
* ``evaluate``: :func:`~fedshard.client.handlers.handle_evaluate`.

A handler's exception becomes an error reply, as in Flower's runtimes. Each node's data is
read once for the run (:mod:`fedshard_lab.engine.clients`).

Standing in for Flower's runtime takes three things Flower 1.42 has no public API for: the
process's task identity (which ``Message(...)`` reads), a routed message's id and sender, and
the error code of a ClientApp that raised. The engine sets them as Flower's own runners and
in-memory grid do; with a Flower release that keeps them elsewhere the engine fails before
its first round rather than run wrongly.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol
from uuid import uuid4

import flwr
from flwr.app import Error, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode  # not re-exported by flwr.common; pinned by a test
from flwr.serverapp import Grid
from torch import nn
from torch.utils.data import Dataset

from fedshard.app.config import RunConfig
from fedshard.app.task import client_dataset, train_node
from fedshard.client.handlers import (
    SubmodelCache,
    handle_evaluate,
    handle_query,
)
from fedshard_lab.engine.clients import DataSource, SimulatedNode

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
        return train_node(msg, self.cfg, data, model=self.model, device=self.device,
                          fast=self.cfg.fast, submodels=self.submodels)

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
        The federation (:func:`~fedshard_lab.engine.clients.simulated_nodes`).
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
        _ensure_task_identity()  # the strategy's Message(...) needs it; a runtime sets it

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
            _route(msg, src_node_id=_SERVER_NODE_ID, message_id=mid)
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
        _route(reply, src_node_id=node.node_id)
        self._replies[mid] = reply
        self.replies_sent += 1


# ---------------------------------------------------------------------- Flower internals
# What the engine needs of Flower beyond its public API, in one place; each use is checked
# against the installed Flower by tests/test_flower_internals.py, which names the Flower
# version and what moved when a release changes it.

# The node the engine's ServerApp sends from (its task identity's, every pushed message's).
_SERVER_NODE_ID = 0

# The task identity given to a process that has none: run 1, node _SERVER_NODE_ID, task 1.
_ENGINE_TASK_IDENTITY = {"run_id": 1, "node_id": _SERVER_NODE_ID, "task_id": 1}


def _can_build_messages() -> bool:
    """Whether this process can build an instruction message (it has a task identity)."""
    try:
        Message(RecordDict(), dst_node_id=_SERVER_NODE_ID, message_type=MessageType.QUERY)
    except RuntimeError:  # Flower 1.42: "TaskIdentity.run_id is not set."
        return False
    return True


def _ensure_task_identity() -> None:
    """Give this process the task identity Flower's ``Message(...)`` reads, where it has none.

    An instruction message (``Message(content, dst_node_id, message_type)``, as the strategy
    builds each one) takes its run id and its sender's node and task ids from the identity of
    the task the process runs, which Flower's runtimes (``flwr run``, a SuperLink) set before
    a ServerApp starts. The engine runs the ServerApp's code without a runtime, so without
    this every message the strategy builds raises ``RuntimeError``. Flower 1.42 has no public
    setter: the identity is ``flwr.supercore.task_identity.TaskIdentity``, which Flower's own
    Python-API runners (``run_simulation``, ``start_grid``) set the same way. What is unset
    becomes run 1, node 0, task 1; an identity a runtime set is kept.

    Raises
    ------
    RuntimeError
        The installed Flower builds no message without a task identity, and keeps none where
        Flower 1.42 does: the engine cannot run with it.
    """
    if _can_build_messages():
        return
    where = "flwr.supercore.task_identity.TaskIdentity"
    try:
        from flwr.supercore.task_identity import TaskIdentity

        for name, value in _ENGINE_TASK_IDENTITY.items():
            try:
                getattr(TaskIdentity, name)
            except RuntimeError:  # unset
                setattr(TaskIdentity, name, value)
    except (ImportError, AttributeError) as err:
        raise RuntimeError(
            f"flwr {flwr.__version__}: the in-process engine must give this process a task "
            f"identity for Message(...) to work, which flwr 1.42 keeps in {where} (run_id, "
            f"node_id, task_id), but here {type(err).__name__}: {err}. The engine cannot run "
            "with this Flower; run the app with `flwr run`, or install flwr 1.42") from err
    if not _can_build_messages():
        raise RuntimeError(
            f"flwr {flwr.__version__}: the in-process engine set {where} "
            f"({_ENGINE_TASK_IDENTITY}), as flwr 1.42's Message(...) reads it, but a message "
            "still cannot be built: this Flower reads its identity elsewhere. The engine "
            "cannot run with this Flower; run the app with `flwr run`, or install flwr 1.42")


def _route(msg: Message, *, src_node_id: int, message_id: str | None = None) -> None:
    """Set on ``msg`` what a SuperLink sets on a message it routes: its sender
    (``src_node_id``) and, when given, its id (``message_id``; a reply built with
    ``Message(..., reply_to=msg)`` refers to it). Flower's ``Metadata`` has no public setter
    for either; Flower's in-memory grid writes its message ids the same way.

    Raises
    ------
    RuntimeError
        The installed Flower keeps them elsewhere than Flower 1.42 (the write did not show).
    """
    if message_id is not None:
        msg.metadata.__dict__["_message_id"] = message_id
    msg.metadata.__dict__["_src_node_id"] = src_node_id
    if msg.metadata.src_node_id != src_node_id or (
            message_id is not None and msg.metadata.message_id != message_id):
        raise RuntimeError(
            f"flwr {flwr.__version__}: the in-process engine sets a routed message's id and "
            "sender where flwr 1.42 keeps them (Metadata's _message_id and _src_node_id), but "
            f"this Flower's message still reads message_id={msg.metadata.message_id!r}, "
            f"src_node_id={msg.metadata.src_node_id} (expected {message_id!r}, {src_node_id}). "
            "The engine cannot run with this Flower; run the app with `flwr run`, or install "
            "flwr 1.42")
