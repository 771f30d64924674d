"""The sharding budget: bytes from shapes against the real wire, FLOPs against hand formulas,
the autoencoder of the user report, and the warning and summary texts."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from fedshard import protocol as P
from fedshard.models import resnet18
from fedshard.sampling import plan_round
from fedshard.spectral import (
    budget_summary,
    budget_warnings,
    layer_cost,
    sharded_layer_names,
    sharding_budget,
)
from fedshard.spectral.budget import forward_flops
from fedshard.spectral.cost import array_bytes, numpy_dtype
from fedshard.spectral.decompose import layer_spectrum


class Autoencoder(nn.Module):
    """784 → 64 → 3 → 64 → 784: the user report's model."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1, self.enc2 = nn.Linear(784, 64), nn.Linear(64, 3)
        self.dec1, self.dec2 = nn.Linear(3, 64), nn.Linear(64, 784)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        code = self.enc2(torch.relu(self.enc1(x)))  # (B, 3)
        return self.dec2(torch.relu(self.dec1(code)))  # (B, 784)


class Small(nn.Module):
    """Conv (with BatchNorm: float and int64 buffers) → conv → two Linear layers."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, dtype=dtype)
        self.norm = nn.BatchNorm2d(8, dtype=dtype)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, bias=False, dtype=dtype)
        self.fc1 = nn.Linear(16 * 6 * 6, 24, dtype=dtype)
        self.fc2 = nn.Linear(24, 5, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv2(torch.relu(self.norm(self.conv1(x))))  # (B, 16, 6, 6)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


@pytest.fixture
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's ``Message`` needs a run id (a ServerApp sets one)."""
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


# --- bytes: the shapes against the real wire ---------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bytes_from_shapes_equal_the_real_messages_both_ways(
        dtype: torch.dtype, task_identity: None) -> None:
    model = Small(dtype)
    layers = ["conv2", "fc1", "conv1"]
    ratios = [0.1, 0.3, 0.5, 1.0]
    budget = sharding_budget(model, layers, ratios)
    arrays = ArrayRecord(model.state_dict())
    # the reference: what the server's round code packs and a node's reply carries
    spectra = {n: layer_spectrum(arrays[f"{n}.weight"].numpy()) for n in layers}
    nodes = [(10 + i, r) for i, r in enumerate(ratios)]
    plan = plan_round({n: s.lam for n, s in spectra.items()}, nodes, "unbiased", "cps",
                      seed=3, server_round=1)
    assert budget.dense_bytes == sum(len(a.data) for a in arrays.values())
    for node, r in nodes:
        record, sent = P.encode_shard(arrays, spectra, plan.terms[node], r)
        assert budget.at(r).received_bytes == sent.bytes_sent
        assert budget.at(r).received_bytes == sum(len(a.data) for a in record.values())
        msg = Message(RecordDict({P.ARRAYS: record, P.CONFIG: ConfigRecord(
            {P.SERVER_ROUND: 1})}), dst_node_id=node, message_type=MessageType.TRAIN)
        msg.metadata.__dict__["_message_id"] = f"m{node}"
        _, state = P.decode_shard(record)
        reply = P.train_reply(msg, state, 10, {})
        reply.metadata.__dict__["_src_node_id"] = node
        checked = P.check_train_reply(reply, sent, set(), node=node, server_round=1)
        assert isinstance(checked, P.TrainReply), checked
        assert budget.at(r).sent_bytes == checked.nbytes


def test_a_budget_from_the_strategys_arrays_counts_the_same_bytes() -> None:
    model = Small(torch.float32)
    from_model = sharding_budget(model, ["fc1"], [0.25])
    from_arrays = sharding_budget(ArrayRecord(model.state_dict()), ["fc1"], [0.25])
    assert from_arrays.ratios == from_model.ratios
    assert from_arrays.dense_bytes == from_model.dense_bytes
    # without the model, every 2-D/4-D weight left dense is listed, kind unknown
    assert [u.name for u in from_model.unsharded] == ["conv2", "conv1", "fc2"]
    assert [u.kind for u in from_arrays.unsharded] == ["4-D weight", "4-D weight", "2-D weight"]


