"""The client side of fedshard's app: the run's model, this node's data, its keep ratio.

What the ClientApp needs from a validated :class:`~fedshard.app.config.RunConfig` (and what the
ServerApp shares with it: the model builder). The server's orchestration is in
:mod:`fedshard.app.run`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections import OrderedDict
from collections.abc import Iterator
from logging import DEBUG, INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Message
from flwr.common.logger import log
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedshard import protocol as P
from fedshard.app.config import CHARGPT_HEADS, RunConfig
from fedshard.client.keep_ratios import (  # re-exported: the library's rule
    SIMULATION_NODE_CONFIG,
    is_simulated_node,
    node_keep_ratio,
)
from fedshard.client.memory import MemoryFit, keep_ratio_for_memory
from fedshard.client.node import handle_node_train
from fedshard.client.train import TrainConfig
from fedshard.data import (
    DataFormatError,
    ImageDataset,
    dataset_info,
    load_held_out,
    load_partition,
)
from fedshard.sampling import as_keep_ratio
from fedshard.server.trusted import TrustedReference
from fedshard.width import WidthFamily

__all__ = [
    "CLIENT_DATA_CACHE_BYTES",
    "LOW_MEMORY",
    "RUNTIME_GRIDS",
    "RUNTIME_KEY",
    "SIMULATION_NODE_CONFIG",
    "build_model",
    "client_dataset",
    "declared_keep_ratio",
    "example_input",
    "grid_runtime",
    "is_simulated_node",
    "low_memory_of",
    "node_capacity",
    "node_partition",
    "resolve_device",
    "template_model",
    "train_node",
    "trusted_reference",
    "warn_if_looks_simulated",
    "width_family",
]


def template_model(cfg: RunConfig) -> nn.Module:
    """:func:`build_model`'s model, built once per process and shared by every call with the
    same model settings: **never modify it** (pass it where the model is only read, e.g.
    :func:`fedshard.client.handlers.handle_train`, or ``copy.deepcopy`` it first).

    A ClientApp would otherwise build the model for every message only to overwrite its weights
    with the server's; a random initialization costs several times a deep copy, and
    :func:`~fedshard.client.handle_train` copies only what the sub-model keeps (measured by
    ``benchmarks/bench_receive.py``).
    """
    key = (cfg.model, cfg.model_width, cfg.dataset, cfg.seed)  # all that build_model reads
    model = _TEMPLATES.get(key)
    if model is None:
        model = build_model(cfg)
        while len(_TEMPLATES) >= 2:  # a process serves one run at a time
            _TEMPLATES.pop(next(iter(_TEMPLATES)))
        _TEMPLATES[key] = model
    return model


_TEMPLATES: dict[tuple[Any, ...], nn.Module] = {}


def build_model(cfg: RunConfig) -> nn.Module:
    """The run's model, initialized from ``seed`` (inside a forked RNG: no global seeding)."""
    info = dataset_info(cfg.dataset)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(np.random.default_rng([cfg.seed, 0xF5]).integers(2**31)))
        if cfg.model == "resnet18":
            from fedshard.models import resnet18

            _need_images(cfg, info)
            return resnet18(num_classes=info.num_classes, in_channels=info.in_channels,
                            width=cfg.model_width)
        if cfg.model == "mlp":
            from fedshard.models import mlp

            _need_images(cfg, info)
            return mlp(info.in_channels * info.image_size**2, info.num_classes,
                       width=cfg.model_width)
        if cfg.model == "lenet":
            from fedshard.models import lenet

            _need_images(cfg, info)
            return lenet(info.num_classes, in_channels=info.in_channels,
                         image_size=info.image_size)
        if cfg.model == "cct":
            from fedshard.models import cct_6_3x2

            _need_images(cfg, info)
            return cct_6_3x2(info.num_classes, in_channels=info.in_channels,
                             img_size=info.image_size)
        if cfg.model == "chargpt":
            from fedshard.models import char_transformer

            if info.task != "next-char":
                raise ValueError(f"model='chargpt' needs a next-char data set, not {cfg.dataset!r}")
            return char_transformer(info.num_classes, n_embd=cfg.model_width,
                                    n_head=CHARGPT_HEADS)
    raise ValueError(f"model={cfg.model!r}: no builder")  # RunConfig validation prevents this


