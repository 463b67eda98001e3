"""A small decoder that trains on packed rows without leaking across documents.

Two things make a packed row behave like its documents run one by one: attention follows the
document-causal mask from ``rayjobs.masks`` (built once per forward, shared by all layers), and RoPE
angles come from ``position_ids``, which restart at 0 in every document. ``attention="sdpa"`` uses
PyTorch SDPA with the dense mask and works everywhere (FlexAttention has no backward on CPU in
torch 2.13); ``attention="flex"`` uses FlexAttention with a BlockMask, compiled on CUDA.

Pre-norm blocks: RMSNorm → attention → residual, RMSNorm → SwiGLU MLP → residual; the lm head is
tied to the token embedding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from rayjobs import masks
from rayjobs.rows import IGNORE_INDEX

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Shape of a ``Decoder``."""

    vocab_size: int
    """Number of token ids; rows of the embedding and of the (tied) lm head."""
    dim: int = 128
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block; ``dim / n_heads`` must be an even integer (RoPE rotates pairs)."""
    mlp_ratio: int = 4
    """Hidden width of the SwiGLU MLP, as a multiple of ``dim``."""
    rope_theta: float = 10000.0
    """RoPE base: pair i of a head rotates by ``position * rope_theta ** (-2i / head_dim)``."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"DecoderConfig.{name} must be positive, got {getattr(self, name)}."
                )
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"DecoderConfig.dim={self.dim} must split into n_heads={self.n_heads} heads "
                "of even width."
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention)


def _attend_fn(attention: str, document_ids: torch.Tensor) -> Attend:
    """The attention kernel for one forward, with its mask built once from ``document_ids``."""
    if attention == "sdpa":
        mask = masks.document_causal_mask(document_ids)[:, None]
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if attention == "flex":
        block_mask = masks.block_mask(document_ids)
        flex = flex_attention if document_ids.device.type == "cpu" else _compiled_flex_attention()
        return lambda q, k, v: flex(q, k, v, block_mask=block_mask)
    raise ValueError(f"attention must be 'sdpa' or 'flex', got {attention!r}.")


def _rope(
    position_ids: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B,1,S,head_dim/2] of the rotation angles for ``position_ids`` [B,S]."""
    inv_freq = theta ** -(
        torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    )
    angles = position_ids[:, None, :, None].float() * inv_freq
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to x [B,H,S,head_dim], pairing dimension i with i + head_dim/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        batch_size, seq_len, dim = x.shape
        q, k, v = self.qkv(x).view(batch_size, seq_len, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = attend(_rotate(q, cos, sin), _rotate(k, cos, sin), v)
        return self.out(y.transpose(1, 2).reshape(batch_size, seq_len, dim))


class SwiGLU(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.dim
        self.gate = nn.Linear(config.dim, hidden, bias=False)
        self.up = nn.Linear(config.dim, hidden, bias=False)
        self.down = nn.Linear(hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim)
        self.attention = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.dim)
        self.mlp = SwiGLU(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, attend)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Decoder-only transformer over packed rows; see the module docstring."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight
        # Tied weights: unit-variance logits at init rather than std sqrt(dim).
        nn.init.normal_(self.embedding.weight, std=config.dim**-0.5)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        attention: str = "sdpa",
    ) -> torch.Tensor:
        """Logits [B,S,vocab_size] for ``input_ids``, ``position_ids`` and ``document_ids`` (each
        [B,S]).

        ``attention`` is ``"sdpa"`` (dense mask; any device, trains on CPU) or ``"flex"``
        (FlexAttention BlockMask; compiled on CUDA, forward only on CPU).
        """
        attend = _attend_fn(attention, document_ids)
        cos, sin = _rope(position_ids, self.config.head_dim, self.config.rope_theta)
        x = self.embedding(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin, attend)
        return self.lm_head(self.norm(x))


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross entropy over positions whose label is not -100, and the number of such
    positions.

    ``labels`` [B,S] are already shifted (``labels[t]`` is the target for ``input_ids[t]``), so no
    shift happens here. Divide the sum by the count of the *global* batch for a per-token mean.
    """
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1).long(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total, (labels != IGNORE_INDEX).sum()
