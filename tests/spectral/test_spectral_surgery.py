"""Layer selection, sub-model building, factor extraction and merging, on small models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedshard.models import resnet18
from fedshard.spectral import (
    LayerFactors,
    SpectralConv2d,
    SpectralLinear,
    build_submodel,
    decompose,
    extract_factors,
    shard_model,
    sharded_layer_names,
)

RESNET_SHARDED = [
    f"layer{s}.{b}.conv{c}" for s in range(1, 5) for b in range(2) for c in (1, 2)
] + [f"layer{s}.0.downsample.0" for s in (2, 3, 4)]


def _resnet(dtype: torch.dtype = torch.float64, width: int = 8) -> nn.Module:
    model = resnet18(num_classes=5, in_channels=3, width=width, seed=0).to(dtype)
    # Random GroupNorm affines and biases so that they matter in the equivalence checks.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=dtype))
    return model.eval()


def _images(dtype: torch.dtype = torch.float64, size: int = 12) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2), dtype=dtype)


def _num_terms(model: nn.Module, name: str) -> int:
    w = model.get_submodule(name).weight
    return min(w.shape[0], w[0].numel())


class Reordered(nn.Module):
    """Registers its layers in a different order than it runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.stem = nn.Linear(4, 8)
        self.body = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(torch.relu(self.stem(x)))))


