"""Width slicing's channels and averages against the papers' descriptions and brute force.

- Which channels a node gets: HeteroFL (Diao et al., 2021, Sec. 3.1) and FjORD (Horváth et
  al., 2021, Sec. 3.1) the first ⌈ρK⌉ channels every round; FedRolex (Alam et al., 2022,
  Eq. 2) the window {t, …, t+k−1} mod K in round t, which covers every channel in K rounds.
- The narrow model is the global one restricted to those channels: for a network without
  normalization, its output equals the global network's with every other hidden unit's
  weights zeroed (an independent construction of the same function).
- The average: every element the weighted mean over the nodes whose slice holds it, computed
  element by element with Python loops.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from fedshard.models import mlp
from fedshard.models.resnet import resnet18
from fedshard.width import (
    SliceUpdate,
    WidthFamily,
    aggregate_slices,
    channel_indices,
    slice_indices,
    take,
)


class TwoHidden(nn.Module):
    """in → h → h → out, ReLU, no normalization: a narrow copy is exactly a masked full copy."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, width), nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _family() -> WidthFamily:
    return WidthFamily(TwoHidden, 8)


# ------------------------------------------------------------------------------ channels
@pytest.mark.parametrize("method", ["heterofl", "ordered-dropout"])
def test_static_methods_take_the_first_channels_every_round(method):
    for t in (1, 2, 17):
        assert channel_indices(method, 10, 4, t).tolist() == [0, 1, 2, 3]


def test_fedrolex_window_rolls_one_channel_a_round_and_wraps():
    assert channel_indices("fedrolex", 10, 4, 1).tolist() == [1, 2, 3, 4]
    assert channel_indices("fedrolex", 10, 4, 2).tolist() == [2, 3, 4, 5]
    assert channel_indices("fedrolex", 10, 4, 8).tolist() == [8, 9, 0, 1]
    assert channel_indices("fedrolex", 10, 4, 10).tolist() == [0, 1, 2, 3]  # t mod K
    assert channel_indices("fedrolex", 10, 10, 3).tolist() == list(range(10))  # whole: in order


def test_fedrolex_trains_every_channel_within_k_rounds_heterofl_never_does():
    K, k = 12, 5
    rolled = set().union(*(channel_indices("fedrolex", K, k, t).tolist() for t in range(1, K + 1)))
    static = set().union(*(channel_indices("heterofl", K, k, t).tolist() for t in range(1, K + 1)))
    assert rolled == set(range(K))
    assert static == set(range(k))


@pytest.mark.parametrize("args", [("top-n", 4, 2, 1), ("heterofl", 4, 5, 1),
                                  ("heterofl", 4, 0, 1)])
def test_channel_indices_reject_bad_input(args):
    with pytest.raises(ValueError, match="expected"):
        channel_indices(*args)


# ------------------------------------------------------------------------------ slices
@pytest.mark.parametrize("method,t", [("heterofl", 1), ("fedrolex", 3), ("fedrolex", 7)])
def test_consecutive_layers_share_the_hidden_channels(method, t):
    family = WidthFamily(lambda w: mlp(12, 4, width=w, depth=3), 10)
    index = slice_indices(family.shapes(10), family.shapes(6), method, t)
    linears = [k[:-len(".weight")] for k, s in family.shapes(10).items()
               if k.endswith(".weight") and len(s) == 2]
    for a, b in itertools.pairwise(linears):
        np.testing.assert_array_equal(index[f"{a}.weight"][0], index[f"{b}.weight"][1])
        np.testing.assert_array_equal(index[f"{a}.weight"][0], index[f"{a}.bias"][0])
    assert index[f"{linears[0]}.weight"][1].tolist() == list(range(12))  # inputs whole
    assert index[f"{linears[-1]}.weight"][0].tolist() == list(range(4))  # classes whole


def test_resnet_slices_keep_residual_channels_aligned():
    family = WidthFamily(lambda w: resnet18(10, 1, w), 16, multiple=2)
    index = slice_indices(family.shapes(16), family.shapes(6), "fedrolex", 5)
    # a block's output channels are added to its input's: the same global channels
    np.testing.assert_array_equal(index["layer1.0.conv2.weight"][0],
                                  index["conv1.weight"][0])
    np.testing.assert_array_equal(index["layer2.0.conv2.weight"][0],
                                  index["layer2.0.downsample.0.weight"][0])
    np.testing.assert_array_equal(index["layer2.0.conv1.weight"][1], index["bn1.weight"][0])
    assert len(index["layer4.1.conv2.weight"][0]) == 6 * 8


def test_slice_indices_names_every_entry_that_is_not_a_slice():
    with pytest.raises(ValueError, match=r"a\.weight.*b\.bias.*no larger"):
        slice_indices({"a.weight": (4, 3), "b.bias": (4,)},
                      {"a.weight": (5, 3), "b.bias": (2, 1)}, "heterofl", 1)


def test_take_matches_element_by_element_selection():
    rng = np.random.default_rng([1, 2])
    state = {"w": rng.normal(size=(6, 5)).astype(np.float32), "s": np.array(3.0)}
    index = {"w": (np.array([4, 5, 0]), np.array([1, 3])), "s": ()}
    got = take(state, index)
    want = [[state["w"][i, j] for j in (1, 3)] for i in (4, 5, 0)]
    np.testing.assert_array_equal(got["w"], np.array(want, dtype=np.float32))
    assert got["s"] == 3.0 and got["w"].flags.c_contiguous