def width_family(cfg: RunConfig) -> WidthFamily:
    """The run's model at any width (width slicing): the MLP's hidden units, ResNet-18's
    first-stage channels (even: its GroupNorm has 2 groups), the char GPT's embedding width
    (a multiple of its 3 heads: each head narrows alike, and the MLP's 4x width with it); the
    global width is ``model-width``.

    Raises
    ------
    ValueError
        For a model width slicing does not narrow (RunConfig validation prevents this).
    """
    info = dataset_info(cfg.dataset)
    if cfg.model == "mlp":
        return WidthFamily(functools.partial(_mlp_at, info.in_channels * info.image_size**2,
                                             info.num_classes), cfg.model_width)
    if cfg.model == "resnet18":
        return WidthFamily(functools.partial(_resnet_at, info.num_classes, info.in_channels),
                           cfg.model_width, multiple=2)
    if cfg.model == "chargpt":
        return WidthFamily(functools.partial(_chargpt_at, info.num_classes), cfg.model_width,
                           multiple=CHARGPT_HEADS)
    raise ValueError(f"model={cfg.model!r}: width slicing has no family for it")


def _mlp_at(in_features: int, num_classes: int, width: int) -> nn.Module:
    from fedshard.models import mlp

    return mlp(in_features, num_classes, width=width)


def _resnet_at(num_classes: int, in_channels: int, width: int) -> nn.Module:
    from fedshard.models import resnet18

    return resnet18(num_classes, in_channels, width)


def _chargpt_at(vocab_size: int, width: int) -> nn.Module:
    from fedshard.models import char_transformer

    return char_transformer(vocab_size, n_embd=width, n_head=CHARGPT_HEADS)


def train_node(msg: Message, cfg: RunConfig, data: Dataset[Any], *, device: str,
               model: nn.Module | None = None, **options: Any) -> Message:
    """One node's training reply to ``msg`` (:func:`fedshard.client.node.handle_node_train`):
    the received shard of the run's model (``model``: the process's template,
    :func:`template_model` if not given) or, for width slicing, the narrow model of the run's
    width family (:func:`width_family`). ``options`` (``fast``, ``submodels``, ...) as
    :func:`~fedshard.client.node.handle_node_train` takes them."""
    return handle_node_train(
        msg, data, model=model if model is not None else functools.partial(template_model, cfg),
        family=functools.partial(width_family, cfg), device=device, **options)


def trusted_reference(cfg: RunConfig, device: str = "cpu") -> TrustedReference | None:
    """The server's reference training (:class:`~fedshard.server.trusted.TrustedReference`)
    on its trusted set: ``trusted-data`` examples held out of the training set (a simulated
    node never trains on them; never test data), or every training example in
    ``trusted-data-dir`` (a deployment's folder in the data set's layout); ``None`` when
    neither is set. It trains as a node does (:func:`train_node`)."""
    if cfg.trusted_data:
        data = load_held_out(cfg.dataset, cfg.trusted_data, data_dir=cfg.data_dir or None,
                             seed=cfg.seed, download=cfg.download)
    elif cfg.trusted_data_dir:
        with _data_setting("trusted-data-dir", cfg.trusted_data_dir):
            data = load_partition(cfg.dataset, 0, 1, data_dir=cfg.trusted_data_dir,
                                  seed=cfg.seed)
    else:
        return None
    if len(data) == 0:  # type: ignore[arg-type]
        raise ValueError(f"trusted-data-dir={cfg.trusted_data_dir!r} holds no training "
                         "examples; expected the server's clean examples (100-500)")
    return TrustedReference(functools.partial(_train_trusted, cfg=cfg, data=data,
                                              device=device), len(data))  # type: ignore[arg-type]


def _train_trusted(msg: Message, *, cfg: RunConfig, data: Dataset[Any], device: str
                   ) -> Message:
    return train_node(msg, cfg, data, device=device, fast=cfg.fast)


def _need_images(cfg: RunConfig, info: Any) -> None:
    if info.task != "image":
        raise ValueError(
            f"model={cfg.model!r} needs an image data set, but dataset={cfg.dataset!r} is "
            f"{info.task!r}; use model='chargpt' for it"
        )


def example_input(cfg: RunConfig) -> torch.Tensor:
    """One input batch of the right shape (determines the forward order of layers)."""
    info = dataset_info(cfg.dataset)
    if info.task == "next-char":
        return torch.zeros(1, 80, dtype=torch.long)
    return torch.zeros(1, info.in_channels, info.image_size, info.image_size)


#: Prepared client data a process keeps (:func:`client_dataset`), in bytes, unless the
#: environment variable ``FEDSHARD_CLIENT_DATA_CACHE_BYTES`` says otherwise (``0``: keep
#: nothing, prepare the data for every message); the least recently used partition goes first
#: when more would be kept. A Ray worker of a simulation serves several simulated nodes.
CLIENT_DATA_CACHE_BYTES = 1 << 30


