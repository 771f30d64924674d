"""pytorchexample: A Flower / PyTorch app (Fashion-MNIST from local idx files)."""

import gzip
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

DATA_DIR = Path(os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
# Training examples per partition (None: all); a smoke test lowers it.
MAX_EXAMPLES: int | None = None


class Net(nn.Module):
    """LeNet-style CNN for 28x28 grayscale images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def _read(split):
    prefix = "train" if split == "train" else "t10k"
    with gzip.open(DATA_DIR / f"{prefix}-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(DATA_DIR / f"{prefix}-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    return images, labels


class DictDataset(Dataset):
    """Samples as flwr-datasets gives them: {"img": (1, 28, 28) tensor, "label": int tensor}."""

    def __init__(self, images, labels):
        self.img = torch.from_numpy((images.astype(np.float32) / 255 - 0.5) / 0.5)
        self.label = torch.from_numpy(labels.astype(np.int64))

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return {"img": self.img[i], "label": self.label[i]}


def load_data(partition_id: int, num_partitions: int):
    """This partition's train and validation loaders (IID split, 80/20)."""
    images, labels = _read("train")
    part = np.array_split(np.random.default_rng(42).permutation(len(labels)), num_partitions)
    idx = part[partition_id][:MAX_EXAMPLES]
    cut = int(0.8 * len(idx))
    train = DictDataset(images[idx[:cut]], labels[idx[:cut]])
    val = DictDataset(images[idx[cut:]], labels[idx[cut:]])
    return DataLoader(train, batch_size=32, shuffle=True), DataLoader(val, batch_size=32)


def load_centralized_dataset(max_examples=None):
    """The test split."""
    images, labels = _read("test")
    return DataLoader(DictDataset(images[:max_examples], labels[:max_examples]), batch_size=256)


def train(net, trainloader, epochs, lr, device, attach=None):
    """Train the model on the training set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    if attach is not None:  # e.g. fedshard's client rules, on this optimizer's steps
        attach(optimizer)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