@pytest.mark.parametrize("method,t", [("heterofl", 1), ("fedrolex", 5), ("fedrolex", 11)])
def test_narrow_model_is_the_global_model_with_the_other_units_silenced(method, t):
    family, width = _family(), 3
    torch.manual_seed(0)
    full = family(8)
    state = {k: v.detach().numpy() for k, v in full.state_dict().items()}
    index = slice_indices(family.shapes(8), family.shapes(width), method, t)
    narrow = family(width)
    narrow.load_state_dict({k: torch.from_numpy(v) for k, v in take(state, index).items()})
    # independently: zero every weight into and out of the hidden units not in the slice
    keep = np.zeros(8, dtype=bool)
    keep[index["a.weight"][0]] = True
    masked = family(8)
    masked.load_state_dict(full.state_dict())
    with torch.no_grad():
        for name in ("a", "b"):
            getattr(masked, name).weight[~keep] = 0
            getattr(masked, name).bias[~keep] = 0
        masked.b.weight[:, ~keep] = 0
        masked.c.weight[:, ~keep] = 0
    x = torch.randn(7, 5)
    torch.testing.assert_close(narrow(x), masked(x), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ average
def _brute_force_average(current, updates):
    out = {}
    for key, now in current.items():
        new = now.astype(np.float64).copy()
        for pos in itertools.product(*(range(s) for s in now.shape)):
            num = den = 0.0
            for u in updates:
                where = [np.flatnonzero(ix == p) for ix, p in zip(u.index[key], pos, strict=True)]
                if all(len(w) for w in where):
                    num += u.weight * float(u.values[key][tuple(int(w[0]) for w in where)])
                    den += u.weight
            if den > 0:
                new[pos] = num / den
        out[key] = new.astype(now.dtype)
    return out


def test_average_is_the_weighted_mean_over_the_holders_of_each_element():
    rng = np.random.default_rng([7, 7])
    current = {"w": rng.normal(size=(6, 4)).astype(np.float32),
               "b": rng.normal(size=(6,)).astype(np.float32)}
    updates = []
    for node, (k, t, method) in enumerate([(2, 1, "heterofl"), (3, 4, "fedrolex"),
                                           (4, 5, "fedrolex"), (6, 2, "heterofl")][:3]):
        index = slice_indices({"w": (6, 4), "b": (6,)}, {"w": (k, 4), "b": (k,)}, method, t)
        values = {key: rng.normal(size=tuple(len(i) for i in ix)).astype(np.float32)
                  for key, ix in index.items()}
        updates.append(SliceUpdate(float(10 * (node + 1)), values, index))
    got = aggregate_slices(current, updates)
    want = _brute_force_average(current, updates)
    for key in current:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6)
        assert got[key].dtype == np.float32
    # rows 0-1 (held by node 0 and maybe others) moved; a row no node held kept its value
    held = set().union(*(set(u.index["w"][0].tolist()) for u in updates))
    for row in set(range(6)) - held:
        np.testing.assert_array_equal(got["w"][row], current["w"][row])


def test_average_keeps_integer_entries_and_the_model_without_updates():
    current = {"steps": np.array([3], dtype=np.int64), "w": np.ones((2, 2), np.float32)}
    assert aggregate_slices(current, [])["w"].tolist() == [[1, 1], [1, 1]]
    update = SliceUpdate(1.0, {"steps": np.array([9]), "w": np.zeros((1, 2), np.float32)},
                         {"steps": (np.arange(1),), "w": (np.arange(1), np.arange(2))})
    got = aggregate_slices(current, [update])
    assert got["steps"].tolist() == [3]
    assert got["w"].tolist() == [[0, 0], [1, 1]]


# ------------------------------------------------------------------------------ family
def test_family_widths_and_heterofl_rounding():
    family = WidthFamily(lambda w: resnet18(10, 1, w), 16, multiple=2)
    assert list(family.widths) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert family.width_for(0.1) == 2  # ⌈1.6⌉ = 2
    assert family.width_for(0.3) == 6  # ⌈4.8⌉ = 5 -> the next multiple
    assert family.width_for(1.0) == 16
    assert WidthFamily(TwoHidden, 8).width_for(0.25) == 2
    assert family.hidden_layers(4)[:2] == ["conv1", "layer1.0.conv1"]
    assert "fc" not in family.hidden_layers(4)


@pytest.mark.parametrize("args,match", [((TwoHidden, 0), "width=0"),
                                        ((TwoHidden, 9, 2), "multiple of"),
                                        ((TwoHidden, 8, True), "multiple=True")])
def test_family_rejects_bad_widths(args, match):
    with pytest.raises(ValueError, match=match):
        WidthFamily(*args)


def test_family_builds_only_its_widths():
    with pytest.raises(ValueError, match=r"width=3: expected a multiple of 2 in \[2, 8\]"):
        WidthFamily(TwoHidden, 8, 2)(3)
    with pytest.raises(ValueError, match="width ratio 0"):
        WidthFamily(TwoHidden, 8).width_for(0)