def _cache_budget() -> int:
    text = os.environ.get("FEDSHARD_CLIENT_DATA_CACHE_BYTES")
    if text is None:
        return CLIENT_DATA_CACHE_BYTES
    try:
        budget = int(text)
    except ValueError:
        budget = -1
    if budget < 0:
        raise ValueError(
            f"FEDSHARD_CLIENT_DATA_CACHE_BYTES={text!r}: expected a whole number of bytes >= 0 "
            "(0: keep no client data between messages); unset it for the default "
            f"{CLIENT_DATA_CACHE_BYTES}. This node handles no message until then")
    return budget


def client_dataset(cfg: RunConfig, partition_id: int, num_partitions: int) -> Dataset[Any]:
    """This node's training partition (``dirichlet-alpha = 0``: the data set's paper α;
    Shakespeare is split by speaking role and takes no α), prepared once per process.

    The partition and its standardized tensors (``example_tensors()``, what training reads)
    are kept per process, keyed on everything that determines them (data set, ``data-dir``,
    ``download``, α, ``seed``, partition id and count), up to :data:`CLIENT_DATA_CACHE_BYTES`
    (or ``$FEDSHARD_CLIENT_DATA_CACHE_BYTES``):
    a client that trains every round reads and standardizes its images in its first round
    only. The examples are the same either way (fedshard's data sets have no random
    augmentation), so a run's results do not depend on what was kept. Logs at DEBUG which
    partition a message uses (``FLWR_LOG_LEVEL=DEBUG``).
    """
    info = dataset_info(cfg.dataset)
    alpha = None if info.task == "next-char" or cfg.dirichlet_alpha == 0 else cfg.dirichlet_alpha
    budget = _cache_budget()
    key = (cfg.dataset, cfg.data_dir, cfg.download, alpha, cfg.seed, partition_id,
           num_partitions, cfg.trusted_data)
    dataset = _DATASETS.get(key)
    if dataset is not None:
        _DATASETS.move_to_end(key)
        log(DEBUG, "fedshard ClientApp: partition %d of %d, %d examples (prepared earlier in "
            "this process, pid %d)", partition_id, num_partitions,
            len(dataset), os.getpid())  # type: ignore[arg-type]
        return dataset
    with _data_setting("data-dir", cfg.data_dir or "(the cache)"):
        dataset = load_partition(
            cfg.dataset, partition_id, num_partitions, data_dir=cfg.data_dir or None,
            alpha=alpha, seed=cfg.seed, download=cfg.download, held_out=cfg.trusted_data,
        )
    if isinstance(dataset, ImageDataset):
        dataset.example_tensors()  # standardize now, once: the data set keeps the tensors
    if budget > 0 and _nbytes(dataset) <= budget:
        _DATASETS[key] = dataset
    while _DATASETS and (budget == 0 or sum(_nbytes(d) for d in _DATASETS.values()) > budget):
        _DATASETS.popitem(last=False)
    log(DEBUG, "fedshard ClientApp: partition %d of %d, %d examples (prepared now, pid %d)",
        partition_id, num_partitions, len(dataset), os.getpid())  # type: ignore[arg-type]
    return dataset


_DATASETS: OrderedDict[tuple[Any, ...], Dataset[Any]] = OrderedDict()


@contextlib.contextmanager
def _data_setting(setting: str, value: str) -> Iterator[None]:
    """A damaged data file read for ``setting`` names that setting before the file."""
    try:
        yield
    except DataFormatError as err:
        raise DataFormatError(f"{setting}={value!r}: {err}") from err


def _nbytes(dataset: Dataset[Any]) -> int:
    """What a kept data set holds in memory (images); Shakespeare's ``uint8`` rows count as 0
    (a few MB for all roles together)."""
    return dataset.nbytes if isinstance(dataset, ImageDataset) else 0


