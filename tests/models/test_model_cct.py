"""CCT-6/3x2: published size, attention equal to nn.MultiheadAttention, shardable at r = 1."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedshard.models.attention import SelfAttention
from fedshard.models.cct import CCT, cct_6_3x2
from fedshard.spectral import shard_model, sharded_layer_names


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _expected_params(num_classes: int, in_channels: int, tokens: int) -> int:
    # Written out from the CCT paper / code: conv 3x3 in->64 and 64->256 (no bias); learnable
    # positions (tokens x 256); 6 layers of [LN 2*256, q/k/v 3*256^2, proj 256^2+256,
    # LN 2*256, fc1 256*512+512, fc2 512*256+256]; final LN; seq-pool 256+1; head.
    d, h = 256, 512
    tokenizer = 9 * (in_channels * 64 + 64 * d)
    layer = 2 * d + 3 * d * d + d * d + d + 2 * d + d * h + h + h * d + d
    return tokenizer + tokens * d + 6 * layer + 2 * d + (d + 1) + (d + 1) * num_classes


def test_parameter_count_matches_the_published_figure():
    model = cct_6_3x2(10)
    # SHI-Labs/Compact-Transformers README, CIFAR table: CCT-6/3x2 has 3.327M parameters.
    assert _num_params(model) == _expected_params(10, 3, 64) == 3_326_923
    assert round(_num_params(model) / 1e6, 3) == 3.327
    tiny = cct_6_3x2(200, img_size=64)  # TinyImageNet: 16x16 = 256 tokens
    assert _num_params(tiny) == _expected_params(200, 3, 256)
    assert _num_params(cct_6_3x2(100, positional_embedding="sine")) == _expected_params(
        100, 3, 64
    )  # the sine table is a frozen parameter of the same size


@pytest.mark.parametrize(("classes", "channels", "size"), [(10, 3, 32), (200, 3, 64), (10, 1, 28)])
def test_output_shape(classes, channels, size):
    model = cct_6_3x2(classes, in_channels=channels, img_size=size).eval()
    with torch.no_grad():
        out = model(torch.randn(2, channels, size, size))
    assert out.shape == (2, classes)


def test_attention_equals_torch_multihead_attention():
    torch.manual_seed(0)
    ours = SelfAttention(32, 4, qkv_bias=False, attention_dropout=0.0,
                         causal=False).double().eval()
    ref = nn.MultiheadAttention(32, 4, bias=False, batch_first=True).double().eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q.weight, ours.k.weight, ours.v.weight]))
        ref.out_proj.weight.copy_(ours.proj.weight)
        ours.proj.bias.normal_()
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        expected = ref(x, x, x, need_weights=False)[0] + ours.proj.bias
        torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-12)


def test_sine_embedding_is_the_transformer_table():
    model = CCT(10, positional_embedding="sine")
    assert model.positional_emb is not None and not model.positional_emb.requires_grad
    table = model.positional_emb[0]  # (64, 256)
    for pos, i in [(0, 0), (5, 10), (63, 255), (17, 128)]:
        angle = pos / 10000 ** (2 * (i // 2) / 256)
        assert table[pos, i].item() == pytest.approx(
            math.sin(angle) if i % 2 == 0 else math.cos(angle), abs=1e-6
        )


def test_every_affine_layer_is_a_separate_linear_or_conv():
    model = cct_6_3x2(10)
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    names = sharded_layer_names(model, example_input=torch.zeros(1, 3, 32, 32))
    per_layer = [
        f"blocks.{i}.{n}"
        for i in range(6)
        for n in ("attn.q", "attn.k", "attn.v", "attn.proj", "fc1", "fc2")
    ]
    # First conv and classifier stay dense (paper, Sec. 4.1).
    assert names == ["tokenizer.3", *per_layer, "pool.score"]
    assert sharded_layer_names(model) == names  # registration order is forward order


def test_all_terms_reproduce_the_dense_model():
    torch.manual_seed(0)
    model = cct_6_3x2(10, img_size=32).double().eval()
    with torch.no_grad():  # non-trivial LayerNorm affines and biases
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_()
    names = sharded_layer_names(model)
    indices, omegas = {}, {}
    for name in names:
        weight = model.get_submodule(name).weight
        n = min(weight.shape[0], weight[0].numel())
        indices[name] = list(range(n))
        omegas[name] = torch.ones(n, dtype=torch.float64)
    sub, _ = shard_model(model, indices, omegas)
    sub.eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(sub(x), model(x), rtol=0, atol=1e-10)


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"num_classes=0: expected a positive int"):
        cct_6_3x2(0)
    with pytest.raises(ValueError, match=r"positional_embedding='rope'"):
        cct_6_3x2(10, positional_embedding="rope")
    with pytest.raises(ValueError, match=r"embedding dim 256 must be divisible by num_heads=3"):
        CCT(10, num_heads=3)
