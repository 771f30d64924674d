"""Batches of a DataLoader as ``(inputs, targets)`` on a device: pairs, or dicts as
flwr-datasets and Hugging Face data sets yield them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

__all__ = ["INPUT_KEYS", "TARGET_KEYS", "dataset_size", "unpack_batch"]


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


def dataset_size(loader: DataLoader[Any], fallback: int) -> int:
    try:
        return len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:  # an IterableDataset without __len__: examples in one epoch
        return fallback
