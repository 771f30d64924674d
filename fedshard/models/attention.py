"""Multi-head self-attention with separate ``q``, ``k``, ``v`` and ``proj`` Linear layers.

Separate layers (no fused qkv, no ``nn.MultiheadAttention``) make every affine layer inside
attention an ``nn.Linear`` the default layer selection can shard, as the paper does (unlike
PriSM, which shards only the MLPs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SelfAttention"]


class SelfAttention(nn.Module):
    """``proj(softmax(q kᵀ / √d) v)`` over ``num_heads`` heads, optionally causal."""

    def __init__(self, dim: int, num_heads: int, *, qkv_bias: bool, attention_dropout: float,
                 causal: bool, resid_dropout: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embedding dim {dim} must be divisible by num_heads={num_heads}.")
        self.num_heads = num_heads
        self.causal = causal
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.attention_dropout = float(attention_dropout)
        self.proj = nn.Linear(dim, dim)
        self.resid_dropout = nn.Dropout(resid_dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        return x.view(b, t, self.num_heads, c // self.num_heads).transpose(1, 2)  # (B, H, T, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        y = F.scaled_dot_product_attention(
            self._heads(self.q(x)),
            self._heads(self.k(x)),
            self._heads(self.v(x)),
            dropout_p=self.attention_dropout if self.training else 0.0,
            is_causal=self.causal,
        )  # (B, H, T, D)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))
