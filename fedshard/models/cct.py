"""Compact Convolutional Transformer CCT-6/3x2 (Hassani et al., 2021), sharding-ready.

Architecture and initialization follow the authors' code (SHI-Labs/Compact-Transformers,
``src/cct.py`` ``cct_6_3x2_32``, ``src/utils/{tokenizer,transformers}.py``):

* tokenizer: 2 x [Conv2d 3x3 (stride 1, padding 1, no bias) -> ReLU -> MaxPool 3x3 (stride 2,
  padding 1)], channels ``in -> 64 -> 256``; a 32x32 image becomes 8x8 = 64 tokens, a 64x64
  image 256 tokens;
* learnable positional embedding (truncated normal, std 0.2), or the fixed sine one;
* 6 encoder layers, embedding 256, 4 heads, MLP ratio 2 (hidden 512), GELU; each layer is
  ``x = x + attn(LN(x)); x = LN1(x); x = x + MLP(x)`` exactly as published (note the second
  LayerNorm is applied to the residual stream itself);
* final LayerNorm, sequence pooling (softmax over tokens of a Linear(256, 1) score), Linear
  classifier;
* dropout 0, attention dropout 0.1, stochastic depth rising linearly from 0 to 0.1.

The one deliberate change: the published fused ``qkv = Linear(256, 768, bias=False)`` is
written as three ``Linear(256, 256, bias=False)`` layers ``q``, ``k``, ``v`` (same function,
same parameter count), so that every affine map inside attention can be sharded on its own
(paper, Sec. 4.1: "we decompose all the affine layers inside the attention blocks").

Modules are registered in forward order. The affine layers in that order are the two tokenizer
convolutions, then per encoder layer ``q, k, v, proj, fc1, fc2``, then ``pool.score`` and
``head``: the default selection (all but the first and the last) keeps the first convolution
and the classifier dense. ``pool.score`` has a single output, i.e. rank 1, so sharding it
cannot drop anything.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from fedshard.models.attention import SelfAttention

__all__ = ["CCT", "cct_6_3x2"]


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample with probability ``p``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)  # (B, 1, 1)
        return x * mask / keep


class EncoderLayer(nn.Module):
    """CCT encoder layer: ``x + attn(LN(x))``, then LN, then ``x + MLP(x)``."""

    def __init__(
        self, dim: int, num_heads: int, hidden: int, attention_dropout: float, drop_path: float
    ) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, num_heads, qkv_bias=False,
                                  attention_dropout=attention_dropout, causal=False)
        self.norm1 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.pre_norm(x)))
        x = self.norm1(x)
        return x + self.drop_path(self.fc2(F.gelu(self.fc1(x))))


class SeqPool(nn.Module):
    """Sequence pooling: attention-weighted mean of the tokens, ``(B, T, C) -> (B, C)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = F.softmax(self.score(x), dim=1)  # (B, T, 1)
        return (weights.transpose(1, 2) @ x).squeeze(1)


