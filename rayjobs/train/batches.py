"""This rank's packed batches: the library API for users' own train loops (``train_batches``) and
what rayjobs' own loop reads.

Ray Train splits each dataset with ``streaming_split(world_size, equal=True)``: equal rows per
rank, hence equal batches per rank with a fixed batch size, the last one short (the same on every
rank). A collective guard all-reduces "I have a batch" before every step, so if ranks ever
disagree they stop together instead of hanging DDP; batches dropped that way are counted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rayjobs.train import masks
from rayjobs.train.ahead import read_ahead
from rayjobs.train.collate import collate
from rayjobs.train.collectives import all_reduce
from rayjobs.train.hf import hf_model_mask


class Guard:
    """Counts batches a rank had but could not use because another rank had run out."""

    dropped = 0


def rank_batches(
    shard: Any,
    batch_size: int,
    device: torch.device,
    guard: Guard | None = None,
    drop_last: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's batches of one epoch, stopping on every rank as soon as any rank runs out;
    the last may be short (``drop_last``: skipped). Reading starts at this call.

    Before each step all ranks all-reduce (MIN) a "have a batch" flag; a batch held when another
    rank is out is not trained on and is counted in ``guard.dropped``.
    """
    # Ray's own prefetch off, batches read ahead in a thread instead (rayjobs.train.ahead says why).
    batches = read_ahead(
        shard.iter_torch_batches(
            batch_size=batch_size,
            drop_last=drop_last,
            collate_fn=lambda b: collate(b, device),
            prefetch_batches=0,
        )
    )
    return _equal_batches(batches, device, guard)


def _equal_batches(
    batches: Iterator[dict[str, torch.Tensor]], device: torch.device, guard: Guard | None
) -> Iterator[dict[str, torch.Tensor]]:
    try:
        while True:
            batch = next(batches, None)
            have = all_reduce(
                torch.tensor(int(batch is not None), device=device), dist.ReduceOp.MIN
            )
            if not int(have):
                if guard is not None:
                    guard.dropped += batch is not None
                return
            yield batch
    finally:
        batches.close()  # stops the read-ahead thread when a rank stops early


def train_batches(
    datasets: str | Sequence[str] = "train",
    batch_size: int = 8,
    *,
    attn_implementation: str | None = None,
    model_config: Any = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    guard: Guard | None = None,
    drop_last: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """The library API for a user's own ``train_loop_per_worker``: this rank's packed batches, on
    this rank's device, with the same number of batches on every rank: ``batch_size`` rows each,
    but for each dataset's last, which may be shorter (the same size on every rank; skipped with
    ``drop_last``, for static shapes).

    The first dataset starts streaming at this call, its first batches fetched in a thread: call
    it before building the model, and the data's start-up (its actors, the first packing window)
    runs while the model builds.

    ``datasets``: the dataset names the ``TorchTrainer`` was given, read in order (``Job.
    train_datasets()``: ``"train"`` in stream mode, one per epoch in planned mode). Each batch holds
    ``input_ids``, ``labels`` (already shifted per document: compare logits at position t with
    ``labels[t]``, ignore ``-100``), ``position_ids`` (restarting per document), ``document_ids``
    and ``num_tokens`` as int64 tensors, and ``epoch`` in stream mode. With
    ``attn_implementation`` (``sdpa``, ``eager`` or ``flex_attention``, as a Hugging Face model's
    ``config._attn_implementation``) the batch also holds ``attention_mask``: the document-causal
    mask in that backend's form, built on the device (``masks.hf_attention_mask``; ``dtype`` is the
    eager path's score dtype). Pass it with ``position_ids`` to the model's forward. Give the
    model's ``config`` as ``model_config`` when it may have sliding-window layers (Mistral, Gemma,
    Qwen2 with ``use_sliding_window``): the mask is then the one each kind of layer needs
    (``hf.hf_model_mask``), and ``attn_implementation`` defaults to the config's.
    """
    import ray.train
    import ray.train.torch

    device = device if device is not None else ray.train.torch.get_device()
    names = [datasets] if isinstance(datasets, str) else list(datasets)

    def batches_of(name: str) -> Iterator[dict[str, torch.Tensor]]:
        return rank_batches(ray.train.get_dataset_shard(name), batch_size, device, guard, drop_last)

    first = batches_of(names[0]) if names else iter(())

    def every_dataset() -> Iterator[dict[str, torch.Tensor]]:
        for index, name in enumerate(names):
            for batch in first if index == 0 else batches_of(name):
                if attn_implementation is not None or model_config is not None:
                    batch["attention_mask"] = attention_mask(
                        batch, attn_implementation, dtype, model_config
                    )
                yield batch

    return every_dataset()


def attention_mask(
    batch: dict[str, torch.Tensor],
    attn_implementation: str | None,
    dtype: torch.dtype = torch.float32,
    model_config: Any = None,
) -> Any:
    """``train_batches``' ``attention_mask``: the batch's document mask in the backend's form,
    built on the batch's device; on preference rows (``task: dpo``) from ``parent_ids`` too, so
    each response attends to its prompt (``rayjobs.data.preference``); with a ``model_config``,
    windowed (or one mask per kind of layer) as its sliding-window layers need."""
    if model_config is not None:
        return hf_model_mask(
            model_config.get_text_config(),
            batch["document_ids"],
            batch["position_ids"],
            attn_implementation,
            dtype,
            batch.get("parent_ids"),
        )
    return masks.hf_attention_mask(
        batch["document_ids"], attn_implementation, dtype, parent_ids=batch.get("parent_ids")
    )
