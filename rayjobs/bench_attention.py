"""``rayjobs bench attention``: what the document mask costs on a GPU, FlexAttention vs dense SDPA.

Packed rows need a document-causal mask. The dense way, SDPA with a [B,1,S,S] boolean mask, reads
the whole mask and computes every tile; FlexAttention with a BlockMask skips the tiles no query of a
document can see. This bench times attention forward + backward over rows packed from a realistic
length distribution (best-fit decreasing, as the job packs them), in bf16, for:

- ``flex``: compiled ``flex_attention`` with ``masks.block_mask`` (the training path on CUDA), the
  BlockMask built every step (its build time is also reported alone);
- ``sdpa_dense``: SDPA with the dense document-causal mask (the CPU path's rule, on the GPU);
- ``sdpa_causal``: SDPA with ``is_causal=True`` and no document mask, the speed of one long
document.
  It is *wrong* for packed rows (documents see each other); it is here as the reference speed.

Everything but timing is checked first: flex's output and gradients equal the dense path's.
Only torch is needed, so it runs on a GPU machine without Ray: ``python -m
rayjobs.bench_attention``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from rayjobs import masks
from rayjobs.pack import pack_lengths
from rayjobs.rows import layout_rows

HEADS, HEAD_DIM = 16, 128
TOKENS_PER_STEP = 32768


@dataclass
class AttentionRow:
    seq_len: int
    batch_size: int
    documents_per_row: float
    tile_density: float
    """Share of [128×128] tiles FlexAttention computes (full or partial), of a causal row's
    tiles."""
    variant: str
    ms: float
    """Forward + backward of attention alone, mean over the timed steps (CUDA events)."""
    mask_ms: float
    """Building the mask for one step (flex: BlockMask; dense: the [B,S,S] bool mask)."""
    speedup_vs_dense: float


def packed_layout(
    rng: np.random.Generator, batch_size: int, seq_len: int, mean_length: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows packed by best-fit decreasing from geometric document lengths, in random order:
    ``document_ids`` and ``position_ids`` [B,S], and the number of non-pad tokens of each row
    [B]."""
    lengths = np.minimum(
        rng.geometric(1 / mean_length, 4 * batch_size * seq_len // int(mean_length) + 64), seq_len
    )
    bins = pack_lengths(lengths, seq_len, "bfd")
    bins = [bins[i] for i in rng.permutation(len(bins))[:batch_size]]
    document_ids, position_ids = layout_rows(
        np.concatenate([lengths[b] for b in bins]), np.array([len(b) for b in bins]), seq_len
    )
    return (
        torch.from_numpy(document_ids).long(),
        torch.from_numpy(position_ids).long(),
        torch.tensor([int(lengths[b].sum()) for b in bins]),
    )


def _time(step: Callable[[], None], warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _tile_density(document_ids: torch.Tensor, block_size: int = 128) -> float:
    block_mask = masks.block_mask(document_ids, block_size)
    visited = (block_mask.kv_num_blocks + block_mask.full_kv_num_blocks).sum().item()
    num_blocks = document_ids.shape[1] // block_size
    return visited / (document_ids.shape[0] * num_blocks * (num_blocks + 1) / 2)


def bench_attention(
    seq_lens: list[int], mean_length: float = 300.0, seed: int = 0
) -> list[AttentionRow]:
    if not torch.cuda.is_available():
        raise SystemExit(
            "rayjobs bench attention needs a CUDA GPU (FlexAttention's training path)."
        )
    device = torch.device("cuda")
    rows: list[AttentionRow] = []
    for seq_len in seq_lens:
        # A fresh compile per length: reused, the first length got a static kernel and the
        # later ones a dynamic-shape recompile, so the lengths' timings were of different code.
        torch._dynamo.reset()
        flex = torch.compile(flex_attention)
        rows += _bench_seq_len(flex, seq_len, mean_length, seed, device)
        torch.cuda.empty_cache()  # the step's tensors are gone with the call
    return rows


def _bench_seq_len(
    flex: Callable[..., torch.Tensor],
    seq_len: int,
    mean_length: float,
    seed: int,
    device: torch.device,
) -> list[AttentionRow]:
    """Every variant at one seq_len, over the same packed batch and the same q, k, v."""
    batch_size = max(1, TOKENS_PER_STEP // seq_len)
    rng = np.random.default_rng(seed)
    document_ids = packed_layout(rng, batch_size, seq_len, mean_length)[0].to(device)
    q, k, v = (
        torch.randn(
            batch_size,
            HEADS,
            seq_len,
            HEAD_DIM,
            device=device,
            dtype=torch.bfloat16,
            requires_grad=True,
        )
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    _check_flex_equals_dense(
        flex,
        q,
        k,
        v,
        grad,
        masks.block_mask(document_ids),
        masks.document_causal_mask(document_ids)[:, None],
    )

    def step(attend: Callable[[], torch.Tensor]) -> None:
        attend().backward(grad)
        q.grad = k.grad = v.grad = None

    variants = {
        "flex": lambda: flex(q, k, v, block_mask=masks.block_mask(document_ids)),
        "sdpa_dense": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=masks.document_causal_mask(document_ids)[:, None]
        ),
        "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    mask_ms = {
        "flex": _time(lambda: masks.block_mask(document_ids)),
        "sdpa_dense": _time(lambda: masks.document_causal_mask(document_ids)),
        "sdpa_causal": 0.0,
    }
    times = {name: _time(lambda attend=attend: step(attend)) for name, attend in variants.items()}
    documents = float((document_ids.max(dim=1).values + 1).float().mean())
    density = _tile_density(document_ids)
    return [
        AttentionRow(
            seq_len,
            batch_size,
            documents,
            density,
            name,
            ms,
            mask_ms[name],
            times["sdpa_dense"] / ms,
        )
        for name, ms in times.items()
    ]


def _check_flex_equals_dense(flex, q, k, v, grad, block_mask, dense_mask) -> None:
    """Flex and the dense mask must agree before their speeds mean anything (bf16 tolerance)."""
    results = []
    for attend in (
        lambda: flex(q, k, v, block_mask=block_mask),
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask),
    ):
        out = attend()
        out.backward(grad)
        results.append([out.detach().float()] + [t.grad.float() for t in (q, k, v)])
        q.grad = k.grad = v.grad = None
    for name, got, expected in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        error = (got - expected).abs().max().item()
        scale = expected.abs().max().item()
        if error > 2e-2 * max(scale, 1.0):
            raise AssertionError(
                f"flex {name} differs from dense SDPA by {error:.3g} (scale {scale:.3g})"
            )


def format_table(rows: list[AttentionRow]) -> str:
    lines = [
        f"{'seq_len':>7} {'batch':>5} {'docs/row':>8} {'tiles':>6} {'variant':<12} "
        f"{'fwd+bwd ms':>10} {'mask ms':>8} {'vs dense':>8}"
    ]
    for row in rows:
        lines.append(
            f"{row.seq_len:>7} {row.batch_size:>5} {row.documents_per_row:>8.1f} "
            f"{row.tile_density:>6.1%} {row.variant:<12} {row.ms:>10.3f} {row.mask_ms:>8.3f} "
            f"{row.speedup_vs_dense:>7.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="rayjobs bench attention", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seq-len", type=int, nargs="*", default=[2048, 4096, 8192])
    parser.add_argument(
        "--mean-length",
        type=float,
        default=300.0,
        help="mean document length in tokens (geometric distribution)",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")
    args = parser.parse_args(argv)
    rows = bench_attention(args.seq_len, args.mean_length)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
        f"{HEADS} heads × {HEAD_DIM}, "
        f"{TOKENS_PER_STEP} tokens per step, mean document length {args.mean_length:g}"
    )
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(row) for row in rows], f, indent=1)


if __name__ == "__main__":
    main()