def _sine_embedding(length: int, dim: int) -> torch.Tensor:
    position = torch.arange(length, dtype=torch.float64)[:, None]
    rate = 10000.0 ** (2 * (torch.arange(dim) // 2) / dim)
    angle = position / rate  # (T, C)
    table = torch.where(torch.arange(dim) % 2 == 0, torch.sin(angle), torch.cos(angle))
    return table.to(torch.float32)[None]  # (1, T, C)


class CCT(nn.Module):
    """Compact Convolutional Transformer; see the module docstring for the layout.

    Parameters
    ----------
    num_classes : int
        Classifier outputs.
    in_channels : int
        Image channels.
    img_size : int
        Image height = width; fixes the number of tokens ``(img_size / 4)**2``.
    num_layers, num_heads, embed_dim, mlp_ratio : int, int, int, float
        Encoder size.
    conv_layers, kernel_size, tokenizer_channels : int, int, int
        Tokenizer: ``conv_layers`` convolutions, the inner ones ``tokenizer_channels`` wide.
    positional_embedding : str
        ``"learnable"``, ``"sine"`` or ``"none"``.
    dropout, attention_dropout, stochastic_depth : float
        Regularization, published defaults 0, 0.1, 0.1; all inactive in ``eval()``.
    """

    def __init__(
        self,
        num_classes: int,
        *,
        in_channels: int = 3,
        img_size: int = 32,
        num_layers: int = 6,
        num_heads: int = 4,
        embed_dim: int = 256,
        mlp_ratio: float = 2.0,
        conv_layers: int = 2,
        kernel_size: int = 3,
        tokenizer_channels: int = 64,
        positional_embedding: str = "learnable",
        dropout: float = 0.0,
        attention_dropout: float = 0.1,
        stochastic_depth: float = 0.1,
    ) -> None:
        super().__init__()
        for what, value in (
            ("num_classes", num_classes),
            ("in_channels", in_channels),
            ("img_size", img_size),
            ("num_layers", num_layers),
            ("conv_layers", conv_layers),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what}={value!r}: expected a positive int; no model built.")
        if positional_embedding not in ("learnable", "sine", "none"):
            raise ValueError(
                f"positional_embedding={positional_embedding!r}: expected 'learnable', 'sine' "
                "or 'none'."
            )
        channels = [in_channels] + [tokenizer_channels] * (conv_layers - 1) + [embed_dim]
        # Published: stride max(1, k // 2 - 1) = 1 and padding max(1, k // 2) = 1 for k = 3.
        stride, padding = max(1, kernel_size // 2 - 1), max(1, kernel_size // 2)
        stages: list[nn.Module] = []
        for c_in, c_out in itertools.pairwise(channels):
            stages += [
                nn.Conv2d(c_in, c_out, kernel_size, stride=stride, padding=padding, bias=False),
                nn.ReLU(),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            ]
        self.tokenizer = nn.Sequential(*stages)
        with torch.no_grad():
            tokens = self.tokenizer(torch.zeros(1, in_channels, img_size, img_size))
        seq_len = tokens.shape[2] * tokens.shape[3]

        self.positional_emb: nn.Parameter | None
        if positional_embedding == "learnable":
            self.positional_emb = nn.Parameter(torch.zeros(1, seq_len, embed_dim))
            nn.init.trunc_normal_(self.positional_emb, std=0.2)
        elif positional_embedding == "sine":
            self.positional_emb = nn.Parameter(
                _sine_embedding(seq_len, embed_dim), requires_grad=False
            )
        else:
            self.positional_emb = None
        self.dropout = nn.Dropout(dropout)
        hidden = int(embed_dim * mlp_ratio)
        rates = torch.linspace(0, stochastic_depth, num_layers).tolist()
        self.blocks = nn.ModuleList(
            EncoderLayer(embed_dim, num_heads, hidden, attention_dropout, rate) for rate in rates
        )
        self.norm = nn.LayerNorm(embed_dim)
        self.pool = SeqPool(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight)
        elif isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``(B, C, H, W)`` to logits ``(B, num_classes)``."""
        x = self.tokenizer(x).flatten(2).transpose(1, 2)  # (B, T, embed_dim)
        if self.positional_emb is not None:
            x = x + self.positional_emb
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.pool(self.norm(x)))


def cct_6_3x2(
    num_classes: int,
    *,
    in_channels: int = 3,
    img_size: int = 32,
    positional_embedding: str = "learnable",
    attention_dropout: float = 0.1,
    stochastic_depth: float = 0.1,
) -> CCT:
    """CCT-6/3x2: 6 encoder layers, a 2-convolution 3x3 tokenizer (paper, Sec. 4.1).

    Parameters
    ----------
    num_classes : int
        Classifier outputs (CIFAR-100: 100, TinyImageNet: 200).
    in_channels : int
        Image channels.
    img_size : int
        Image height = width (32 for CIFAR, 64 for TinyImageNet: 64 or 256 tokens).
    positional_embedding : str
        ``"learnable"`` (published default of ``cct_6_3x2_32``), ``"sine"`` or ``"none"``.
    attention_dropout, stochastic_depth : float
        Published defaults 0.1 and 0.1.

    Returns
    -------
    CCT
        3,326,923 parameters for 10 classes at 32x32 with the learnable embedding (the CCT
        README lists 3.327M for CCT-6/3x2 on CIFAR-10).

    Notes
    -----
    Parameter count: tokenizer ``9 (C_in 64 + 64 * 256)``, positional ``T * 256``, per layer
    ``4 * 256^2 + 256`` (q, k, v, proj) ``+ 2 * 256 * 512 + 512 + 256`` (MLP) ``+ 4 * 256``
    (two LayerNorms), final LayerNorm ``512``, pooling ``257``, head ``257 * num_classes``.
    """
    return CCT(
        num_classes,
        in_channels=in_channels,
        img_size=img_size,
        positional_embedding=positional_embedding,
        attention_dropout=attention_dropout,
        stochastic_depth=stochastic_depth,
    )