def node_partition(cfg: RunConfig, node_config: dict[str, Any]) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` of this node's data.

    A simulated node's ``num-partitions`` is the federation's ``num-supernodes``: with the run
    config's ``num-partitions = 0`` (the default) the data is split that many ways, whatever
    the number of simulated nodes. An explicit ``num-partitions`` that differs would be
    recorded in the results as if it had been used, so it is an error (the node replies with
    it, and a run in which every node fails the same way stops after its first round).
    A deployed node's own ``num-partitions`` is its business; a deployed node without
    ``partition-id`` trains all of its data (``(0, 1)``: a device with its own ``data-dir``
    needs no partition arguments).
    """
    if "partition-id" not in node_config and not is_simulated_node(node_config):
        return 0, 1
    pid = int(node_config.get("partition-id", 0))
    num = int(node_config.get("num-partitions", cfg.num_partitions))
    if is_simulated_node(node_config) and cfg.num_partitions and num != cfg.num_partitions:
        raise ValueError(
            f"run config num-partitions={cfg.num_partitions}, but this simulation has {num} "
            f"nodes (node config num-partitions={num}); the data would be split {num} ways "
            "while the results record another split. Leave num-partitions out (0: one "
            "partition per simulated node) or set it equal to num-supernodes; this node does "
            "not train until then")
    if num < 1:
        raise ValueError(
            f"node config partition-id={pid} without num-partitions, and the run config's "
            "num-partitions is 0 (one partition per simulated node), which a deployed node "
            "cannot know: give the node --node-config \"partition-id=... num-partitions=...\" "
            "or its own data-dir; this node does not train until then")
    return pid, num


def declared_keep_ratio(cfg: RunConfig, node_config: dict[str, Any]) -> float:
    """A node's keep ratio: the one its ``memory-mb`` allows (:func:`node_capacity`), else
    ``keep-ratio`` from its node config (deployment), else, only for a simulated node
    (:func:`is_simulated_node`), derived from ``partition-id`` and the run's ``keep-ratios``
    mixture. A deployed node without either raises ``ValueError``: the mixture describes the
    simulated federation, not a device's capacity. The rule is the library's
    (:func:`fedshard.client.keep_ratios.node_keep_ratio`), the one any project's
    ``ShardingClientApp(keep_ratios=...)`` applies."""
    capacity = node_capacity(cfg, node_config)
    return capacity.keep_ratio if isinstance(capacity, MemoryFit) else capacity


def node_capacity(cfg: RunConfig, node_config: dict[str, Any]) -> float | MemoryFit:
    """What a node declares in the capability query: for a node with ``memory-mb`` in its node
    config, the largest keep ratio whose training fits in it, measured on the node's own model
    and batches (:func:`fedshard.client.memory.keep_ratio_for_memory`; its ``keep-ratio``, if
    any, caps it), logged, and kept for the process; else its keep ratio
    (:func:`declared_keep_ratio`'s rule)."""
    if P.MEMORY_MB not in node_config:
        return node_keep_ratio(node_config, cfg.mixture)
    memory = node_config[P.MEMORY_MB]
    cap = (1.0 if P.KEEP_RATIO not in node_config else as_keep_ratio(
        node_config[P.KEEP_RATIO], f"node config {P.KEEP_RATIO}",
        "this node cannot train until it is fixed"))
    key = (cfg.model, cfg.model_width, cfg.dataset, cfg.data_dir, cfg.seed,
           cfg.training.batch_size, cfg.client_device, repr(memory), cap)
    fit = _MEMORY_FITS.get(key)
    if fit is None:
        pid, num = node_partition(cfg, node_config)
        data = client_dataset(cfg, pid, num)
        loader = DataLoader(data, batch_size=cfg.training.batch_size, shuffle=False)
        batches = list(itertools.islice(iter(loader), 2))
        fit = keep_ratio_for_memory(
            template_model(cfg), batches, memory, cap=cap,
            cfg=TrainConfig(recipe=cfg.training, device=resolve_device(cfg.client_device)))
        _MEMORY_FITS[key] = fit
        log(INFO, "fedshard node: %s", fit.line())
    return fit


#: What :func:`node_capacity` measured, per run settings and budget (a process serves one node).
_MEMORY_FITS: dict[tuple[Any, ...], MemoryFit] = {}


def low_memory_of(node_config: dict[str, Any]) -> bool:
    """Whether this node trains in low-memory mode: it declares ``memory-mb`` (its keep ratio
    was measured in that mode), or ``low-memory = true`` in its node config.

    Raises
    ------
    ValueError
        For a ``low-memory`` that is not a boolean.
    """
    value = node_config.get(LOW_MEMORY, False)
    if not isinstance(value, bool):
        raise ValueError(f"node config {LOW_MEMORY}={value!r}: expected true or false; this "
                         "node does not train until it is fixed")
    return value or P.MEMORY_MB in node_config


#: Node-config key: train in low-memory mode (:attr:`fedshard.client.train.TrainConfig.low_memory`).
LOW_MEMORY = "low-memory"


#: Train-config key by which the ServerApp tells its nodes where it runs: ``"simulation"``
#: (Flower's simulation runtime) or ``"deployment"`` (a SuperLink); absent where it cannot
#: tell (e.g. a test's own grid).
RUNTIME_KEY = "fedshard-runtime"


#: The grids Flower's two runtimes give a ServerApp (flwr 1.42: ``flwr.superlink.grid``), by
#: class name -> where the ServerApp runs.
RUNTIME_GRIDS = {"InMemoryGrid": "simulation", "HttpGrid": "deployment"}


def grid_runtime(grid: object) -> str | None:
    """Where the ServerApp given ``grid`` runs: ``"simulation"`` (Flower's simulation
    runtime), ``"deployment"`` (a SuperLink), or ``None`` where it cannot tell (e.g. a test's
    own grid).

    Flower has no public API that says where a ServerApp runs, so the two runtimes are told
    apart by the grids they give it, by their class names (:data:`RUNTIME_GRIDS`: flwr 1.42's
    ``InMemoryGrid`` and ``HttpGrid``, duck-typed: nothing of Flower's beyond its public API
    is imported). A grid of Flower's own (its class defined in a ``flwr`` module) that is
    neither is logged once: then deployed nodes with a simulated node's settings are not
    warned (:func:`warn_if_looks_simulated`); the run itself is not affected.
    """
    names = [cls.__name__ for cls in type(grid).__mro__]
    for name in names:
        if name in RUNTIME_GRIDS:
            return RUNTIME_GRIDS[name]
    kind = type(grid)
    if kind.__module__.split(".")[0] == "flwr" and kind.__name__ not in _RUNTIME_UNKNOWN:
        import flwr

        _RUNTIME_UNKNOWN.append(kind.__name__)
        log(WARNING, "fedshard cannot tell whether this ServerApp runs in Flower's "
            "simulation or on a SuperLink: flwr %s gives it a %s.%s, which is neither of the "
            "grids of flwr 1.42's two runtimes (%s). The run goes on, but its nodes are not "
            "told where it runs, so a deployed SuperNode that took a simulated node's settings "
            "(only partition-id and num-partitions in its node config) is not warned.",
            flwr.__version__, kind.__module__, kind.__name__, ", ".join(RUNTIME_GRIDS))
    return None


#: The Flower grids :func:`grid_runtime` did not know (each logged once per process).
_RUNTIME_UNKNOWN: list[str] = []


def warn_if_looks_simulated(cfg: RunConfig, node_config: dict[str, Any],
                            train_config: Any) -> bool:
    """Warn (once per process and node) when a deployed node took a simulated node's settings.

    A SuperNode started with only ``partition-id`` and ``num-partitions`` in its node config
    looks like a simulated node (:func:`is_simulated_node`): it takes its keep ratio from the
    run's ``keep-ratios`` mixture and trains that partition of the data set on its disk. The
    ServerApp says in every train message's config (:data:`RUNTIME_KEY`) whether it runs in
    a simulation or on a SuperLink; on a SuperLink such a node is warned, naming what it took.
    Returns whether it warned.
    """
    runtime = train_config.get(RUNTIME_KEY) if hasattr(train_config, "get") else None
    if runtime != "deployment" or not is_simulated_node(node_config):
        return False
    pid, num = int(node_config["partition-id"]), int(node_config["num-partitions"])
    key = (cfg.keep_ratios, pid, num)
    if key in _WARNED:
        return False
    _WARNED.add(key)
    log(WARNING, "fedshard ClientApp: this SuperNode is deployed (the ServerApp runs on a "
        "SuperLink), but its node config has only partition-id=%d and num-partitions=%d, as "
        "a simulated node's: it took keep ratio r=%g from the run's simulated mixture "
        "keep-ratios=%r and trains partition %d of %d of %s. Give the node its own "
        "--node-config \"keep-ratio=<r> data-dir='<its data>'\" (see the deployment docs) "
        "unless this is what you want.", pid, num, declared_keep_ratio(cfg, node_config),
        cfg.keep_ratios, pid, num, cfg.dataset)
    return True


_WARNED: set[tuple[Any, ...]] = set()


def resolve_device(setting: str) -> str:
    """A run config's ``client-device``/``server-device`` as a torch device string.

    ``"auto"``: ``"cuda:0"`` when torch sees a GPU, else ``"cpu"``. Under Flower's Ray
    simulation with ``client-resources-num-gpus > 0`` Ray sets ``CUDA_VISIBLE_DEVICES`` for
    each ClientApp, so ``cuda:0`` is the GPU it was given. An explicit ``cuda`` on a machine
    without one is an error (a run must not silently train on the CPU).
    """
    if setting == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {setting!r} was asked for, but torch sees no GPU here "
            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use 'auto' or 'cpu', or give the "
            "ClientApps GPUs (client-resources-num-gpus in the federation config)")
    return setting
