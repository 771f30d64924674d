"""TensorBatches against torch's DataLoader (the reference): same batches in the same order
epoch after epoch, the same trained model bit for bit, the same evaluation; fedshard's data
sets' ``example_tensors()`` against their own ``__getitem__``; the ClientApp path uses it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fedshard.client.train import TrainConfig, evaluate, train
from fedshard.client.train.batches import HasTensors, TensorBatches, batches_for
from fedshard.data.images import ImageArrays, ImageDataset
from fedshard.data.shakespeare import ShakespeareDataset
from fedshard.models import resnet18
from fedshard.settings import LocalTraining
from fedshard.spectral import shard_model


def _pairs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 4, 4, generator=g), torch.randint(0, 5, (n,), generator=g)


def _epochs(loader: object, epochs: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    return [[(x.clone(), y.clone()) for x,
             y in loader] for _ in range(epochs)]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("n", "batch_size"), [(30, 8), (32, 8), (5, 8), (1, 1), (97, 32)])
@pytest.mark.parametrize("seed", [None, 0, 123])
def test_batches_equal_the_dataloaders_epoch_after_epoch(
    n: int, batch_size: int, seed: int | None
) -> None:
    x, y = _pairs(n)
    ref = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=seed is not None,
                     generator=None if seed is None else torch.Generator().manual_seed(seed))
    got = TensorBatches(x, y, batch_size, seed=seed)
    assert len(got) == len(ref) and got.num_examples == n
    want_epochs, got_epochs = _epochs(ref, 4), _epochs(got, 4)
    for want, have in zip(want_epochs, got_epochs, strict=True):
        assert len(want) == len(have)
        for (wx, wy), (hx, hy) in zip(want, have, strict=True):
            assert torch.equal(wx, hx) and torch.equal(wy, hy)
    if seed is not None and n > 2:  # shuffled, and differently in every epoch
        firsts = [e[0][1].tolist() for e in got_epochs]
        assert firsts[0] != firsts[1] or firsts[1] != firsts[2]


def test_another_seed_gives_another_order() -> None:
    x, y = _pairs(64)
    a = [b[1] for b in TensorBatches(x, y, 16, seed=1)]
    b = [b[1] for b in TensorBatches(x, y, 16, seed=2)]
    assert not all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert torch.equal(torch.sort(torch.cat(a)).values, torch.sort(y).values)  # a permutation


def _images(n: int, channels: int, size: int, seed: int) -> ImageArrays:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, channels, size, size), dtype=np.uint8)
    images[0] = 7  # a constant image: the standard deviation's floor
    return ImageArrays(images=images, labels=rng.integers(0, 10, n).astype(np.int64))


@pytest.mark.parametrize(("channels", "size"), [(1, 28), (3, 32), (3, 64)])
def test_image_tensors_equal_getitem(channels: int, size: int) -> None:
    data = ImageDataset(_images(37, channels, size, seed=size))
    assert isinstance(data, HasTensors)
    inputs, targets = data.example_tensors()
    assert inputs.dtype == torch.float32 and inputs.shape == (37, channels, size, size)
    for i in range(len(data)):
        x, y = data[i]
        assert torch.equal(inputs[i], x) and torch.equal(targets[i], y)


def test_empty_image_dataset_gives_no_batches_and_train_refuses() -> None:
    data = ImageDataset(_images(1, 1, 28, seed=0).subset(np.array([], dtype=np.int64)))
    batches = batches_for(data, 8, seed=0)
    assert isinstance(batches, TensorBatches) and list(batches) == []
    with pytest.raises(ValueError, match="yielded no batches; nothing was trained"):
        train(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)), batches,
              TrainConfig(recipe=LocalTraining(local_epochs=1), log_every_epoch=False))


def test_shakespeare_tensors_equal_getitem() -> None:
    rows = np.random.default_rng(3).integers(0, 80, (11, 81)).astype(np.int64)
    data = ShakespeareDataset(rows)
    inputs, targets = data.example_tensors()
    assert inputs.shape == targets.shape == (11, 80) and inputs.dtype == torch.int64
    for i in range(len(data)):
        x, y = data[i]
        assert torch.equal(inputs[i], x) and torch.equal(targets[i], y)


def _submodel(dtype: torch.dtype) -> torch.nn.Module:
    dense = resnet18(num_classes=10, width=8, seed=0).to(dtype)
    layers = {"layer1.0.conv1": [0, 1, 2], "layer3.1.conv1": [0, 2, 4, 6]}
    omegas = {k: torch.linspace(1.0, 9.0, len(v), dtype=dtype) for k, v in layers.items()}
    return shard_model(dense, layers, omegas)[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_training_on_tensor_batches_gives_the_dataloaders_model_bit_for_bit(
    dtype: torch.dtype,
) -> None:
    data = ImageDataset(_images(45, 3, 32, seed=5))
    cfg = TrainConfig(recipe=LocalTraining(local_epochs=2, lr=0.03), torch_seed=4,
                      log_every_epoch=False)
    ref_model, got_model = _submodel(dtype), _submodel(dtype)
    inputs, targets = data.example_tensors()
    # float32: the data set itself through a DataLoader (what the ClientApp did before)
    reference: Dataset[tuple[torch.Tensor, torch.Tensor]] = (
        data if dtype == torch.float32 else TensorDataset(inputs.to(dtype), targets))
    ref = train(ref_model, DataLoader(reference, batch_size=16, shuffle=True,
                                      generator=torch.Generator().manual_seed(11)), cfg)
    got = train(got_model, TensorBatches(inputs.to(dtype), targets, 16, seed=11), cfg)
    assert (got.loss, got.accuracy, got.num_examples) == (ref.loss, ref.accuracy, ref.num_examples)
    for (name, a), (_, b) in zip(ref_model.state_dict().items(),
                                 got_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    e_ref = evaluate(got_model, DataLoader(TensorDataset(inputs.to(dtype), targets),
                                           batch_size=7))
    e_got = evaluate(got_model, TensorBatches(inputs.to(dtype), targets, 7))
    assert e_got == e_ref


class _Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """No ``example_tensors()``: its examples may change between reads, so a DataLoader reads it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(2), torch.tensor(i)


