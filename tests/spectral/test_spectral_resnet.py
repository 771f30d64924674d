"""The paper's ResNet-18: stem, normalization, widths, input sizes, seeding."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from fedshard.models import resnet18
from fedshard.spectral import shard_model


def _signature(model: nn.Module) -> list[tuple[str, str]]:
    return [(name, type(m).__name__) for name, m in model.named_modules()]


@pytest.mark.parametrize(("in_channels", "size"), [(3, 32), (1, 28)])
def test_output_shape_for_cifar_and_mnist_sized_inputs(in_channels: int, size: int) -> None:
    model = resnet18(num_classes=7, in_channels=in_channels, width=8, seed=0)
    x = torch.randn(2, in_channels, size, size, generator=torch.Generator().manual_seed(0))
    assert model(x).shape == (2, 7)


def test_paper_architecture_details() -> None:
    model = resnet18(width=16, seed=0)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert not any(isinstance(m, (nn.MaxPool2d, nn.BatchNorm2d)) for m in model.modules())
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == 1 + 8 * 2 + 3  # stem, two per block, three projection shortcuts
    assert all(m.num_groups == 2 for m in norms)
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 1 + 16 + 3
    assert [model.get_submodule(f"layer{i}.0.conv1").out_channels for i in range(1, 5)] == [
        16,
        32,
        64,
        128,
    ]
    assert model.fc.in_features == 128


def test_width_changes_channels_but_not_structure() -> None:
    assert _signature(resnet18(width=16)) == _signature(resnet18(width=64))
    # Standard ResNet-18 parameter count (CIFAR stem, 10 classes) is ~11.2M.
    assert 11.1e6 < sum(p.numel() for p in resnet18(width=64).parameters()) < 11.3e6


def test_seed_makes_initialization_reproducible_without_touching_global_rng() -> None:
    before = torch.get_rng_state()
    a, b, c = resnet18(width=8, seed=1), resnet18(width=8, seed=1), resnet18(width=8, seed=2)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a.layer2[0].conv1.weight, b.layer2[0].conv1.weight)
    assert not torch.equal(a.layer2[0].conv1.weight, c.layer2[0].conv1.weight)


def test_model_and_submodel_pickle() -> None:
    """Flower simulation / multiprocessing ship models by pickling."""
    model = resnet18(width=8, seed=0)
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    clone = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)
    sub, _ = shard_model(model, {"layer1.0.conv1": [0, 1]}, {"layer1.0.conv1": torch.ones(2)})
    torch.testing.assert_close(pickle.loads(pickle.dumps(sub))(x), sub(x), rtol=0, atol=0)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="width=15 is not divisible by norm_groups=2"):
        resnet18(width=15)
    with pytest.raises(ValueError, match=r"in_channels=0: expected an int >= 1"):
        resnet18(in_channels=0)
