"""The width of equal cost, against FLOPs and bytes counted by hand for the MLP and by
brute force over every width."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedshard.models import mlp
from fedshard.spectral import sharded_layer_names
from fedshard.spectral.budget import sharding_budget
from fedshard.width import WidthFamily, match_width, state_bytes, training_memory

IN, CLASSES, DEPTH, WIDTH = 20, 4, 3, 24


def _family() -> WidthFamily:
    return WidthFamily(lambda w: mlp(IN, CLASSES, width=w, depth=DEPTH), WIDTH)


def _hand_flops(w: int) -> int:
    """2 FLOPs per multiply-add of one example through in → w → w → w → classes."""
    return 2 * (IN * w + (DEPTH - 1) * w * w + w * CLASSES)


def _hand_spectral_flops(r: float) -> int:
    """The first and last layer dense, each w×w layer as n = ⌈rN⌉ terms: x ↦ U(Vᵀx)."""
    n = math.ceil(r * WIDTH)
    return 2 * (IN * WIDTH + (DEPTH - 1) * 2 * WIDTH * n + WIDTH * CLASSES)


def _setup():
    family = _family()
    model = family(WIDTH)
    x = torch.zeros(1, IN)
    return family, model, x, sharded_layer_names(model, example_input=x)


@pytest.mark.parametrize("r", [0.1, 0.2, 0.4, 1.0])
def test_flops_match_is_the_nearest_width_by_brute_force(r):
    family, model, x, layers = _setup()
    m = match_width(family, r, "flops", model=model, sharded_layers=layers, example_input=x)
    assert m.spectral_flops == _hand_spectral_flops(r)
    assert m.dense_flops == _hand_flops(WIDTH)
    best = min(family.widths, key=lambda w: (abs(_hand_flops(w) - m.spectral_flops), w))
    assert m.width == best and m.flops == _hand_flops(best)
    assert m.width_ratio == best / WIDTH


@pytest.mark.parametrize("r", [0.1, 0.3])
def test_bytes_match_is_the_nearest_width_by_brute_force(r):
    family, model, x, layers = _setup()
    m = match_width(family, r, "bytes", model=model, sharded_layers=layers, example_input=x)
    spectral = sharding_budget(model, layers, [r]).at(r).received_bytes
    assert m.spectral_received_bytes == spectral
    sizes = {w: state_bytes(family.shapes(w), model) for w in family.widths}
    assert m.width == min(sizes, key=lambda w: (abs(sizes[w] - spectral), w))
    assert m.bytes == sizes[m.width]
    # the bytes of a state dict: its parameters in float32 and one .npy header per array
    params = sum(math.prod(s) for s in family.shapes(m.width).values())
    assert 4 * params < m.bytes < 4 * params + 200 * len(family.shapes(m.width))


def test_keep_ratio_match_is_heterofls_rate_and_errors_name_the_value():
    family, model, _, layers = _setup()
    m = match_width(family, 0.25, "keep-ratio", model=model, sharded_layers=layers)
    assert m.width == 6 and m.flops is None and "width 6 of 24" in m.line()
    with pytest.raises(ValueError, match="match='widest'"):
        match_width(family, 0.25, "widest", model=model, sharded_layers=layers)
    with pytest.raises(ValueError, match="example input"):
        match_width(family, 0.25, "flops", model=model, sharded_layers=layers)


def test_training_memory_counts_parameters_and_saved_activations():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3))
    x, y = torch.randn(5, 10), torch.zeros(5, dtype=torch.long)
    got = training_memory(model, x, y)
    params = 4 * (10 * 7 + 7 + 7 * 3 + 3)
    assert got["parameters"] == got["gradients"] == got["optimizer"] == params
    # autograd keeps the input (5×10), ReLU's output (5×7, read by the second matmul and
    # ReLU's backward) and the logits' softmax for the loss (5×3), all float32
    assert 4 * (5 * 10 + 5 * 7) <= got["activations"] <= 4 * (5 * 10 + 2 * 5 * 7 + 2 * 5 * 3)
    assert got["total"] == 3 * params + got["activations"]
