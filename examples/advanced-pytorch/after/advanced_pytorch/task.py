"""advanced_pytorch: A Flower / PyTorch app (model, data, training and evaluation)."""

import gzip
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner
from torch import nn
from torch.utils.data import DataLoader

# Fashion-MNIST's four idx files (Debian's dataset-fashion-mnist package puts them here).
DATA_DIR = Path(os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
# Use the first examples of each split only (None: all); a smoke test lowers it.
MAX_EXAMPLES: int | None = None
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST's pixel statistics


class Net(nn.Module):
    """A small CNN for 28x28 grayscale images; `head` is the classification head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc = nn.Linear(32 * 4 * 4, 128)
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))  # (B, 16, 12, 12)
        x = self.pool(F.relu(self.conv2(x)))  # (B, 32, 4, 4)
        x = F.relu(self.fc(x.flatten(1)))  # (B, 128)
        return self.head(x)


def fashion_mnist(split: str) -> Dataset:
    """One split of Fashion-MNIST as a `datasets.Dataset` with columns "image", "label".

    Read from the local idx files; to use the Hugging Face Hub copy instead, return
    `datasets.load_dataset("zalando-datasets/fashion_mnist", split=split)`: its PIL images
    go through the same transforms.
    """
    prefix = "train" if split == "train" else "t10k"
    with gzip.open(DATA_DIR / f"{prefix}-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28 * 28)
    with gzip.open(DATA_DIR / f"{prefix}-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)
    images, labels = images[:MAX_EXAMPLES], labels[:MAX_EXAMPLES]
    rows = pa.FixedSizeListArray.from_arrays(pa.array(images.reshape(-1)), 28)
    column = pa.FixedSizeListArray.from_arrays(rows, 28)  # (N, 28, 28) uint8
    return Dataset(pa.table({"image": column, "label": pa.array(labels)}))


def apply_transforms(batch):
    """Images (PIL or nested lists) to normalized (1, 28, 28) float tensors."""
    batch["image"] = [
        (torch.from_numpy(np.asarray(img, dtype=np.float32))[None] / 255 - MEAN) / STD
        for img in batch["image"]
    ]
    return batch


partitioner = None  # Cache the partitioner (and the data set it partitions)


def load_data(partition_id: int, num_partitions: int, alpha: float):
    """This node's train and validation loaders: a Dirichlet(alpha) label split, 80/20."""
    global partitioner
    if partitioner is None:
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions, partition_by="label", alpha=alpha, seed=42
        )
        partitioner.dataset = fashion_mnist("train")
    partition = partitioner.load_partition(partition_id)
    split = partition.train_test_split(test_size=0.2, seed=42)
    trainloader = DataLoader(
        split["train"].with_transform(apply_transforms), batch_size=32, shuffle=True
    )
    valloader = DataLoader(split["test"].with_transform(apply_transforms), batch_size=32)
    return trainloader, valloader


def load_centralized_dataset():
    """The test split, for the server's evaluation of the global model."""
    return DataLoader(fashion_mnist("test").with_transform(apply_transforms), batch_size=256)


def train(net, trainloader, epochs, lr, device, attach=None):
    """Train the model on the training set; return the mean training loss."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    if attach is not None:  # e.g. fedshard's client rules, on this optimizer's steps
        attach(optimizer)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["image"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net, testloader, device):
    """Evaluate the model; return the mean loss and the accuracy."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for batch in testloader:
            images = batch["image"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (outputs.argmax(1) == labels).sum().item()
    n = len(testloader.dataset)
    return loss / n, correct / n
