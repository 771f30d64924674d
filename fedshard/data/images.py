"""Image arrays, per-image standardization and the torch ``Dataset`` that serves them.

Images are kept in memory as ``uint8`` arrays of shape ``(N, C, H, W)`` (a quarter of the
float32 size: 1.2 GB instead of 4.9 GB for TinyImageNet's training set) and standardized one
image at a time when an item is read; :meth:`ImageDataset.example_tensors` standardizes all of
them at once (to the same values), once per data set object, and keeps the result (a client
that trains every round prepares its images once, not once a round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["ImageArrays", "ImageDataset", "per_image_standardization"]


def per_image_standardization(images: torch.Tensor) -> torch.Tensor:
    """Standardize every image to zero mean and unit variance over all its pixels and channels.

    Parameters
    ----------
    images : torch.Tensor
        One image ``(C, H, W)`` or a batch ``(B, C, H, W)``; any real dtype (``uint8`` pixel
        values are fine).

    Returns
    -------
    torch.Tensor
        Same shape, ``float32`` (``float64`` if the input is ``float64``):
        ``(x - mean(x)) / max(std(x), 1 / sqrt(numel(x)))`` per image.

    Raises
    ------
    ValueError
        If ``images`` does not have 3 or 4 dimensions or an image is empty.

    Notes
    -----
    This is ``tf.image.per_image_standardization``: the standard deviation is the population
    one (divide by ``numel``), and its floor ``1 / sqrt(numel)`` keeps a constant image finite
    (it becomes all zeros). The paper (Sec. 4.1) standardizes every image this way, following
    Reddi et al. (2021), and applies no random cropping.

    ``uint8`` pixels are standardized the same way alone or in a batch of any size:
    each image's sum and sum of squares are exact integers, its variance
    ``(n·Σx² − (Σx)²) / n²`` one float64 division, and every pixel ``(x − mean) / std`` in
    float32 with the mean and standard deviation rounded to float32 (a floating-point
    reduction's rounding would depend on how it is vectorized). So a whole data set is
    standardized at once, to the values each image gets alone. Other dtypes take torch's
    float reductions.
    """
    if images.ndim not in (3, 4):
        raise ValueError(
            f"per_image_standardization expects (C, H, W) or (B, C, H, W), got shape "
            f"{tuple(images.shape)}; nothing was standardized."
        )
    numel = images.shape[-3] * images.shape[-2] * images.shape[-1]
    if numel == 0:
        raise ValueError(f"Cannot standardize empty images of shape {tuple(images.shape)}.")
    dims = (-3, -2, -1)
    floor = 1.0 / math.sqrt(numel)
    if images.dtype == torch.uint8:  # exact int64 sums (wider integers could overflow them)
        if images.ndim == 3:
            return _standardize_integers(images[None], numel, floor)[0]
        return torch.cat([_standardize_integers(images[i:i + _CHUNK], numel, floor)
                          for i in range(0, images.shape[0], _CHUNK)]
                         ) if images.shape[0] else torch.empty(images.shape, dtype=torch.float32)
    dtype = torch.float64 if images.dtype == torch.float64 else torch.float32
    x = images.to(dtype)
    mean = x.mean(dim=dims, keepdim=True)
    std = x.std(dim=dims, keepdim=True, correction=0)
    return (x - mean) / std.clamp_min(floor)


#: Images standardized together (bounds the float32 working copies: 4,096 CIFAR images, 50 MB).
_CHUNK = 4096


def _standardize_integers(images: torch.Tensor, numel: int, floor: float) -> torch.Tensor:
    """``(B, C, H, W)`` integer pixels -> float32, the same for an image alone or in any batch
    (see :func:`per_image_standardization`). The sums are exact integers; the variance's
    numerator converts to float64 exactly for ``uint8`` images up to 372,000 pixels (larger
    ones round it once, the same way in any batch)."""
    pixels = images.reshape(images.shape[0], -1)  # (B, n)
    ints = pixels.numpy() if pixels.device.type == "cpu" else pixels.cpu().numpy()
    s1 = torch.from_numpy(ints.sum(axis=1, dtype=np.int64))  # numpy's integer sums: fast
    s2 = torch.from_numpy(np.einsum("ij,ij->i", ints, ints, dtype=np.int64, casting="unsafe"))
    var = (numel * s2 - s1 * s1).to(torch.float64) / float(numel) ** 2  # integer numerator
    mean = (s1.to(torch.float64) / numel).to(torch.float32).to(images.device)
    std = var.sqrt().clamp_min(floor).to(torch.float32).to(images.device)
    # elementwise float32 (each pixel rounded the same way in any batch)
    out = (pixels.to(torch.float32) - mean[:, None]) / std[:, None]
    return out.reshape(images.shape)


@dataclass(frozen=True)
class ImageArrays:
    """Raw images and labels of one split of an image data set.

    Attributes
    ----------
    images : numpy.ndarray
        ``(N, C, H, W)`` ``uint8`` pixel values.
    labels : numpy.ndarray
        ``(N,)`` ``int64`` class indices.
    coarse_labels : numpy.ndarray or None
        ``(N,)`` ``int64`` super-class indices (CIFAR-100 only).
    """

    images: np.ndarray
    labels: np.ndarray
    coarse_labels: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.images.dtype != np.uint8:
            raise ValueError(
                f"images must be a uint8 (N, C, H, W) array, got {self.images.dtype} "
                f"{self.images.shape}."
            )
        n = self.images.shape[0]
        for name, arr in (("labels", self.labels), ("coarse_labels", self.coarse_labels)):
            if arr is not None and arr.shape != (n,):
                raise ValueError(
                    f"{name} must have shape ({n},) to match {n} images, got {arr.shape}."
                )

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def subset(self, indices: np.ndarray) -> ImageArrays:
        """Copy of the examples at ``indices`` (in that order)."""
        coarse = None if self.coarse_labels is None else self.coarse_labels[indices]
        return ImageArrays(self.images[indices], self.labels[indices], coarse)


class ImageDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Map-style dataset of ``(x, y)`` with ``x`` a standardized ``float32`` ``(C, H, W)``.

    Parameters
    ----------
    arrays : ImageArrays
        The examples; copied into torch tensors, so later changes to the arrays do not leak in.

    Attributes
    ----------
    targets : numpy.ndarray
        ``(N,)`` ``int64`` labels, e.g. for class histograms.
    """

    def __init__(self, arrays: ImageArrays) -> None:
        # (N, C, H, W) uint8; torch.tensor copies, so read-only cached arrays are fine.
        self._images = torch.tensor(arrays.images)
        self._labels = torch.tensor(arrays.labels, dtype=torch.int64)
        self.targets: np.ndarray = np.array(arrays.labels, dtype=np.int64)
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None  # example_tensors()

    def __len__(self) -> int:
        return int(self._images.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return per_image_standardization(self._images[index]), self._labels[index]

    def example_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All examples at once: ``(N, C, H, W)`` standardized ``float32`` images and ``(N,)``
        labels, ``[i]`` equal to ``self[i]`` (for
        :class:`fedshard.client.train.TensorBatches`).

        Computed on the first call and kept: later calls return the **same** tensors (read
        them, never modify them in place), so a data set that trains every round is
        standardized once. They take 4 bytes per pixel besides the ``uint8`` images
        (:attr:`nbytes` counts both).
        """
        if self._tensors is None:
            if len(self) == 0:
                inputs = torch.empty(self._images.shape, dtype=torch.float32)
            else:
                # uint8 pixels: all at once, exactly as __getitem__ gives each image
                inputs = per_image_standardization(self._images)
            self._tensors = (inputs, self._labels.clone())
        return self._tensors

    @property
    def nbytes(self) -> int:
        """Memory this data set holds: the ``uint8`` images and labels, plus the standardized
        tensors once :meth:`example_tensors` has made them."""
        tensors = [self._images, self._labels, *(self._tensors or ())]
        return sum(t.element_size() * t.nelement() for t in tensors)
