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
rayjobs.bench.attention``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from rayjobs.data.pack import pack_lengths
from rayjobs.data.rows import layout_rows
from rayjobs.train import masks

HEADS, HEAD_DIM = 16, 128
BLOCK_SIZE = 128
"""The BlockMask's tile (``masks.block_mask``'s default), in tokens."""
TOKENS_PER_STEP = 32768
SEQ_LENS = (2048, 4096, 8192)
MEAN_LENGTH = 300.0
"""Mean document length (tokens) of the geometric distribution the rows are packed from."""


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
    """Full rows packed by best-fit decreasing from geometric document lengths, in random order:
    ``document_ids`` and ``position_ids`` [B,S], and the number of non-pad tokens of each row
    [B].

    Only full rows (``full_rows``) are drawn: BFD over one draw of lengths leaves an under-filled
    bin of the last small documents. The job makes one such row per packer window (hundreds of
    rows); a draw here is four batches' worth, so one batch in about four would have one, and its
    padding, one long causal segment to the mask, would make most of the batch's computed tiles.
    """
    count = 4 * batch_size * seq_len // int(mean_length) + 64
    for _ in range(FULL_ROW_DRAWS):
        lengths = np.minimum(rng.geometric(1 / mean_length, count), seq_len)
        bins = full_rows(lengths, pack_lengths(lengths, seq_len, "bfd"), seq_len, mean_length)
        if len(bins) >= batch_size:
            break
        count *= 2
    else:
        raise ValueError(
            f"packed_layout: fewer than {batch_size} full rows of {seq_len} tokens from documents "
            f"of mean length {mean_length:g}"
        )
    bins = [bins[i] for i in rng.permutation(len(bins))[:batch_size]]
    document_ids, position_ids = layout_rows(
        np.concatenate([lengths[b] for b in bins]), np.array([len(b) for b in bins]), seq_len
    )
    return (
        torch.from_numpy(document_ids).long(),
        torch.from_numpy(position_ids).long(),
        torch.tensor([int(lengths[b].sum()) for b in bins]),
    )


FULL_ROW_DRAWS = 8
"""Draws of lengths (each twice the last) ``packed_layout`` tries for enough full rows."""


def full_rows(
    lengths: np.ndarray, bins: list[np.ndarray], seq_len: int, mean_length: float
) -> list[np.ndarray]:
    """The bins a typical document no longer fits in (free room under ``mean_length``): the rows
    a packer makes of a long stream, without the leftover bin of a finite draw.

    >>> full_rows(np.array([6, 4, 1, 9]), [np.array([0, 1]), np.array([2]), np.array([3])], 10, 2)
    [array([0, 1]), array([3])]
    """
    return [b for b in bins if seq_len - int(lengths[b].sum()) < mean_length]


def documents_per_row(document_ids: torch.Tensor, num_tokens: torch.Tensor) -> float:
    """Mean documents per row, padding not counted (``layout_rows`` gives a row's padding the
    next document id, which is not a document).

    >>> documents_per_row(torch.tensor([[0, 0, 1, 2], [0, 1, 1, 2]]), torch.tensor([3, 4]))
    2.5
    """
    columns = torch.arange(document_ids.shape[1], device=document_ids.device)
    real = columns[None, :] < num_tokens.to(document_ids.device)[:, None]
    return float((torch.where(real, document_ids, -1).max(dim=1).values + 1).float().mean())


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


def _tile_density(document_ids: torch.Tensor, block_size: int = BLOCK_SIZE) -> float:
    block_mask = masks.block_mask(document_ids, block_size)
    visited = (block_mask.kv_num_blocks + block_mask.full_kv_num_blocks).sum().item()
    num_blocks = document_ids.shape[1] // block_size
    return visited / (document_ids.shape[0] * num_blocks * (num_blocks + 1) / 2)


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "rayjobs bench attention needs a CUDA GPU (FlexAttention's training path)."
        )


def bench_attention(
    seq_lens: list[int],
    mean_length: float = MEAN_LENGTH,
    seed: int = 0,
    report: Callable[[list[AttentionRow]], None] | None = None,
) -> list[AttentionRow]:
    """Every variant at every length; ``report`` gets each length's rows as they are measured
    (a cold compile costs tens of seconds per length, so a time limit still leaves the
    lengths done)."""
    _require_cuda()
    device = torch.device("cuda")
    rows: list[AttentionRow] = []
    for seq_len in seq_lens:
        # A fresh compile per length: reused, the first length got a static kernel and the
        # later ones a dynamic-shape recompile, so the lengths' timings were of different code.
        torch._dynamo.reset()
        flex = torch.compile(flex_attention)
        measured = _bench_seq_len(flex, seq_len, mean_length, seed, device)
        if report is not None:
            report(measured)
        rows += measured
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
    document_ids, _, num_tokens = packed_layout(rng, batch_size, seq_len, mean_length)
    document_ids = document_ids.to(device)
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
    documents = documents_per_row(document_ids, num_tokens)
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


TABLE_HEADER = (
    f"{'seq_len':>7} {'batch':>5} {'docs/row':>8} {'tiles':>6} {'variant':<12} "
    f"{'fwd+bwd ms':>10} {'mask ms':>8} {'vs dense':>8}"
)


def format_table(rows: list[AttentionRow], header: bool = True) -> str:
    lines = [TABLE_HEADER] if header else []
    for row in rows:
        lines.append(
            f"{row.seq_len:>7} {row.batch_size:>5} {row.documents_per_row:>8.1f} "
            f"{row.tile_density:>6.1%} {row.variant:<12} {row.ms:>10.3f} {row.mask_ms:>8.3f} "
            f"{row.speedup_vs_dense:>7.2f}x"
        )
    return "\n".join(lines)


def argument_error(seq_lens: list[int], mean_length: float) -> str | None:
    """What is wrong with the bench's arguments, naming the argument, or None. A seq_len must
    be a whole number of the BlockMask's 128-token tiles: the tile share is counted in whole
    tiles, and a partial tile made it wrong (or divided by zero after all the timing)."""
    if not seq_lens:
        return "--seq-len needs at least one length"
    bad = [n for n in seq_lens if n < BLOCK_SIZE or n % BLOCK_SIZE]
    if bad:
        return f"--seq-len must be multiples of {BLOCK_SIZE} (the mask's tile), got {bad}"
    if not mean_length >= 1:
        return f"--mean-length must be at least 1 token, got {mean_length:g}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rayjobs bench attention", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seq-len", type=int, nargs="*", default=list(SEQ_LENS))
    parser.add_argument(
        "--mean-length",
        type=float,
        default=MEAN_LENGTH,
        help="mean document length in tokens (geometric distribution)",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")
    args = parser.parse_args(argv)
    if error := argument_error(args.seq_len, args.mean_length):
        print(f"rayjobs: {error}", file=sys.stderr)
        return 2
    _require_cuda()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
        f"{HEADS} heads × {HEAD_DIM}, "
        f"{TOKENS_PER_STEP} tokens per step, mean document length {args.mean_length:g}"
    )
    print(TABLE_HEADER, flush=True)
    rows = bench_attention(
        args.seq_len,
        args.mean_length,
        report=lambda measured: print(format_table(measured, header=False), flush=True),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(row) for row in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
