"""Character GPT: shapes, causality, size, attention against torch, shardable at r = 1."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedshard.models.attention import SelfAttention
from fedshard.models.chargpt import CharGPTConfig, char_transformer
from fedshard.spectral import shard_model, sharded_layer_names


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_output_shape_and_parameter_count():
    model = char_transformer(81).eval()
    idx = torch.randint(0, 81, (4, 80))
    with torch.no_grad():
        assert model(idx).shape == (4, 80, 81)
        assert model(idx[:, :5]).shape == (4, 5, 81)
    # Counted by hand (d = 48, V = 81, T = 80): embeddings (V + T) d, per block 4 (d^2 + d)
    # attention + (d 4d + 4d) + (4d d + d) MLP + 4d LayerNorms, final LayerNorm 2d, head V d.
    d, v, t = 48, 81, 80
    block = 4 * (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 4 * d
    assert _num_params(model) == (v + t) * d + 3 * block + 2 * d + v * d == 96_528
    assert len(model.blocks) == 3


def test_changing_a_future_token_leaves_earlier_logits_unchanged():
    torch.manual_seed(0)
    model = char_transformer(81).eval()
    idx = torch.randint(0, 81, (2, 80))
    changed = idx.clone()
    changed[:, 50] = (idx[:, 50] + 1) % 81
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :50], b[:, :50], rtol=0, atol=1e-6)
    assert (a[:, 50:] - b[:, 50:]).abs().max() > 1e-4  # the change is visible from 50 on


def test_attention_equals_masked_torch_multihead_attention():
    torch.manual_seed(1)
    config = CharGPTConfig(vocab_size=10, n_head=4, n_embd=32, dropout=0.0)
    ours = SelfAttention(config.n_embd, config.n_head, qkv_bias=True, attention_dropout=0.0,
                         causal=True).double().eval()
    ref = nn.MultiheadAttention(32, 4, batch_first=True).double().eval()
    with torch.no_grad():
        for layer in (ours.q, ours.k, ours.v, ours.proj):
            layer.bias.normal_()
        ref.in_proj_weight.copy_(torch.cat([ours.q.weight, ours.k.weight, ours.v.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q.bias, ours.k.bias, ours.v.bias]))
        ref.out_proj.weight.copy_(ours.proj.weight)
        ref.out_proj.bias.copy_(ours.proj.bias)
    x = torch.randn(3, 9, 32, dtype=torch.float64)
    future = torch.triu(torch.ones(9, 9, dtype=torch.bool), diagonal=1)  # True = masked
    with torch.no_grad():
        expected = ref(x, x, x, attn_mask=future, need_weights=False)[0]
        torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-12)


def test_default_selection_shards_every_linear_inside_the_blocks():
    model = char_transformer(81)
    expected = [
        f"blocks.{i}.{n}"
        for i in range(3)
        for n in ("attn.q", "attn.k", "attn.v", "attn.proj", "fc", "fc_proj")
    ]
    assert sharded_layer_names(model) == expected  # embedding and lm_head stay dense
    assert (
        sharded_layer_names(model, example_input=torch.zeros(1, 80, dtype=torch.long)) == expected
    )


def test_all_terms_reproduce_the_dense_model():
    torch.manual_seed(2)
    model = char_transformer(81).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_()
    names = sharded_layer_names(model)
    indices = {n: list(range(min(model.get_submodule(n).weight.shape))) for n in names}
    omegas = {n: torch.ones(len(i), dtype=torch.float64) for n, i in indices.items()}
    sub, _ = shard_model(model, indices, omegas)
    sub.eval()
    idx = torch.randint(0, 81, (2, 80))
    with torch.no_grad():
        torch.testing.assert_close(sub(idx), model(idx), rtol=0, atol=1e-10)


def test_a_few_steps_fit_a_repeated_string():
    torch.manual_seed(3)
    model = char_transformer(81, dropout=0.0)
    text = torch.arange(81).repeat(2)[:81]  # (81,)
    x, y = text[:-1][None], text[1:][None]  # (1, 80)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(x).transpose(1, 2), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_embd": 50}, r"n_embd=50 must be divisible by n_head=3"),
        ({"n_layer": 0}, r"n_layer=0: expected a positive int"),
        ({"dropout": 1.0}, r"dropout=1.0: expected 0 <= dropout < 1"),
    ],
)
def test_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        char_transformer(81, **kwargs)


def test_rejects_sequences_longer_than_the_block():
    model = char_transformer(81, block_size=8)
    with pytest.raises(ValueError, match=r"T <= block_size=8, got shape \(1, 9\)"):
        model(torch.zeros(1, 9, dtype=torch.long))
