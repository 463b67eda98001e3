"""What makes an export describe itself: the run's tokenizer copied into it (``_tokenizer/``),
its ids in the manifest and in every Parquet file's schema metadata, the manifest's paths made
relative, and the dataset card (``_README.md``) saying the columns, the label convention, what to
do with several epochs and each consumer's recipe (docs/cli.md, "rayjobs export")."""

from __future__ import annotations

import json
import os
from typing import Any

import pyarrow.fs as pafs

from rayjobs.job.manifest import MANIFEST, TOKENIZER, TRAIN, VALIDATION

METADATA_PREFIX = "rayjobs."
"""The Parquet schema metadata keys of an export: ``rayjobs.labels`` and ``tokenizer_info``'s."""


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """The special tokens' ids, the vocabulary size and the tokenizer's folder (relative to the
    export) of ``tokenizer`` (``data.tokenizer.Tokenizer``)."""
    return {
        "path": TOKENIZER,
        "pad_id": tokenizer.pad_id,
        "eos_id": tokenizer.eos_id,
        "bos_id": tokenizer.bos_id,
        "vocab_size": tokenizer.vocab_size,
    }


def tokenizer_metadata(tokenizer: Any) -> dict[str, str]:
    """``tokenizer_info`` as Parquet schema metadata: ``rayjobs.<key>``, a number, ``null`` or
    the folder's name."""
    return {
        f"{METADATA_PREFIX}{'tokenizer' if key == 'path' else key}": (
            "null" if value is None else str(value)
        )
        for key, value in tokenizer_info(tokenizer).items()
    }


def write_tokenizer(tokenizer: Any, fs: pafs.FileSystem, folder: str) -> None:
    """The run's tokenizer under ``folder``: its ``tokenizer.json`` (the backend the run encoded
    with, a SentencePiece model converted as the run converted it) and a ``tokenizer_config.json``
    naming its special tokens and chat template, which ``AutoTokenizer.from_pretrained`` and
    rayjobs' ``tokenizer.path`` load to the same ids."""
    backend = tokenizer.backend
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, token_id in (
        ("eos_token", tokenizer.eos_id),
        ("pad_token", tokenizer.pad_id),
        ("bos_token", tokenizer.bos_id),
    ):
        if token_id is not None:
            settings[key] = backend.id_to_token(token_id)
    if tokenizer.special_tokens.get("unk_token"):
        settings["unk_token"] = tokenizer.special_tokens["unk_token"]
    settings["add_bos_token"] = tokenizer.bos_id is not None
    if tokenizer.chat_template:
        settings["chat_template"] = tokenizer.chat_template
    fs.create_dir(folder)
    for name, text in (
        ("tokenizer.json", backend.to_str()),
        ("tokenizer_config.json", json.dumps(settings, indent=1)),
    ):
        with fs.open_output_stream(f"{folder}/{name}", compression=None) as stream:
            stream.write(text.encode())


def relative_paths(value: Any, base: str | None = None) -> Any:
    """``value`` (the manifest) with every absolute local path made relative to ``base`` (the
    folder the export was made from: the current directory): a string that is one, and one
    inside a message (a skipped row's example names its file)."""
    base = base or os.getcwd()
    if isinstance(value, dict):
        return {key: relative_paths(item, base) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [relative_paths(item, base) for item in value]
    if not isinstance(value, str):
        return value
    if os.path.isabs(value) and "\n" not in value and "://" not in value:
        trailing = os.sep if value.endswith(os.sep) else ""  # a folder source, as written
        return os.path.relpath(value, base) + trailing
    return value.replace(base.rstrip(os.sep) + os.sep, "")


def card(manifest: dict[str, Any]) -> str:
    """The export's dataset card: YAML ``configs:`` (the Hub's splits, should it be renamed
    ``README.md``), then what a reader needs to train on the rows as they are."""
    splits = manifest["splits"]
    info = manifest["tokenizer"]
    files = "".join(
        f"  - split: {split}\n    path: {folder}/*.parquet\n" for split, folder in splits.items()
    )
    packs = manifest["packed"]["num_packs"]
    epochs = len(manifest["epochs"])
    validation = manifest.get("eval", {}).get("packed", {}).get("num_packs")
    labels = manifest["labels"]
    convention = (
        "`labels[t] = input_ids[t]` where trained, -100 on prompts, padding and each document's "
        "first token: the Hugging Face convention, the model shifts them"
        if labels == "hf"
        else "`labels[t]` is the target of position t (already shifted, as rayjobs trains): do "
        "not hand them to a Hugging Face model's `labels=`, which shifts again"
    )
    seq_len = manifest["seq_len"]
    return f"""---
configs:
- config_name: default
  data_files:
{files}---

# Packed rows exported by `rayjobs export`

- `{TRAIN}/`: {packs} packed training rows of {seq_len} tokens, {epochs} epoch(s){
        f"; `{VALIDATION}/`: {validation} packed eval rows" if validation is not None else ""
    }.
- `{MANIFEST}`: the config, the per-dataset accounting and the mix of each epoch; `{TOKENIZER}/`:
  the tokenizer (`AutoTokenizer.from_pretrained("{TOKENIZER}")`): pad id {info["pad_id"]}, EOS id
  {info["eos_id"]}, BOS id {info["bos_id"]}, vocabulary {info["vocab_size"]} (the same in each
  Parquet file's schema metadata, `rayjobs.*`).
- Columns: `input_ids`, `labels`, `position_ids` (0 at each document's start), `document_ids`
  (the row's document of each token; the padding after the last one is one more),
  `seq_lengths` (the lengths of those runs, summing to {seq_len}), `num_tokens`,
  `num_documents` and `epoch` (training rows only).
- Labels: {labels}: {convention}.
- Documents share a row but must not attend to each other: give the model `position_ids` (and,
  for a Hugging Face model, `use_cache=False`, without which the packed rows' documents see each
  other), or the `seq_lengths` to TRL's padding-free collator, or a block-diagonal mask from
  `document_ids` to a loop of your own.
- Several epochs: each epoch is its own shuffled pass over the data (the `epoch` column). Train
  once over the `train` split in `epoch` order (`num_train_epochs=1`, no reshuffling across
  epochs), or select one epoch and let the trainer repeat it.

## Reading it

```python
from datasets import load_dataset
splits = load_dataset("path/to/export")          # train{
        ", validation" if validation is not None else ""
    }
import pyarrow.parquet as pq
table = pq.read_table("path/to/export")          # the training rows (names starting _ skipped)
```

Hugging Face `Trainer`: `model.config.use_cache = False`, the columns `input_ids`, `labels`,
`position_ids`, `default_data_collator`. TRL `SFTTrainer`: `SFTConfig(padding_free=True)` on
`input_ids`, `labels` and `seq_lengths`. Recipes in rayjobs' docs/cli.md, "rayjobs export".
"""