@pytest.mark.parametrize("shape, dtype", [((784, 64), np.float32), ((), np.int64),
                                          ((3,), np.float64), ((16, 8, 3, 3), np.float16)])
def test_array_bytes_are_np_saves_bytes(shape: tuple[int, ...], dtype: type) -> None:
    x = np.zeros(shape, dtype)
    assert array_bytes(shape, dtype) == len(P.encode_array(x).data)
    assert array_bytes(shape, torch.from_numpy(x).dtype) == len(P.encode_array(x).data)


# --- FLOPs: hand formulas -----------------------------------------------------------------------

def test_flops_ratio_of_a_linear_model_is_the_hand_formula() -> None:
    model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 40), nn.ReLU(),
                          nn.Linear(40, 50), nn.ReLU(), nn.Linear(50, 5))
    budget = sharding_budget(model, ["2", "4"], [0.1, 0.5, 1.0],
                             example_input=torch.zeros(1, 20))
    dense = 2 * (20 * 30 + 30 * 40 + 40 * 50 + 50 * 5)  # 2 FLOPs per multiply-add
    assert budget.dense_flops == dense
    for r in (0.1, 0.5):
        n2, n4 = math.ceil(r * 30), math.ceil(r * 40)  # N = min(out, in) = 30 and 40
        factored = 2 * (20 * 30 + (30 * n2 + n2 * 40) + (40 * n4 + n4 * 50) + 50 * 5)
        assert budget.at(r).forward_flops == factored
        assert budget.at(r).flops_ratio == pytest.approx(factored / dense)
    # at r = 1 a node trains all N terms as factors: more than the dense layers
    full = 2 * (20 * 30 + (30 * 30 + 30 * 40) + (40 * 40 + 40 * 50) + 50 * 5)
    assert budget.at(1.0).forward_flops == full


def test_flops_of_a_model_on_another_device_than_its_example_input() -> None:
    """A ServerApp on a GPU counts a model on ``cuda`` with an example input made on the CPU;
    here the model is on ``meta`` (no data, the same shapes), which refuses a CPU input as
    ``cuda`` does (the whole budget on a GPU is checked by the CUDA tests)."""
    model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 40), nn.ReLU(),
                          nn.Linear(40, 5))
    dense = 2 * (20 * 30 + 30 * 40 + 40 * 5)
    assert forward_flops(model, torch.zeros(1, 20)) == dense
    model.to("meta")
    assert forward_flops(model, torch.zeros(1, 20)) == dense
    assert forward_flops(model, (torch.zeros(1, 20),)) == dense


def test_flops_of_a_conv_layer_are_a_kxk_conv_with_n_outputs_then_a_1x1_conv() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 12, 3, stride=2), nn.Flatten())
    budget = sharding_budget(model, ["1"], [0.25], example_input=torch.zeros(1, 3, 11, 11))
    n = math.ceil(0.25 * 12)  # N = min(12, 8·3·3)
    first, positions = 8 * 27 * 81, 4 * 4  # 9x9 outputs, then 4x4 at stride 2
    assert budget.dense_flops == 2 * (first + 12 * 72 * positions)
    assert budget.at(0.25).forward_flops == 2 * (first + n * 72 * positions
                                                 + 12 * n * positions)


# --- the user report: an autoencoder under the default policy ----------------------------------