def test_batches_for_holds_only_what_fits_and_has_tensors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert isinstance(batches_for(_Augmented(), 2, seed=0), DataLoader)
    x, y = _pairs(9)
    assert isinstance(batches_for(TensorDataset(x, y), 2, seed=0), TensorBatches)
    assert isinstance(batches_for(TensorDataset(x, y, y), 2, seed=0), DataLoader)  # not a pair
    data = ImageDataset(_images(10, 1, 28, seed=1))
    assert isinstance(batches_for(data, 4, seed=0), TensorBatches)
    with caplog.at_level(logging.INFO, logger="fedshard.client.train.batches"):
        big = batches_for(data, 4, seed=0, max_bytes=1000)
    assert isinstance(big, DataLoader)
    assert "take 0.00 GiB as tensors (more than 0.00 GiB): read through a DataLoader" in caplog.text
    # both ways give the same batches
    for (a, b), (c, d) in zip(big, batches_for(data, 4, seed=0), strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_bad_arguments_are_refused() -> None:
    x, y = _pairs(6)
    with pytest.raises(ValueError, match=r"batch_size=0: expected an int >= 1"):
        TensorBatches(x, y, 0)
    with pytest.raises(ValueError, match=r"batch_size=True: expected an int >= 1"):
        TensorBatches(x, y, True)
    with pytest.raises(ValueError, match=r"inputs \(6, 3, 4, 4\) and targets \(5,\): expected "
                                         r"the same first dimension"):
        TensorBatches(x, y[:5], 2)

    class Liar(ImageDataset):
        def __len__(self) -> int:
            return 99

    with pytest.raises(ValueError, match=r"Liar.example_tensors\(\) gave 3 examples but the "
                                         r"data set has 99"):
        TensorBatches.from_dataset(Liar(_images(3, 1, 28, seed=0)), 2)
    with pytest.raises(ValueError, match=r"Liar.example_tensors\(\) gave 3 examples"):
        batches_for(Liar(_images(3, 1, 28, seed=0)), 2, seed=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_equal_the_cpu_ones() -> None:
    x, y = _pairs(50)
    cpu = list(TensorBatches(x, y, 16, seed=3))
    gpu = TensorBatches(x, y, 16, seed=3, device="cuda")
    assert gpu.inputs.is_cuda
    for (a, b), (c, d) in zip(cpu, gpu, strict=True):
        assert c.is_cuda and torch.equal(a, c.cpu()) and torch.equal(b, d.cpu())


def test_the_apps_train_and_evaluate_without_a_dataloader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fedshard's own ClientApp and the server's central evaluation hold their data as
    TensorBatches: a run with DataLoader iteration made to fail still trains and evaluates."""
    import fakedata
    from flower_grid import InProcessGrid

    import client_app
    from fedshard.app.config import RunConfig
    from fedshard.app.run import run_server

    def refuse(self: DataLoader[Any]) -> None:
        raise AssertionError("a DataLoader was iterated")

    monkeypatch.setattr(DataLoader, "__iter__", refuse)
    fakedata.write_fashion_mnist(tmp_path / "data", 60, 20, np.random.default_rng(0))
    cfg = {"dataset": "fashion-mnist", "data-dir": str(tmp_path / "data"), "model": "mlp",
           "model-width": 16, "num-server-rounds": 1, "num-partitions": 3,
           "min-available-nodes": 3, "fraction-train": 1.0, "fraction-evaluate": 1.0,
           "batch-size": 8, "results-dir": str(tmp_path / "out"), "run-name": "r", "seed": 1}
    grid = InProcessGrid(client_app.app, [{"partition-id": i, "num-partitions": 3}
                                          for i in range(3)], cfg)
    run_server(grid, RunConfig.from_mapping(cfg))
    rows = [json.loads(x) for x in (tmp_path / "out" / "r" / "metrics.jsonl").open()]
    last = rows[-1]
    assert last["round"] == 1 and last["replies-used"] == 3, last
    assert "test-accuracy" in last and "eval-accuracy" in last, last


@pytest.mark.parametrize("ignored", [False, True])
def test_next_token_targets_train_alike_through_both_loaders(ignored: bool) -> None:
    """(B, T) targets, with and without ignored ones (-100): TensorBatches (whose steps count
    every target on the host when none is ignored) and a DataLoader (whose steps count on the
    device) report the same loss, accuracy and targets and train the same model bit for bit;
    the loss is the mean over the counted targets, checked against a brute force."""
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, 7, (30, 6), generator=g)
    targets = torch.randint(0, 7, (30, 6), generator=g)
    if ignored:
        targets[torch.rand(30, 6, generator=g) < 0.3] = -100

    def model() -> torch.nn.Module:
        torch.manual_seed(2)
        return torch.nn.Sequential(torch.nn.Embedding(7, 5), torch.nn.Linear(5, 7))

    cfg = TrainConfig(recipe=LocalTraining(local_epochs=2, lr=0.1), torch_seed=1,
                      log_every_epoch=False)
    ref_model, got_model = model(), model()
    ref = train(ref_model, DataLoader(TensorDataset(tokens, targets), batch_size=8,
                                      shuffle=True, generator=torch.Generator().manual_seed(3)),
                cfg)
    got = train(got_model, TensorBatches(tokens, targets, 8, seed=3), cfg)
    assert (got.loss, got.accuracy, got.num_examples) == (ref.loss, ref.accuracy, ref.num_examples)
    for (name, a), (_, b) in zip(ref_model.state_dict().items(),
                                 got_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # brute force: one step from a fresh model on the first batch, its loss by hand
    fresh = model()
    one = train(fresh, TensorBatches(tokens[:8], targets[:8], 8), TrainConfig(
        recipe=LocalTraining(local_epochs=1, lr=0.1), log_every_epoch=False))  # (before its step)
    logits = model()(tokens[:8])
    kept = targets[:8] != -100
    want = torch.nn.functional.log_softmax(logits, -1).gather(
        -1, targets[:8].clamp_min(0).unsqueeze(-1)).squeeze(-1)[kept].neg().mean()
    assert one.loss == pytest.approx(float(want), rel=1e-6)
    correct = (logits.argmax(-1) == targets[:8])[kept].float().mean()
    assert one.accuracy == pytest.approx(float(correct))
