"""Batches as ``(inputs, targets)`` on a device: a DataLoader's (pairs, or dicts as
flwr-datasets and Hugging Face data sets yield them), or :class:`TensorBatches`, a data set
held as two tensors on the device, batched in the DataLoader's order without its per-example
work."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = [
    "INPUT_KEYS", "TARGET_KEYS", "TENSOR_BATCHES_MAX_BYTES", "HasTensors", "TensorBatches",
    "batches_for", "dataset_size", "unpack_batch",
]

logger = logging.getLogger(__name__)


#: Dict-batch keys recognised without configuration (flwr-datasets / Hugging Face defaults).
INPUT_KEYS = ("img", "image", "pixel_values", "x", "input_ids")
TARGET_KEYS = ("label", "labels", "fine_label", "y")


def unpack_batch(
    batch: Any,
    device: torch.device,
    input_key: str | None = None,
    target_key: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of a pair or dict batch, on ``device``, targets as int64."""
    if isinstance(batch, Mapping):
        inputs = batch[_batch_key(batch, input_key, INPUT_KEYS, "input")]
        targets = batch[_batch_key(batch, target_key, TARGET_KEYS, "target")]
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
    else:
        raise ValueError(
            f"expected the DataLoader to yield (inputs, targets) pairs or dicts, got "
            f"{type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            + "; nothing more was processed."
        )
    for what, value in (("inputs", inputs), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"the batch's {what} are a {type(value).__name__}, expected a torch.Tensor "
                "(use a collate_fn or a dataset transform that returns tensors); nothing "
                "more was processed."
            )
    return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True).long()


def _batch_key(
    batch: Mapping[str, Any], key: str | None, defaults: tuple[str, ...], what: str
) -> str:
    found = sorted(str(k) for k in batch)
    field = f"TrainConfig.{what}_key"
    if key is not None:
        if key not in batch:
            raise ValueError(
                f"{field}={key!r} is not a key of the batch; found keys {found}. Set "
                f"{field} to the {what} key; nothing more was processed."
            )
        return key
    matches = [k for k in defaults if k in batch]
    if len(matches) == 1:
        return matches[0]
    problem = "several" if matches else "none"
    raise ValueError(
        f"cannot tell the {what} key of a dict batch: {problem} of the known keys "
        f"{list(defaults)} found{' (' + ', '.join(map(repr, matches)) + ')' if matches else ''}; "
        f"the batch has keys {found}. Set {field} (evaluate(..., {what}_key=...)); "
        "nothing more was processed."
    )


def dataset_size(loader: DataLoader[Any] | TensorBatches, fallback: int) -> int:
    if isinstance(loader, TensorBatches):
        return loader.num_examples
    try:
        return len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:  # an IterableDataset without __len__: examples in one epoch
        return fallback


def _example_tensors(dataset: HasTensors) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = dataset.example_tensors()
    if inputs.shape[0] != len(dataset):
        raise ValueError(
            f"{type(dataset).__name__}.example_tensors() gave {inputs.shape[0]} examples "
            f"but the data set has {len(dataset)}; no batches were made."
        )
    return inputs, targets


@runtime_checkable
class HasTensors(Protocol):
    """A map-style data set that can give all its examples at once, as ``dataset[i]`` would
    give them one by one: ``inputs[i], targets[i] == dataset[i]``, with no randomness in
    ``__getitem__`` (fedshard's :class:`~fedshard.data.images.ImageDataset` and
    :class:`~fedshard.data.shakespeare.ShakespeareDataset`)."""

    def __len__(self) -> int: ...

    def example_tensors(self) -> tuple[torch.Tensor, torch.Tensor]: ...


