"""The layer policies of ``sharded_layer_names`` and the WARNING about layers an example
forward pass does not reach."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fedshard.models import cct_6_3x2, char_transformer, mlp, resnet18
from fedshard.spectral import LAYER_POLICIES, shardable_layers, sharded_layer_names

SELECTION_LOGGER = "fedshard.spectral.selection"
RESNET_SHARDED = [
    f"layer{s}.{b}.conv{c}" for s in range(1, 5) for b in range(2) for c in (1, 2)
] + [f"layer{s}.0.downsample.0" for s in (2, 3, 4)]


class Autoencoder(nn.Module):
    """784 → 64 → 3 → 64 → 784."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1, self.enc2 = nn.Linear(784, 64), nn.Linear(64, 3)
        self.dec1, self.dec2 = nn.Linear(3, 64), nn.Linear(64, 784)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        code = self.enc2(torch.relu(self.enc1(x)))  # (B, 3)
        return self.dec2(torch.relu(self.dec1(code)))  # (B, 784)


class EncoderForward(Autoencoder):
    """forward() returns the code only: the decoder runs in the user's loss, not here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc2(torch.relu(self.enc1(x)))  # (B, 3)


# --- "by-size" ----------------------------------------------------------------------------------

def test_the_policies_on_the_autoencoder() -> None:
    model = Autoencoder()
    assert LAYER_POLICIES == ("paper", "by-size")
    assert sharded_layer_names(model) == ["enc2", "dec1"]  # the default is unchanged
    assert sharded_layer_names(model, policy="paper") == ["enc2", "dec1"]
    # By hand, float32 with a 128-byte header per array. A bottleneck layer's weight costs
    # 4·192 + 128 = 896 bytes; n of its 3 terms cost 4·67n (u, v) + 4n (omega) + 8n
    # (indices) + 4·128: 792 bytes for n = 1 (r ≤ 1/3), 1,072 for n = 2 (r = 0.5). The
    # 784×64 ends hold 99.6 % of the weights, far more than the average layer.
    assert sharded_layer_names(model, policy="by-size", keep_ratio=0.25) == [
        "enc1", "enc2", "dec1", "dec2"]
    assert sharded_layer_names(model, policy="by-size", keep_ratio=0.5) == ["enc1", "dec2"]
    # n = 61 of 64 terms of a 784×64 layer: 61·848 entries > 50,176
    assert sharded_layer_names(model, policy="by-size", keep_ratio=0.95) == []
    assert sharded_layer_names(model, policy="by-size", keep_ratio=0.25,
                               exclude=["dec2"]) == ["enc1", "enc2", "dec1"]


def test_by_size_follows_the_forward_order_for_the_ends() -> None:
    model, x = Autoencoder(), torch.zeros(1, 784)
    # registration order reversed: the ends are still enc1 and dec2 (the big ones) by forward
    reordered = nn.Module()
    for name in ("dec2", "dec1", "enc2", "enc1"):
        reordered.add_module(name, getattr(model, name))
    reordered.forward = model.forward  # type: ignore[method-assign]
    assert sharded_layer_names(reordered, example_input=x, policy="by-size",
                               keep_ratio=0.5) == ["enc1", "dec2"]


def test_by_size_keeps_a_small_classifier_head_and_stem_dense() -> None:
    # the MLP's first layer holds 43 % of the weights: sharded; the 10×512 head stays dense
    assert sharded_layer_names(mlp(784, 10), policy="by-size", keep_ratio=0.1) == [
        "net.1", "net.4", "net.7"]
    assert sharded_layer_names(mlp(784, 10)) == ["net.4", "net.7"]
    # square 512×512 layers break even at r = 0.5 (n (512 + 512) = 512²), plus the headers
    assert sharded_layer_names(mlp(784, 10), policy="by-size", keep_ratio=0.5) == ["net.1"]
    # ResNet-18: tiny stem and head, every middle conv saves bytes: the paper's layers
    model = resnet18(10, 3, seed=0)
    paper = sharded_layer_names(model)
    assert sorted(paper) == sorted(RESNET_SHARDED)
    assert sharded_layer_names(model, policy="by-size", keep_ratio=0.25) == paper
    # at width 8 a 16×8 1x1 downsampling conv is smaller than its headers: n = 2 terms cost
    # 4·2·(16 + 8) + 4·2 + 8·2 + 4·128 = 728 bytes, the weight 4·128 + 128 = 640
    narrow = resnet18(10, 3, width=8, seed=0)
    assert sharded_layer_names(narrow, policy="by-size", keep_ratio=0.25) == [
        n for n in sharded_layer_names(narrow) if n != "layer2.0.downsample.0"]


def test_by_size_leaves_out_a_layer_that_cannot_save_anything() -> None:
    model = cct_6_3x2(10)
    paper = sharded_layer_names(model)
    by_size = sharded_layer_names(model, policy="by-size", keep_ratio=0.1)
    # pool.score is 1×256: N = 1, its single term costs more than the weight at any r
    assert "pool.score" in paper
    assert by_size == [n for n in paper if n != "pool.score"]


def test_policy_arguments_are_checked() -> None:
    model = Autoencoder()
    with pytest.raises(ValueError, match=r"policy='largest': expected one of \('paper', "
                                         r"'by-size'\); no layers were chosen"):
        sharded_layer_names(model, policy="largest")
    with pytest.raises(ValueError, match="policy='by-size' needs keep_ratio, the smallest keep "
                                         "ratio below 1"):
        sharded_layer_names(model, policy="by-size")
    with pytest.raises(ValueError, match=r"keep_ratio=0.5 is read only by policy='by-size', "
                                         r"not policy='paper'"):
        sharded_layer_names(model, keep_ratio=0.5)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"keep_ratio={bad!r}: expected the smallest keep "
                                             r"ratio the nodes use, in \(0, 1\]"):
            sharded_layer_names(model, policy="by-size", keep_ratio=bad)


def test_shardable_layers_are_the_exact_linear_and_groups_1_conv_layers() -> None:
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(4, 8, 3), nn.Flatten(),
                          nn.LazyLinear(5), nn.Linear(5, 5), nn.Linear(5, 5))
    model[5].weight = model[4].weight  # tied
    assert shardable_layers(model) == ["1"]


# --- the example_input pass ---------------------------------------------------------------------

def test_a_layer_the_example_pass_does_not_reach_is_named(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fedshard")
    names = sharded_layer_names(EncoderForward(), example_input=torch.zeros(1, 784))
    # the ends come from the reached layers (enc1, enc2): the unreached decoder is sharded
    assert names == ["dec1", "dec2"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].name == "fedshard.spectral.selection"
    text = warnings[0].getMessage()
    assert ("did not reach 2 Linear/Conv2d layer(s): 'dec1' (sharded), 'dec2' (sharded)"
            in text)
    assert "(first 'enc1', last 'enc2')" in text
    caplog.clear()
    sharded_layer_names(EncoderForward(), example_input=torch.zeros(1, 784), include=["dec1"])
    (record,) = [r for r in caplog.records if r.name == SELECTION_LOGGER]
    assert "'dec1' (sharded), 'dec2' (left dense)" in record.getMessage()
    assert "The layers were named (include): only their order came from" in record.getMessage()
    assert "SpectralSharding(sharded_layers=[...])" in text


def test_an_unreached_layer_left_dense_is_named_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fedshard")
    sharded_layer_names(EncoderForward(), example_input=torch.zeros(1, 784), exclude=["dec1"])
    (record,) = [r for r in caplog.records if r.name == SELECTION_LOGGER]
    assert "'dec1' (left dense), 'dec2' (sharded)" in record.getMessage()


@pytest.mark.parametrize("build, x", [
    (Autoencoder, torch.zeros(1, 784)),
    (lambda: resnet18(10, 3, width=8, seed=0), torch.zeros(1, 3, 16, 16)),
    (lambda: char_transformer(20, block_size=8), torch.zeros(1, 8, dtype=torch.long)),
])
def test_no_warning_when_the_pass_reaches_every_layer(
        build: type[nn.Module], x: torch.Tensor, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fedshard")
    sharded_layer_names(build(), example_input=x)
    sharded_layer_names(build())  # nor without an example input
    assert [r for r in caplog.records if r.name == SELECTION_LOGGER] == []
