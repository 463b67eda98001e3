"""A small decoder that trains on packed rows without leaking across documents.

Two things make a packed row behave like its documents run one by one: attention follows the
document-causal mask from ``rayjobs.train.masks`` (built once per forward, shared by all layers),
and RoPE angles come from ``position_ids``, which restart at 0 in every document.
``attention="sdpa"`` uses PyTorch SDPA with the dense mask and works everywhere (FlexAttention has
no backward on CPU in torch 2.13); ``attention="flex"`` uses FlexAttention with a BlockMask,
compiled on CUDA.
``attention="causal"`` is plain causal SDPA (``is_causal``, no mask built, flash kernels on GPU):
exact only for unpacked rows, one document per row with its padding at the end, the baseline that
``rayjobs bench train`` measures packing against.
Preference (DPO) rows (``rayjobs.data.preference``) also pass ``parent_ids``, so a response sees its
prompt document besides its own (``masks``' note); every forward takes it as an optional argument,
``None`` for SFT rows.

Pre-norm blocks: RMSNorm → attention → residual, RMSNorm → SwiGLU MLP → residual; the lm head is
tied to the token embedding.

``PackedLM`` trains either this decoder or a Hugging Face causal LM (``build_hf_model``) on packed
rows: the document mask goes to an HF model as its backend needs it (``masks.hf_attention_mask``),
``position_ids`` restart per document, and the loss (``chunked_loss_sum``) never holds the logits
of the whole batch: only labelled positions reach the lm head, a chunk of them at a time, each
chunk recomputed in backward (``torch.utils.checkpoint``) instead of kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from torch.utils.checkpoint import checkpoint

from rayjobs.data.rows import IGNORE_INDEX
from rayjobs.train import masks
from rayjobs.train.hf import attention_layers, hf_model_mask

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


def _attend_fn(
    attention: str, document_ids: torch.Tensor, parent_ids: torch.Tensor | None = None
) -> Attend:
    """The attention kernel for one forward, with its mask built once from ``document_ids`` (and
    ``parent_ids``, for preference rows)."""
    if attention == "sdpa":
        mask = masks.document_causal_mask(document_ids, parent_ids)[:, None]
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if attention == "causal":  # one document per row, right-padded: no mask to build
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if attention == "flex":
        block_mask = masks.block_mask(document_ids, parent_ids=parent_ids)
        flex = flex_attention if document_ids.device.type == "cpu" else _compiled_flex_attention()
        return lambda q, k, v: flex(q, k, v, block_mask=block_mask)
    raise ValueError(f"attention must be 'sdpa', 'flex' or 'causal', got {attention!r}.")


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

    checkpointing = False
    """Activation checkpointing (``train.activation_checkpointing``): in training, the block's
    activations are recomputed in backward instead of kept. Its forward is checkpointed, not its
    ``__call__``, so hooks on the block (FSDP2's unshard and reshard) run once, outside the
    recomputation, as in Hugging Face's layers."""

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, attend, use_reentrant=False)
        return self._forward(x, cos, sin, attend)

    def _forward(
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
        parent_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B,S,vocab_size] for ``input_ids``, ``position_ids`` and ``document_ids`` (each
        [B,S]).

        ``attention`` is ``"sdpa"`` (dense mask; any device, trains on CPU) or ``"flex"``
        (FlexAttention BlockMask; compiled on CUDA, forward only on CPU). ``parent_ids`` [B,S]:
        the document each token may also attend to (preference rows, ``rayjobs.data.preference``).
        """
        return self.lm_head(
            self.hidden_states(input_ids, position_ids, document_ids, attention, parent_ids)
        )

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        attention: str = "sdpa",
        parent_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The normed final hidden states [B,S,dim], the input of ``lm_head``."""
        attend = _attend_fn(attention, document_ids, parent_ids)
        cos, sin = _rope(position_ids, self.config.head_dim, self.config.rope_theta)
        x = self.embedding(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin, attend)
        return self.norm(x)


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


DEFAULT_LOSS_CHUNK_TOKENS = 1024
"""Labelled positions projected to the vocabulary at once by ``chunked_loss_sum``."""


