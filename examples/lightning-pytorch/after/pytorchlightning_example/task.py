"""pytorchlightning_example: A Flower / PyTorch Lightning app (Fashion-MNIST from local idx
files)."""

import gzip
import logging
import os
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

# Lightning says which accelerator it found at every Trainer; once per node and round is noise
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

DATA_DIR = Path(os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
# Examples per partition (None: all); a smoke test lowers it.
MAX_EXAMPLES: int | None = None


class LitAutoEncoder(pl.LightningModule):
    """An autoencoder 784-64-3-64-784 for 28x28 grayscale images; its loss is the mean
    squared error of the reconstruction, its optimizer Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The reconstruction (B, 784) of images (B, 1, 28, 28)."""
        return self.decoder(self.encoder(x.flatten(1)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def training_step(self, batch, batch_idx) -> torch.Tensor:
        loss = self.reconstruction_loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx) -> None:
        self.log("val_loss", self.reconstruction_loss(batch), prog_bar=True)

    def test_step(self, batch, batch_idx) -> None:
        self.log("test_loss", self.reconstruction_loss(batch), prog_bar=True)

    def reconstruction_loss(self, batch) -> torch.Tensor:
        images, _ = batch
        return F.mse_loss(self(images), images.flatten(1))


def _read(split):
    prefix = "train" if split == "train" else "t10k"
    with gzip.open(DATA_DIR / f"{prefix}-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(DATA_DIR / f"{prefix}-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    return images, labels


def _dataset(images, labels):
    """(image, label) pairs, pixels in [0, 1] as torchvision's ToTensor gives them."""
    return TensorDataset(torch.from_numpy(images.astype(np.float32) / 255),
                         torch.from_numpy(labels.astype(np.int64)))


def load_data(partition_id: int, num_partitions: int):
    """This partition's train, validation and test loaders (IID split, 60/20/20)."""
    images, labels = _read("train")
    part = np.array_split(np.random.default_rng(42).permutation(len(labels)), num_partitions)
    idx = part[partition_id][:MAX_EXAMPLES]
    cut1, cut2 = int(0.6 * len(idx)), int(0.8 * len(idx))
    train, val, test = idx[:cut1], idx[cut1:cut2], idx[cut2:]
    return (DataLoader(_dataset(images[train], labels[train]), batch_size=32, shuffle=True),
            DataLoader(_dataset(images[val], labels[val]), batch_size=32),
            DataLoader(_dataset(images[test], labels[test]), batch_size=32))


def load_centralized_dataset(max_examples=None):
    """The test split."""
    images, labels = _read("test")
    return DataLoader(_dataset(images[:max_examples], labels[:max_examples]), batch_size=256)
