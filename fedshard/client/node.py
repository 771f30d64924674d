"""A node's answer to any ``train`` message, whatever the server's method asks:
:func:`train_kind` and :func:`handle_node_train`, the one client dispatch that fedshard's
ClientApp and its in-process engines share.

A ``train`` message names its method (:class:`fedshard.protocol.TrainSettings`'s
``sharding_method``). Spectral sharding and FedAvg (``"none"``) send a shard of the run's
model (:func:`~fedshard.client.handlers.handle_train`); width slicing's methods
(:data:`~fedshard.settings.WIDTH_METHODS`) send a narrow model of the run's width family
(:func:`~fedshard.client.width.handle_width_train`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, Literal, TypeVar

from flwr.app import Message
from torch import nn
from torch.utils.data import Dataset

from fedshard import protocol as P
from fedshard.client.handlers import Loader, SubmodelCache, handle_train
from fedshard.client.train.config import FastPath
from fedshard.client.width import handle_width_train
from fedshard.settings import WIDTH_METHODS, wire_key
from fedshard.width.slicing import WidthFamily

__all__ = ["TrainKind", "handle_node_train", "train_kind"]

#: What a ``train`` message asks a node to train: ``"shard"`` (a sub-model of the run's
#: model, or the dense model itself for FedAvg) or ``"slice"`` (a narrow model of width
#: slicing).
TrainKind = Literal["shard", "slice"]

#: The ``train`` config key of the message's method, as :class:`fedshard.protocol.TrainSettings`
#: declares it.
_METHOD = str(next(wire_key(f) for f in fields(P.TrainSettings) if f.name == "sharding_method"))

Built = TypeVar("Built")


def train_kind(msg: Message) -> TrainKind:
    """What ``msg`` asks this node to train: ``"slice"`` when its method is one of width
    slicing's, else ``"shard"`` (a message without a method is read, and refused, as a
    shard's: :meth:`fedshard.protocol.TrainSettings.from_record` says what is missing)."""
    config = msg.content.config_records.get(P.CONFIG)
    method = config.get(_METHOD) if config is not None else None
    return "slice" if method in WIDTH_METHODS else "shard"


def handle_node_train(msg: Message, data: Dataset[Any] | Loader, *,
                      model: nn.Module | Callable[[], nn.Module] | None = None,
                      family: WidthFamily | Callable[[], WidthFamily] | None = None,
                      device: str = "cpu", fast: FastPath | None = None,
                      submodels: SubmodelCache | None = None, **options: Any) -> Message:
    """Train what ``msg`` asks (:func:`train_kind`) on ``data``; the reply.

    Parameters
    ----------
    msg : flwr.app.Message
        A ``train`` message of spectral sharding, FedAvg or width slicing.
    data : Dataset, DataLoader or TensorBatches
        This node's training data (as :func:`~fedshard.client.handlers.handle_train` takes it).
    model : nn.Module or callable, optional
        The run's model (only read), or a function that returns it (called only for a shard
        message); needed for a shard message.
    family : WidthFamily or callable, optional
        The run's model at any width, or a function that returns it (called only for a slice
        message); needed for a width-slicing message.
    device : str
        Where to train.
    fast : FastOptions, optional
        The fast path, for either kind (ordered dropout refuses an enabled one:
        :func:`~fedshard.client.width.handle_width_train`).
    submodels : SubmodelCache, optional
        Sub-models of ``model`` kept between calls, for shard messages (a slice message's
        narrow model is built from ``family``, which the cache does not hold).
    **options
        This node's own :class:`~fedshard.client.train.TrainConfig` fields, for either kind.

    Returns
    -------
    flwr.app.Message
        The reply of :func:`~fedshard.client.handlers.handle_train` or
        :func:`~fedshard.client.width.handle_width_train`.

    Raises
    ------
    ValueError
        If the message asks for a kind whose model was not given, or as those handlers do.
    """
    if train_kind(msg) == "slice":
        if family is None:
            raise ValueError(
                f"handle_node_train: the message's method is width slicing's "
                f"({_method_of(msg)!r}), which trains a narrow model of the run's width family; "
                "expected family=... (a WidthFamily), found none. This round is not trained.")
        return handle_width_train(msg, _built(family, WidthFamily), data, device=device,
                                  fast=fast, **options)
    if model is None:
        raise ValueError(
            f"handle_node_train: the message's method is {_method_of(msg)!r}, which trains a "
            "shard of the run's model; expected model=... (the model the server was started "
            "with), found none. This round is not trained.")
    return handle_train(msg, _built(model, nn.Module), data, device=device, fast=fast,
                        submodels=submodels, **options)


def _built(given: Built | Callable[[], Built], kind: type[Built]) -> Built:
    """``given`` itself when it is a ``kind``, else what the function ``given`` returns."""
    if isinstance(given, kind):
        return given
    assert callable(given)
    return given()


def _method_of(msg: Message) -> Any:
    config = msg.content.config_records.get(P.CONFIG)
    return config.get(_METHOD) if config is not None else None