def _chunk_cross_entropy(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def chunked_loss_sum(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``loss_sum(head(hidden), labels)`` without the logits of the whole batch.

    Only positions whose label is not -100 reach ``head``: their hidden states [N,dim] are
    projected ``chunk_tokens`` rows at a time, each chunk's logits upcast to fp32 for the cross
    entropy, inside ``torch.utils.checkpoint``: the forward keeps no logits, and backward recomputes
    them one chunk at a time. The loss therefore holds about one chunk's logits (in the head's
    dtype, the fp32 copy and their gradient: chunk_tokens × vocab × 12 bytes in fp32) instead of
    three batch-sized [B,S,vocab] tensors; the price is a second forward of the head per chunk.
    Equal to ``loss_sum`` up to the summation order. An empty chunk still runs when no position
    has a label, so every parameter of the head takes part in backward (DDP expects that).

    Args:
        hidden: [B,S,dim] final hidden states (the head's input).
        head: hidden [n,dim] → logits [n,vocab] (an lm head; it may apply logit scaling).
        labels: [B,S] shifted labels, -100 where no loss.
        chunk_tokens: labelled positions per chunk (> 0).

    Returns:
        (summed cross entropy as fp32, number of labelled positions).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}.")
    labels = labels.reshape(-1)
    labelled = labels != IGNORE_INDEX
    hidden = hidden.reshape(-1, hidden.shape[-1])[labelled]
    targets = labels[labelled].long()
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, max(len(targets), 1), chunk_tokens):
        chunk = slice(start, start + chunk_tokens)
        total = total + checkpoint(
            functools.partial(_chunk_cross_entropy, head),
            hidden[chunk],
            targets[chunk],
            use_reentrant=False,
        )
    return total, labelled.sum()