def test_the_autoencoders_default_layers_buy_nothing_and_both_warnings_say_so() -> None:
    model, x = Autoencoder(), torch.zeros(1, 784)
    layers = sharded_layer_names(model, example_input=x)
    assert layers == ["enc2", "dec1"]
    budget = sharding_budget(model, layers, [0.25, 0.5], example_input=x)
    # by hand: 8 arrays of a 128-byte header; n = 1 at r = 0.25 replaces a 3×64 weight
    # (768 + 128 bytes) by u, v, omega, indices: 4·(64 + 3 + 1) + 8 + 4·128 bytes
    dense = 8 * 128 + 4 * (2 * 784 * 64 + 2 * 64 * 3 + 64 + 3 + 64 + 784)
    assert budget.dense_bytes == dense
    at_quarter = dense + 2 * ((4 * 68 + 8 + 4 * 128) - (768 + 128))
    assert budget.at(0.25).received_bytes == at_quarter
    assert budget.at(0.25).received_ratio == pytest.approx(0.9995, abs=5e-5)
    assert budget.at(0.5).received_ratio == pytest.approx(1.0009, abs=5e-5)
    assert budget.at(0.5).received_ratio > 1  # 2 of 3 terms cost more than the layer

    dense_warning, costly_warning = budget_warnings(budget)
    for r, bound in ((0.25, 0.625), (0.5, 0.75)):
        assert f"at r = {r:g} a node receives" in dense_warning
        assert f"(1 + r)/2 = {bound:g}x" in dense_warning
    assert "'dec2' (Linear, weight 784×64, 50,960 parameters, 50.1% of" in dense_warning
    assert "'enc1' (Linear, weight 64×784, 50,240 parameters, 49.4% of" in dense_warning
    # the bottleneck's factors cost more than its weights at r = 0.5: the fix shards the two
    # big layers instead of it
    assert "sharded_layers=['enc1', 'dec2']" in dense_warning
    assert "instead of 'dec1', 'enc2'" in dense_warning
    assert "policy='by-size', keep_ratio=0.25" in dense_warning
    # the two big layers: n = 16 of 64 at r = 0.25; the bottleneck back to dense
    big = [layer_cost(n, s, np.float32, 0.25) for n, s in (("enc1", (64, 784)),
                                                            ("dec2", (784, 64)))]
    small = [layer_cost(n, s, np.float32, 0.25) for n, s in (("enc2", (3, 64)),
                                                              ("dec1", (64, 3)))]
    after = (at_quarter + sum(c.received_bytes - c.dense_bytes for c in big)
             - sum(c.received_bytes - c.dense_bytes for c in small)) / dense
    assert f"{after:.3f}x at r = 0.25" in dense_warning
    for name, shape in (("enc2", "3×64"), ("dec1", "64×3")):
        assert (f"'{name}' at r = 0.5 (n = 2 of N = 3 terms: 134 factor entries, 1,072 bytes "
                f"with omega and indices, against 192 entries, 896 bytes for the dense {shape} "
                "weight)") in costly_warning


def test_the_summary_line_gives_each_ratio_against_the_dense_model() -> None:
    model, x = Autoencoder(), torch.zeros(1, 784)
    layers = sharded_layer_names(model, example_input=x, policy="by-size", keep_ratio=0.25)
    lines = budget_summary(sharding_budget(model, layers, [0.25, 0.5], example_input=x))
    pattern = (r"r = {}: receives 0\.\d\dx of the dense model's bytes, sends 0\.\d\dx, "
               r"forward 0\.\d\dx FLOPs")
    assert re.fullmatch(pattern.format("0.25"), lines[0]), lines[0]
    assert re.fullmatch(pattern.format("0.5"), lines[1]), lines[1]
    no_flops = budget_summary(sharding_budget(model, ["enc2", "dec1"], [0.5]))[0]
    assert no_flops.startswith("r = 0.5: receives 1.0009x of the dense model's bytes")
    assert no_flops.endswith("(forward FLOPs not counted: no example input)")


def test_resnet18_at_r_0_2_is_worth_sharding_and_nothing_is_said() -> None:
    model, x = resnet18(10, 3, seed=0), torch.zeros(1, 3, 32, 32)
    budget = sharding_budget(model, sharded_layer_names(model, example_input=x), [0.2],
                             example_input=x)
    assert budget.at(0.2).received_ratio < 0.25
    assert budget_warnings(budget) == []


def test_keep_ratio_one_is_not_checked() -> None:
    budget = sharding_budget(Autoencoder(), ["enc2", "dec1"], [1.0])
    assert budget.at(1.0).received_ratio > 1
    assert budget_warnings(budget) == []


# --- errors -------------------------------------------------------------------------------------