class Zoo(nn.Module):
    """Supported and unsupported layers side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.seq = nn.Conv1d(8, 8, 1)  # 1-D convolutions are not shardable
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.tied_a = nn.Linear(8, 8)
        self.tied_b = nn.Linear(8, 8)
        self.tied_b.weight = self.tied_a.weight
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.conv(self.dw(self.stem(x))))  # (B, 8, 2H, 2W)
        tokens = self.seq(h.flatten(2)).transpose(1, 2)  # (B, 4HW, 8)
        tokens = self.norm(tokens + self.attn(tokens, tokens, tokens)[0])
        return self.head(self.mid(self.tied_b(self.tied_a(tokens))).mean(1))


def test_default_resnet_selection_skips_stem_and_classifier() -> None:
    model = _resnet(width=8)
    names = sharded_layer_names(model)
    assert sorted(names) == sorted(RESNET_SHARDED)
    assert names == sharded_layer_names(model, example_input=_images())
    assert "conv1" not in names and "fc" not in names


def test_forward_order_from_example_input_differs_from_registration_order() -> None:
    model = Reordered()
    # Registration order head, stem, body: "first" = head, "last" = body.
    assert sharded_layer_names(model) == ["stem"]
    # Forward order stem, body, head.
    assert sharded_layer_names(model, example_input=torch.ones(2, 4)) == ["body"]


def test_example_input_pass_restores_train_flags_and_leaves_model_unchanged() -> None:
    model = Zoo().train()
    model.norm.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    names = sharded_layer_names(model, example_input=torch.ones(1, 3, 2, 2))
    # dw (groups), seq (1-D conv), attn.out_proj (MHA) and the tied pair are skipped by
    # default; up (a transposed conv) is sharded
    assert names == ["conv", "up", "mid"]
    assert model.training and not model.norm.training and model.attn.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_include_and_exclude_override_the_default() -> None:
    model = _resnet(width=8)
    assert sharded_layer_names(model, include=["fc", "conv1", "layer1.0.conv1"]) == [
        "conv1",
        "layer1.0.conv1",
        "fc",
    ]
    dropped = ["layer1.0.conv1", "layer2.0.downsample.0"]
    excluded = sharded_layer_names(model, exclude=dropped)
    assert sorted(excluded) == sorted(set(RESNET_SHARDED) - set(dropped))
    assert sharded_layer_names(model, include=["fc", "conv1"], exclude=["fc"]) == ["conv1"]


def test_unsupported_requests_are_all_named_in_one_type_error() -> None:
    model = Zoo()
    bad = ["dw", "seq", "attn.out_proj", "norm", "tied_a"]
    with pytest.raises(TypeError, match="cannot shard 5 requested module") as info:
        sharded_layer_names(model, include=["conv", *bad])
    message = str(info.value)
    for name in bad:
        assert f"'{name}'" in message
    assert "groups=8" in message and "(Conv1d) is not exactly one of" in message
    assert "shares its weight with ['tied_b.weight']" in message
    with pytest.raises(TypeError, match=r"'dw' \(Conv2d\) has groups=8"):
        factors = LayerFactors(torch.ones(8, 1), torch.ones(9, 1), torch.ones(1))
        build_submodel(model, {"dw": factors})


def test_unknown_names_are_all_named_in_one_value_error() -> None:
    model = Reordered()
    with pytest.raises(ValueError, match=r"unknown module name\(s\) \['nope', 'gone'\]"):
        sharded_layer_names(model, include=["stem", "nope", "gone"])
    with pytest.raises(ValueError, match=r"unknown module name\(s\) \['nope'\]"):
        sharded_layer_names(model, exclude=["nope"])
    with pytest.raises(TypeError, match="single string"):
        sharded_layer_names(model, include="stem")


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 2e-4)])
def test_full_rank_submodel_reproduces_dense_resnet(dtype: torch.dtype, tol: float) -> None:
    """r = 1, all terms, ω = 1: the over-parameterized reference of the paper.

    float32 tolerance: 20 layers each reorder float32 sums (relative ~1e-7 per layer), and the
    GroupNorms divide by small standard deviations, so we allow 2e-4 on logits of scale ~1.
    """
    model = _resnet(dtype)
    names = sharded_layer_names(model)
    indices = {n: list(range(_num_terms(model, n))) for n in names}
    omegas = {n: torch.ones(len(i), dtype=torch.float64) for n, i in indices.items()}
    sub, index_map = shard_model(model, indices, omegas)
    assert sum(isinstance(m, SpectralConv2d) for m in sub.modules()) == len(RESNET_SHARDED)
    assert index_map == {n: tuple(i) for n, i in indices.items()}
    x = _images(dtype)
    with torch.no_grad():
        torch.testing.assert_close(sub(x), model(x), rtol=tol, atol=tol)
    assert sub.get_submodule("layer2.0.conv1").u.dtype == dtype


def test_submodel_with_subset_of_terms_equals_truncated_dense_model() -> None:
    model = _resnet()
    rng = np.random.default_rng(3)
    names = sharded_layer_names(model)
    indices, omegas, reference = {}, {}, _resnet()
    for name in names:
        total = _num_terms(model, name)
        idx = rng.choice(total, size=max(1, total // 3), replace=False).tolist()
        omega = rng.uniform(0.5, 3.0, size=len(idx))
        indices[name], omegas[name] = idx, torch.from_numpy(omega)
        # Independent reference: numpy SVD of the dense weight, Σ_j ω_j λ_{I_j} u_{I_j} v_{I_j}^T.
        w = model.get_submodule(name).weight.detach()
        left, lam, right_h = np.linalg.svd(w.reshape(w.shape[0], -1).numpy(), full_matrices=False)
        w_hat = (left[:, idx] * lam[idx] * omega) @ right_h[idx]
        with torch.no_grad():
            reference.get_submodule(name).weight.copy_(torch.from_numpy(w_hat).reshape(w.shape))
    sub, _ = shard_model(model, indices, omegas)
    x = _images()
    with torch.no_grad():
        torch.testing.assert_close(sub(x), reference(x), rtol=0, atol=1e-10)


def test_build_submodel_leaves_the_callers_model_untouched() -> None:
    model = _resnet(torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    name = "layer3.1.conv2"
    u, v, _ = decompose(model.get_submodule(name).weight)
    sub = build_submodel(model, {name: LayerFactors(u[:, :3], v[:, :3], torch.ones(3))})
    with torch.no_grad():
        for p in sub.parameters():
            p.add_(1.0)
    for k, value in model.state_dict().items():
        assert torch.equal(value, before[k]), k
    assert type(model.get_submodule(name)) is nn.Conv2d
    layer = sub.get_submodule(name)
    assert isinstance(layer, SpectralConv2d) and layer.rank == 3
    assert layer.u.dtype == torch.float32  # the model's dtype, not the factors' float64
    assert {"layer3.1.conv2.u", "layer3.1.conv2.v", "layer3.1.conv2.omega"} <= set(sub.state_dict())


def test_build_submodel_copies_the_original_bias() -> None:
    model = Reordered()
    u, v, _ = decompose(model.body.weight)
    sub = build_submodel(model, {"body": LayerFactors(u[:, :2], v[:, :2], torch.ones(2))})
    layer = sub.get_submodule("body")
    assert isinstance(layer, SpectralLinear) and layer.bias is not None
    torch.testing.assert_close(layer.bias, model.body.bias)
    assert layer.bias.data_ptr() != model.body.bias.data_ptr()


def _reference_build(model: nn.Module, factors: dict[str, LayerFactors]) -> nn.Module:
    """The obvious construction: copy everything, then replace each named layer."""
    import copy

    sub = copy.deepcopy(model)
    for name, fac in factors.items():
        dense = sub.get_submodule(name)
        cls = SpectralConv2d if isinstance(dense, nn.Conv2d) else SpectralLinear
        parent, _, child = name.rpartition(".")
        setattr(sub.get_submodule(parent), child, cls.from_factors(dense, fac.u, fac.v, fac.omega))
    return sub


def test_build_submodel_copies_only_what_it_keeps_and_equals_copy_then_replace() -> None:
    """The replaced layers' dense weights are not copied (they are most of the model); the
    result is the copy-everything-then-replace model, module for module."""
    model = _resnet(torch.float32)
    factors = {}
    for i, name in enumerate(RESNET_SHARDED[::3]):
        u, v, _ = decompose(model.get_submodule(name).weight)
        factors[name] = LayerFactors(u[:, : 2 + i], v[:, : 2 + i], torch.linspace(1, 5, 2 + i))
    sub = build_submodel(model, factors)
    want = _reference_build(model, factors)
    assert repr(sub) == repr(want)
    for (key, x), (key2, y) in zip(sub.state_dict().items(), want.state_dict().items(),
                                   strict=True):
        assert key == key2 and torch.equal(x, y), key
    assert all(not isinstance(m, nn.Identity) for m in sub.modules())
    kept = {p.data_ptr() for p in sub.parameters()}
    assert not kept & {p.data_ptr() for p in model.parameters()}  # nothing shared either


def test_build_submodel_reports_every_shape_mismatch() -> None:
    model = Reordered()
    factors = {
        "stem": LayerFactors(torch.ones(8, 2), torch.ones(5, 2), torch.ones(2)),
        "body": LayerFactors(torch.ones(7, 2), torch.ones(8, 2), torch.ones(2)),
    }
    with pytest.raises(ValueError, match=r"'stem': u \(8, 2\), v \(5, 2\).*'body': u \(7, 2\)"):
        build_submodel(model, factors)
    with pytest.raises(ValueError, match=r"omega of shape \(2,\), got \(3,\)"):
        LayerFactors(torch.ones(8, 2), torch.ones(4, 2), torch.ones(3))


def test_extract_factors_returns_detached_copies_in_received_order() -> None:
    model = Reordered()
    sub, _ = shard_model(model, {"body": [5, 1]}, {"body": torch.tensor([2.0, 1.0])})
    factors = extract_factors(sub)
    assert list(factors) == ["body"]
    u, v = factors["body"]
    assert not u.requires_grad and u.shape == (8, 2) and v.shape == (8, 2)
    full_u, _, _ = decompose(model.body.weight)
    torch.testing.assert_close(u.double(), full_u[:, [5, 1]], rtol=0, atol=1e-6)
    u.zero_()
    assert sub.get_submodule("body").u.abs().sum() > 0


def test_shard_model_validates_its_mappings() -> None:
    model = Reordered()
    with pytest.raises(ValueError, match=r"only in indices: \['body'\], only in omegas: \['st"):
        shard_model(model, {"body": [0]}, {"stem": torch.ones(1)})
    with pytest.raises(ValueError, match=r"\[9\] are outside \[0, 8\)"):
        shard_model(model, {"body": [0, 9]}, {"body": torch.ones(2)})