class TensorBatches:
    """Mini-batches of a data set held as two tensors on one device.

    A ``DataLoader`` reads a map-style data set one example at a time (``__getitem__``, then
    ``torch.stack`` of the batch) and copies every batch to the device. For data sets that
    fit in the device's memory and whose examples do not change between reads (no random
    augmentation), this keeps ``inputs`` and ``targets`` on ``device`` and takes each batch by
    indexing: one host-to-device copy per data set instead of one per batch, and no Python
    work per example. On a GPU the host is the bottleneck of a small sub-model's step
    (``docs/performance.md``).

    Parameters
    ----------
    inputs, targets : torch.Tensor
        ``(N, ...)`` each, example ``i`` being ``(inputs[i], targets[i])``. Moved to
        ``device`` once (not copied if already there).
    batch_size : int
        Examples per batch; the last batch holds the remainder (``drop_last=False``).
    seed : int or None
        ``None``: the examples in order, every epoch. An int: shuffled every epoch, in **the
        order** ``DataLoader(dataset, batch_size, shuffle=True,
        generator=torch.Generator().manual_seed(seed))`` **gives** when iterated epoch after
        epoch (torch 2.x; ``tests/client/train/test_tensor_batches.py`` checks it), so training on
        either gives the same model bit for bit.
    device : str or torch.device
        Where the tensors live and batches are made.

    Raises
    ------
    ValueError
        If ``batch_size < 1`` or the tensors' first dimensions differ. No examples is not an
        error here (no batches, as a DataLoader of an empty data set):
        :func:`~fedshard.client.train.loop.train` refuses to train on them.

    Notes
    -----
    Per epoch a shuffling ``DataLoader`` (single process) draws from its generator, in this
    order: one int64 (the base seed of its iterator, drawn even without workers), the
    permutation ``randperm(N)`` of :class:`~torch.utils.data.RandomSampler`, and a second
    ``randperm(N)`` when the sampler is exhausted (its remainder slice of length
    ``num_samples % N = 0``). :meth:`__iter__` draws the same three, so the generator's state
    follows the DataLoader's from epoch to epoch; an epoch left before its end may leave the
    two generators in different states.
    """

    def __init__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        batch_size: int,
        *,
        seed: int | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"batch_size={batch_size!r}: expected an int >= 1; no batches were made."
            )
        if inputs.ndim == 0 or targets.ndim == 0 or inputs.shape[0] != targets.shape[0]:
            raise ValueError(
                f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)}: expected "
                "the same first dimension N (one row per example); no batches were made."
            )
        self.device = torch.device(device)
        self.inputs = inputs.to(self.device)
        self.targets = targets.to(self.device)
        self.batch_size = batch_size
        self.seed = seed
        self._generator = None if seed is None else torch.Generator().manual_seed(seed)

    @classmethod
    def from_dataset(
        cls,
        dataset: HasTensors,
        batch_size: int,
        *,
        seed: int | None = None,
        device: str | torch.device = "cpu",
    ) -> TensorBatches:
        """Batches of a :class:`HasTensors` data set (its ``example_tensors()``), as the
        constructor."""
        inputs, targets = _example_tensors(dataset)
        return cls(inputs, targets, batch_size, seed=seed, device=device)

    @property
    def num_examples(self) -> int:
        """``N``, the examples per epoch."""
        return int(self.inputs.shape[0])

    def __len__(self) -> int:
        """Batches per epoch, as ``len(DataLoader)``."""
        return -(-self.num_examples // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = self.num_examples
        if self._generator is None:
            for start in range(0, n, self.batch_size):
                yield (self.inputs[start:start + self.batch_size],
                       self.targets[start:start + self.batch_size])
            return
        # The DataLoader's draws, in its order (see Notes): base seed, permutation, then a
        # second permutation when the sampler runs out.
        torch.empty((), dtype=torch.int64).random_(generator=self._generator)
        order = torch.randperm(n, generator=self._generator).to(self.device)
        for start in range(0, n, self.batch_size):
            index = order[start:start + self.batch_size]
            yield self.inputs.index_select(0, index), self.targets.index_select(0, index)
        torch.randperm(n, generator=self._generator)

    def __repr__(self) -> str:
        return (f"TensorBatches(num_examples={self.num_examples}, batch_size={self.batch_size}, "
                f"seed={self.seed}, device={self.device})")


#: A data set larger than this (as tensors) is read through a DataLoader, not held on the device.
TENSOR_BATCHES_MAX_BYTES = 1 << 30


def batches_for(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    seed: int | None = None,
    device: str | torch.device = "cpu",
    max_bytes: int = TENSOR_BATCHES_MAX_BYTES,
) -> DataLoader[Any] | TensorBatches:
    """Batches of ``dataset``: :class:`TensorBatches` on ``device`` for a :class:`HasTensors`
    data set or a ``TensorDataset`` of ``(inputs, targets)`` of at most ``max_bytes``, a
    ``DataLoader`` otherwise; both in the same order
    (``seed=None``: in order; an int: ``DataLoader(..., shuffle=True,
    generator=torch.Generator().manual_seed(seed))``'s), so the choice changes no result."""
    pair: tuple[torch.Tensor, torch.Tensor] | None = None
    if isinstance(dataset, HasTensors):
        pair = _example_tensors(dataset)
    elif isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        pair = (dataset.tensors[0], dataset.tensors[1])
    if pair is not None:
        inputs, targets = pair
        size = inputs.element_size() * inputs.nelement() + (
            targets.element_size() * targets.nelement())
        if size <= max_bytes:
            return TensorBatches(inputs, targets, batch_size, seed=seed, device=device)
        logger.info("the data set's %d examples take %.2f GiB as tensors (more than %.2f GiB): "
                    "read through a DataLoader instead of held on %s", int(inputs.shape[0]),
                    size / 2**30, max_bytes / 2**30, device)
    if seed is None:
        return DataLoader(dataset, batch_size=batch_size, shuffle=False)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))
