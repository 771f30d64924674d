"""Character-level GPT with three GPT-2 blocks for Shakespeare (paper, Sec. 4.1), sharding-ready.

minGPT / nanoGPT layout: token + learned position embeddings, ``n_layer`` pre-LN blocks
``x + attn(LN(x))``, ``x + MLP(LN(x))`` with causal self-attention and a GELU MLP of width
``4 * n_embd``, a final LayerNorm and a bias-free linear head (not tied to the embedding).
Attention is written with separate ``q``, ``k``, ``v`` and ``proj`` ``nn.Linear`` layers
instead of GPT-2's fused ``c_attn``, so that each can be sharded.

Sizes. The paper gives only "a tiny transformer model with three GPT-2 blocks". The defaults
are minGPT's ``gpt-nano`` configuration, the one with three blocks: ``n_layer = 3``,
``n_head = 3``, ``n_embd = 48``; ``block_size = 80`` is LEAF's window length and dropout 0.1
is minGPT's default. Initialization is minGPT's: N(0, 0.02) weights, zero biases, residual
projections N(0, 0.02 / sqrt(2 n_layer)).

Modules are registered in forward order: ``wte``, ``wpe``, per block ``q, k, v, proj, fc,
fc_proj``, then ``lm_head``. With embeddings counted as affine layers (as
``fedshard.spectral.sharded_layer_names`` does), "all but the first and the last" keeps the
token embedding and the head dense and shards every ``nn.Linear`` inside the blocks, as the
paper does (Sec. 4.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedshard.models.attention import SelfAttention

__all__ = ["CharGPT", "CharGPTConfig", "char_transformer"]


@dataclass(frozen=True)
class CharGPTConfig:
    """Size of a :class:`CharGPT` (defaults: minGPT ``gpt-nano``, LEAF windows of 80)."""

    vocab_size: int
    block_size: int = 80
    n_layer: int = 3
    n_head: int = 3
    n_embd: int = 48
    dropout: float = 0.1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive int; no model built.")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}; no model built."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout}: expected 0 <= dropout < 1.")


class Block(nn.Module):
    """GPT-2 block: ``x + attn(LN(x))``, then ``x + MLP(LN(x))``."""

    def __init__(self, config: CharGPTConfig) -> None:
        super().__init__()
        d = config.n_embd
        self.ln_1 = nn.LayerNorm(d)
        self.attn = SelfAttention(config.n_embd, config.n_head, qkv_bias=True,
                                  attention_dropout=config.dropout, causal=True,
                                  resid_dropout=config.dropout)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)
        self.mlp_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_dropout(self.fc_proj(F.gelu(self.fc(self.ln_2(x)))))


class CharGPT(nn.Module):
    """Character-level GPT mapping indices ``(B, T)`` to next-character logits ``(B, T, V)``.

    Parameters
    ----------
    config : CharGPTConfig
        Model size.
    """

    def __init__(self, config: CharGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            # GPT-2: scale the residual projections by 1 / sqrt(number of residual additions).
            if name.endswith(("attn.proj.weight", "fc_proj.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for indices ``idx`` ``(B, T)``, ``T <= block_size``.

        Raises
        ------
        ValueError
            If ``idx`` is not 2-D or ``T`` exceeds ``block_size``.
        """
        if idx.ndim != 2 or idx.shape[1] > self.config.block_size:
            raise ValueError(
                f"idx must be (B, T) with T <= block_size={self.config.block_size}, got "
                f"shape {tuple(idx.shape)}."
            )
        positions = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(positions))  # (B, T, n_embd)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def char_transformer(
    vocab_size: int,
    *,
    block_size: int = 80,
    n_layer: int = 3,
    n_head: int = 3,
    n_embd: int = 48,
    dropout: float = 0.1,
) -> CharGPT:
    """Build the paper's Shakespeare model (see the module docstring for the sizes' source).

    Parameters
    ----------
    vocab_size : int
        Characters (``fedshard.data.VOCAB_SIZE`` = 81 for LEAF Shakespeare).
    block_size : int
        Longest input sequence (LEAF windows: 80).
    n_layer, n_head, n_embd : int
        Blocks, heads, embedding width; ``n_embd`` divisible by ``n_head``.
    dropout : float
        Embedding, attention and residual dropout (minGPT default 0.1).

    Returns
    -------
    CharGPT
        Parameters: ``(V + block_size) d + n_layer (12 d^2 + 13 d) + 2 d + V d`` with
        ``d = n_embd``; 96,528 for the defaults and ``V = 81``.

    Raises
    ------
    ValueError
        Non-positive sizes or ``n_embd`` not divisible by ``n_head``.
    """
    return CharGPT(
        CharGPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            dropout=dropout,
        )
    )