def _chunk_logps(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = head(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 → fp32, fp64 stays
    return -F.cross_entropy(logits, targets, reduction="none")


def token_logps(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
) -> torch.Tensor:
    """[B,S]: ``log p(labels[t] | input up to t)`` where ``labels[t]`` is not -100, else 0; fp32
    (fp64 for an fp64 model).

    As ``chunked_loss_sum``: only labelled positions reach ``head``, ``chunk_tokens`` of them
    at a time inside ``torch.utils.checkpoint`` (no batch-sized logits kept; backward recomputes a
    chunk's); ``chunk_tokens=0`` projects them all at once. An empty chunk still runs when nothing
    is labelled, so every head parameter takes part in backward (DDP expects that).

    Args:
        hidden: [B,S,dim] final hidden states.
        head: hidden [n,dim] → logits [n,vocab] (e.g. ``PackedLM.head``).
        labels: [B,S] shifted labels, -100 where no loss.
        chunk_tokens: labelled positions per chunk (>= 0).
    """
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0, got {chunk_tokens}.")
    labelled = (labels != IGNORE_INDEX).reshape(-1)
    selected = hidden.reshape(-1, hidden.shape[-1])[labelled]
    targets = labels.reshape(-1)[labelled].long()
    if not chunk_tokens:
        values = _chunk_logps(head, selected, targets)
    else:
        values = torch.cat(
            [
                checkpoint(
                    _chunk_logps,
                    head,
                    selected[start : start + chunk_tokens],
                    targets[start : start + chunk_tokens],
                    use_reentrant=False,
                )
                for start in range(0, max(len(targets), 1), chunk_tokens)
            ]
        )
    out = torch.zeros(labelled.shape, dtype=values.dtype, device=hidden.device)
    return out.masked_scatter(labelled, values).reshape(labels.shape)


class PackedLM(nn.Module):
    """A causal LM on packed rows: forward takes a batch's columns and returns the summed loss and
    the count of labelled positions (divide by the *global* count for the per-token mean).

    ``model`` is the demo ``Decoder`` (``attention``: ``"sdpa"`` or ``"flex"``) or a Hugging Face
    causal LM, whose attention backend is its ``config._attn_implementation`` (``sdpa``, ``eager``
    or ``flex_attention``; ``attention`` is then ignored). For an HF model the body
    (``get_decoder()``) runs with ``position_ids`` (restarting per document) and the document mask
    in its backend's form (``masks.hf_attention_mask``: transformers passes a 4-D mask or a
    BlockMask through untouched); the lm head (``get_output_embeddings()``, plus the logit scaling
    or soft-capping some architectures apply in their forward) runs in the loss.
    ``loss_chunk_tokens``: 0 computes the full logits and ``loss_sum``; else ``chunked_loss_sum``.

    Wrap this module (not the inner model) in DDP: the loss is computed inside its forward, so DDP
    sees every parameter used.
    """

    def __init__(
        self,
        model: nn.Module,
        attention: str = "sdpa",
        loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ) -> None:
        super().__init__()
        if loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens must be >= 0, got {loss_chunk_tokens}.")
        self.model = model
        self.is_hf = not isinstance(model, Decoder)
        self.loss_chunk_tokens = loss_chunk_tokens
        self._attention = attention
        if self.is_hf:
            if self.attention not in masks.HF_ATTENTION:
                raise ValueError(
                    f"attn_implementation {self.attention!r} is not supported; "
                    f"use one of {', '.join(masks.HF_ATTENTION)}"
                )
            config = model.config.get_text_config()
            attention_layers(config)  # refuses layers whose document mask it cannot build
            # What some architectures' *ForCausalLM.forward does to the head's output
            # (Cohere: logit_scale, Granite: logits_scaling, Gemma 2/3: final_logit_softcapping).
            self._logit_scale = getattr(config, "logit_scale", None)
            self._logits_scaling = getattr(config, "logits_scaling", None)
            self._softcap = getattr(config, "final_logit_softcapping", None)
        elif attention not in ("sdpa", "flex", "causal"):
            raise ValueError(f"attention must be 'sdpa', 'flex' or 'causal', got {attention!r}.")

    @property
    def attention(self) -> str:
        """The attention backend: the decoder's ``sdpa`` / ``flex``, or the HF model's own
        ``config._attn_implementation`` (read at every forward, so ``set_attn_implementation``
        on the model takes effect)."""
        return self.model.config._attn_implementation if self.is_hf else self._attention

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        parent_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B,S,dim] of packed rows, documents masked from each other (a
        document still sees its ``parent_ids`` document, for preference rows)."""
        if not self.is_hf:
            return self.model.hidden_states(
                input_ids, position_ids, document_ids, self.attention, parent_ids
            )
        dtype = self.model.get_input_embeddings().weight.dtype
        output = self.model.get_decoder()(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=hf_model_mask(
                self.model.config.get_text_config(),
                document_ids,
                position_ids,
                self.attention,
                dtype,
                parent_ids,
            ),
            use_cache=False,
        )
        return output.last_hidden_state

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of ``hidden`` [..., dim], as the model's own forward computes them."""
        if not self.is_hf:
            return self.model.lm_head(hidden)
        logits = self.model.get_output_embeddings()(hidden)
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        if self._logits_scaling is not None:
            logits = logits / self._logits_scaling
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        parent_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Full logits [B,S,vocab] (evaluation and tests; training uses ``forward``)."""
        return self.head(self.hidden_states(input_ids, position_ids, document_ids, parent_ids))

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        labels: torch.Tensor,
        parent_ids: torch.Tensor | None = None,
        per_token: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """(summed cross entropy over labelled positions, their count) of a batch of rows; with
        ``per_token``, the log-prob of every labelled position instead (``token_logps``: what the
        DPO loss sums per response). Either way the head runs in this forward, so DDP and FSDP see
        every parameter used."""
        hidden = self.hidden_states(input_ids, position_ids, document_ids, parent_ids)
        if per_token:
            return token_logps(hidden, self.head, labels, self.loss_chunk_tokens)
        if not self.loss_chunk_tokens:
            return loss_sum(self.head(hidden), labels)
        return chunked_loss_sum(hidden, self.head, labels, self.loss_chunk_tokens)

    def check_head(self, num_tokens: int | None = None) -> float:
        """Largest difference between this module's logits and the model's own forward on one
        short sequence (one document, so the masks agree); raises ``ValueError`` above 1e-4 × the
        logits' scale: an architecture whose forward does more to its logits than ``head``
        reproduces would otherwise train on a different loss than it reports. ``num_tokens``:
        16, or 8 more than a sliding window of up to 1024 tokens, so the window's mask is checked
        against the model's own too."""
        if num_tokens is None:
            window, _ = attention_layers(self.model.config.get_text_config())
            num_tokens = max(16, window + 8) if window is not None and window <= 1024 else 16
        vocab_size = self.model.get_input_embeddings().num_embeddings
        device = self.model.get_input_embeddings().weight.device
        input_ids = (torch.arange(num_tokens, device=device)[None] * 7919) % vocab_size
        position_ids = torch.arange(num_tokens, device=device)[None]
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                expected = self.model(input_ids=input_ids, use_cache=False).logits.float()
                got = self.logits(input_ids, position_ids, torch.zeros_like(input_ids)).float()
        finally:
            self.train(was_training)
        difference = float((got - expected).abs().max())
        if difference > 1e-4 * max(1.0, float(expected.abs().max())):
            raise ValueError(
                f"{type(self.model).__name__}: logits from get_decoder() + "
                f"get_output_embeddings() differ from the model's own by {difference:.3g}; "
                "its forward transforms the logits in a way rayjobs does not reproduce"
            )
        return difference
