"""Seconds to standardize a data set's images: all at once vs one image at a time.

A node prepares its partition once per process (:meth:`fedshard.data.ImageDataset
.example_tensors`), in its first round. ``uint8`` images are standardized all at once
(:func:`fedshard.data.per_image_standardization`: integer sums, float32 pixels); the baseline
is the loop over single images in float32 that fedshard used before (each image converted to
float32, then torch's float mean and standard deviation), run side by side in this process,
interleaved, on the real Fashion-MNIST training images (``--fmnist``) or on random
CIFAR-shaped ones (``--cifar N``).

Prints one JSON object: the median seconds of each way over ``--repeats``, their ratio, and
``same_values``: whether both give the same float32 values bit for bit.

Usage: ``python benchmarks/bench_standardize.py [--fmnist DIR] [--cifar N] [--repeats 3]
[--threads 1] [--out FILE]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import emit, provenance

from fedshard.data import per_image_standardization
from fedshard.data.image_files import read_idx


def fashion_mnist(folder: Path) -> torch.Tensor:
    images = read_idx(folder / "train-images-idx3-ubyte.gz")  # (N, 28, 28) uint8
    return torch.from_numpy(images.copy())[:, None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmnist", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    ap.add_argument("--cifar", type=int, default=0, help="N random 3x32x32 images instead")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.cifar:
        images = torch.from_numpy(np.random.default_rng(0).integers(
            0, 256, (args.cifar, 3, 32, 32), dtype=np.uint8))
        source = f"{args.cifar} random CIFAR-shaped uint8 images"
    else:
        images = fashion_mnist(args.fmnist)
        source = f"Fashion-MNIST training set ({len(images)} images)"

    def batched() -> torch.Tensor:
        return per_image_standardization(images)

    def one_by_one() -> torch.Tensor:  # the baseline: float32 reductions, image by image
        return torch.stack([per_image_standardization(img.to(torch.float32))
                            for img in images])

    times: dict[str, list[float]] = {"batched": [], "one_by_one": []}
    out: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for name, fn in (("batched", batched), ("one_by_one", one_by_one)):
            t = time.perf_counter()
            out[name] = fn()
            times[name].append(time.perf_counter() - t)
    med = {k: round(statistics.median(v), 3) for k, v in times.items()}
    emit({
        **provenance(), "threads": args.threads, "images": source, "repeats": args.repeats,
        "seconds": med, "speedup": round(med["one_by_one"] / med["batched"], 1),
        "same_values": bool(torch.equal(out["batched"], out["one_by_one"])),
    }, args.out)


if __name__ == "__main__":
    main()