def test_bad_input_is_refused_with_what_was_expected() -> None:
    model = Autoencoder()
    with pytest.raises(ValueError, match=r"expected one or more keep ratios in \(0, 1\]"):
        sharding_budget(model, ["enc2"], [])
    with pytest.raises(ValueError, match=r"keep_ratios=\[0.5, 1.5\].*found \[1.5\]"):
        sharding_budget(model, ["enc2"], [0.5, 1.5])
    with pytest.raises(ValueError, match=r"'nope' \(no nope.weight\).*2 or more dimensions"):
        sharding_budget(model, ["enc2", "nope"], [0.5])
    with pytest.raises(ValueError, match="counting FLOPs needs the model itself"):
        sharding_budget(model.state_dict(), ["enc2"], [0.5], example_input=torch.zeros(1, 784))
    with pytest.raises(KeyError, match=r"keep ratio 0.3 is not in this budget; it holds \[0.5\]"):
        sharding_budget(model, ["enc2"], [0.5]).at(0.3)
    with pytest.raises(ValueError, match="expected a weight of 2 or more dimensions"):
        layer_cost("norm", (8,), np.float32, 0.5)
    with pytest.raises(ValueError, match="has no numpy equivalent"):
        numpy_dtype(torch.bfloat16)


class ConvVAE(nn.Module):
    """A conv encoder to a 2-number code and a ConvTranspose2d decoder (a VAE without the
    sampling): the decoder's transposed convs hold most of the bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, 32, 4, stride=2, padding=1), nn.ReLU(),
                                     nn.Conv2d(32, 64, 4, stride=2, padding=1), nn.ReLU(),
                                     nn.Flatten(), nn.Linear(64 * 7 * 7, 2))
        self.decoder = nn.Sequential(nn.Linear(2, 64 * 7 * 7), nn.Unflatten(1, (64, 7, 7)),
                                     nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1),
                                     nn.ReLU(), nn.ConvTranspose2d(32, 1, 4, stride=2,
                                                                   padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def test_a_vaes_transposed_decoder_is_sharded_and_the_advice_counts_its_layers() -> None:
    model, x = ConvVAE(), torch.zeros(1, 1, 28, 28)
    layers = sharded_layer_names(model, example_input=x)
    # every affine layer but the first (encoder.0) and the last (decoder.4)
    assert layers == ["encoder.2", "encoder.5", "decoder.0", "decoder.2"]
    budget = sharding_budget(model, layers, [0.25], example_input=x)
    assert {u.name for u in budget.unsharded} == {"encoder.0", "decoder.4"}
    # the bytes of the rest: each layer's weight and bias, counted by hand (+ 128-byte headers)
    weights = {"encoder.0": (1 * 32 * 16, 32), "encoder.2": (32 * 64 * 16, 64),
               "encoder.5": (3136 * 2, 2), "decoder.0": (2 * 3136, 3136),
               "decoder.2": (64 * 32 * 16, 32), "decoder.4": (32 * 16, 1)}
    assert budget.dense_bytes == sum(4 * (w + b) + 2 * 128 for w, b in weights.values())
    assert budget.other == ()  # every entry belongs to an affine layer
    only_small = sharding_budget(model, ["encoder.5"], [0.25], example_input=x)
    (warning,) = budget_warnings(only_small)
    # FLOPs and bytes each named where it passes the bound; the big transposed conv is named
    assert re.search(r"at r = 0.25 a node receives 0\.\d+x of the dense model's bytes and "
                     r"computes 0\.\d+x of its forward FLOPs \(its bytes and its FLOPs more "
                     r"than \(1 \+ r\)/2 = 0\.625x of the dense model's", warning), warning
    assert "'decoder.2' (ConvTranspose2d, weight 64×32×4×4" in warning
    assert "'decoder.2'" in warning.split("sharded_layers=")[1]


def test_a_model_whose_shardable_layers_are_all_sharded_names_the_entries_left() -> None:
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8), nn.LayerNorm(8),
                          nn.Linear(8, 50))
    budget = sharding_budget(model, ["1", "3"], [0.1])
    assert [k for k, _ in budget.other] == ["0.weight", "2.bias", "2.weight"]
    warning = budget_warnings(budget)[0]
    assert ("Every layer a spectral layer can replace is sharded already: the rest is in "
            "entries no keep ratio shrinks, the largest '0.weight' (") in warning
    assert "normalizations" not in warning
