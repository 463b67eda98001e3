"""What loading a config says besides "invalid": the rayjobs key for a name another trainer uses
(TRL, Axolotl, torchtune, Hugging Face ``TrainingArguments``), the closest known key for a typo,
each error as one ``key.path: message`` line, and the keys set that have no effect.

Design note: a peer's name is refused with the key to use, never accepted as an alias. An alias
gives one setting two names (which wins when both are set, and which does an override change?),
and it would carry the peer's meaning into a key whose meaning differs: a Hugging Face batch
counts samples, ``train.batch_size`` counts packed rows of ``seq_len`` tokens; ``sample_packing``
switches packing on, which rayjobs always does. So the user reads the message once and writes the
rayjobs key (docs/config.md, "Coming from TRL, Axolotl or torchtune").

Keys with no effect in the chosen mode (``packing.window`` in stream mode, ...) are warned of,
not refused: a config written for both modes is switched by an override (``packing.mode=planned``),
and an override cannot remove a key.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError

from rayjobs.config.schema import (
    MODEL_KINDS,
    Config,
    DatasetConfig,
    HFModelConfig,
    ModelConfig,
)
from rayjobs.data import files, formats


class Peer(NamedTuple):
    """What to write instead of a peer's key: a rayjobs key (relative to a dataset for
    ``DATASET_PEERS``), or None where none is the same, and a note."""

    key: str | None
    note: str = ""


ALWAYS_PACKED = Peer(None, "rayjobs always packs; remove it (packing.seq_len sets the row length)")
BATCH = Peer("train.batch_size", "packed rows of packing.seq_len tokens per worker and step")
LORA_KEYS = "a section of PEFT's keys: r, lora_alpha, lora_dropout, target_modules"
QLORA = Peer(
    None,
    "QLoRA (a 4-bit base) is not supported: it needs CUDA and bitsandbytes; use train.lora "
    "with train.param_dtype: bf16",
)

PEERS: dict[str, Peer] = {
    "learning_rate": Peer("train.lr"),
    "lr": Peer("train.lr"),
    "per_device_train_batch_size": BATCH,
    "micro_batch_size": BATCH,
    "batch_size": BATCH,
    "gradient_accumulation_steps": Peer("train.grad_accum_steps"),
    "num_train_epochs": Peer("train.epochs"),
    "num_epochs": Peer("train.epochs"),
    "epochs": Peer("train.epochs"),
    "max_steps": Peer("train.max_steps"),
    "max_seq_length": Peer("packing.seq_len"),
    "max_length": Peer("packing.seq_len"),
    "sequence_len": Peer("packing.seq_len"),
    "max_seq_len": Peer("packing.seq_len"),
    "seq_len": Peer("packing.seq_len"),
    "sample_packing": ALWAYS_PACKED,
    "packed": ALWAYS_PACKED,
    "pad_to_sequence_len": ALWAYS_PACKED,
    "group_by_length": ALWAYS_PACKED,
    "warmup_steps": Peer("train.warmup_steps"),
    "num_warmup_steps": Peer("train.warmup_steps"),
    "warmup_ratio": Peer("train.warmup_steps", "in optimizer steps; there is no ratio"),
    "lr_scheduler_type": Peer("train.lr_schedule", "auto, constant, cosine or linear"),
    "lr_scheduler": Peer("train.lr_schedule", "auto, constant, cosine or linear"),
    "max_grad_norm": Peer("train.max_grad_norm"),
    "clip_grad_norm": Peer("train.max_grad_norm"),
    "gradient_clipping": Peer("train.max_grad_norm"),
    "weight_decay": Peer("train.weight_decay"),
    "optimizer": Peer(None, "the optimizer is AdamW: set train.lr and train.weight_decay"),
    "optim": Peer(None, "the optimizer is AdamW: set train.lr and train.weight_decay"),
    "output_dir": Peer("train.storage_path"),
    "seed": Peer("seed", "at the top level"),
    "bf16": Peer("train.precision", "bf16 autocast; bf16 weights: train.param_dtype: bf16"),
    "fp16": Peer("train.precision", "fp16: autocast with a loss scaler, CUDA only"),
    "dtype": Peer("train.param_dtype", "fp32 or bf16, the parameters' dtype"),
    "mixed_precision": Peer("train.precision", "bf16, fp16, fp32 or auto"),
    "gradient_checkpointing": Peer("train.activation_checkpointing"),
    "enable_activation_checkpointing": Peer("train.activation_checkpointing"),
    "logging_steps": Peer("train.report_every"),
    "log_every_n_steps": Peer("train.report_every"),
    "save_steps": Peer("train.checkpoint_every"),
    "save_total_limit": Peer("train.keep_checkpoints"),
    "resume_from_checkpoint": Peer(None, "resume with rayjobs run CONFIG --resume [RUN]"),
    "eval_steps": Peer("eval.every_steps"),
    "run_val_every_n_steps": Peer("eval.every_steps"),
    "per_device_eval_batch_size": Peer("eval.batch_size"),
    "eval_batch_size": Peer("eval.batch_size"),
    "eval_dataset": Peer("eval.datasets"),
    "dataset_val": Peer("eval.datasets"),
    "test_datasets": Peer("eval.datasets"),
    "val_set_size": Peer("eval.datasets", "held-out datasets of their own, read whole"),
    "dataset": Peer("datasets", "a list of datasets"),
    "base_model": Peer("train.model.path", "with train.model.kind: hf"),
    "model_name_or_path": Peer("train.model.path", "with train.model.kind: hf"),
    "pretrained_model_name_or_path": Peer("train.model.path", "with train.model.kind: hf"),
    "tokenizer_name": Peer("tokenizer.path"),
    "tokenizer_name_or_path": Peer("tokenizer.path"),
    "chat_template": Peer("tokenizer.chat_template"),
    "special_tokens": Peer("tokenizer.eos_token", "and tokenizer.pad_token"),
    "eos_token": Peer("tokenizer.eos_token"),
    "pad_token": Peer("tokenizer.pad_token"),
    "attn_implementation": Peer("train.model.attn_implementation", "with train.model.kind: hf"),
    "flash_attention": Peer("train.attention", "auto, sdpa or flex"),
    "sdp_attention": Peer("train.attention", "auto, sdpa or flex"),
    "beta": Peer("dpo.beta"),
    "train_on_inputs": Peer("datasets[].train_on_input"),
    "completion_only_loss": Peer("datasets[].train_on_input", "false trains on completions only"),
    "assistant_only_loss": Peer("datasets[].train_on_input", "false trains on assistant turns"),
    "dataset_text_field": Peer("datasets[].column_map", "{text: COLUMN} with template: text"),
    "dataloader_drop_last": Peer("train.drop_last"),
    # LoRA, QLoRA and weight dtypes (TRL's peft_config, Axolotl's adapter, torchtune's LoRA)
    "adapter": Peer("train.lora", LORA_KEYS),
    "peft_config": Peer("train.lora", LORA_KEYS),
    "use_peft": Peer("train.lora", LORA_KEYS),
    "lora": Peer("train.lora", LORA_KEYS),
    "lora_r": Peer("train.lora.r"),
    "lora_rank": Peer("train.lora.r"),
    "lora_alpha": Peer("train.lora.lora_alpha"),
    "lora_dropout": Peer("train.lora.lora_dropout"),
    "lora_target_modules": Peer("train.lora.target_modules"),
    "lora_attn_modules": Peer("train.lora.target_modules"),
    "lora_target_linear": Peer("train.lora.target_modules", "all-linear"),
    "apply_lora_to_mlp": Peer("train.lora.target_modules", "name the MLP's modules, or all-linear"),
    "lora_modules_to_save": Peer("train.lora.modules_to_save"),
    "merge_lora": Peer("train.lora.save_merged"),
    "torch_dtype": Peer("train.param_dtype", "fp32 or bf16"),
    "load_in_4bit": QLORA,
    "load_in_8bit": QLORA,
    "quantize": QLORA,
    "quantize_base": QLORA,
    "bnb_4bit_quant_type": QLORA,
    "bnb_4bit_compute_dtype": QLORA,
    # data and runtime keys of TRL, Axolotl and torchtune configs (docs/config.md's table)
    "message_property_mappings": Peer("datasets[].message_keys", "{role: from, content: value}"),
    "roles_to_train": Peer("datasets[].train_on", "all_assistant or last_assistant"),
    "train_on_eos": Peer("datasets[].train_on_eos", "turn, last or none"),
    "packing_strategy": Peer("packing.strategy", "bfd, ffd, first_fit or next_fit"),
    "padding_free": Peer(
        None,
        "packed rows are padding-free already (padding only at a row's "
        "end, documents masked apart); remove it",
    ),  # fmt: skip
    "streaming": Peer("packing.mode", "stream, the default, reads and packs as a stream"),
    "dataset_num_proc": Peer("ray.tokenize_concurrency", "Tokenize actors, each a process"),
    "dataset_processes": Peer("ray.tokenize_concurrency", "Tokenize actors, each a process"),
    "deepspeed": Peer("train.parallelism", "ddp or fsdp; DeepSpeed is not supported"),
    "fsdp": Peer("train.parallelism", "fsdp: FSDP2 over the workers"),
    "fsdp_config": Peer("train.parallelism", "fsdp: FSDP2 over the workers"),
    "wandb_project": Peer("train.report_to", "[wandb]; the project from WANDB_PROJECT"),
    "metric_logger": Peer("train.report_to", "tensorboard, mlflow or wandb"),
    "compile": Peer(
        None, "torch.compile is not supported; train.attention: flex compiles its attention"
    ),  # fmt: skip
    "torch_compile": Peer(
        None, "torch.compile is not supported; train.attention: flex compiles its attention"
    ),  # fmt: skip
    "device": Peer("train.use_gpu", "and train.num_workers: one device per worker"),
    "max_steps_per_epoch": Peer("train.max_steps", "for the whole run; an epoch is every row"),
}
"""Peers' names (TRL / HF ``TrainingArguments``, Axolotl, torchtune) → the rayjobs key, wherever
they are written (a key of that name in some section is never looked up here)."""

DATASET_PEERS: dict[str, Peer] = {
    "path": Peer("source", "a file, folder, glob, URI or Hub name"),
    "type": Peer("template", "alpaca, chat, prompt_completion, text or preference"),
    "message_property_mappings": Peer("message_keys", "{role: from, content: value}"),
    "ds_type": Peer("format"),
    "field_messages": Peer("column_map", "{messages: COLUMN}"),
    "train_on_inputs": Peer("train_on_input"),
    "dataset_text_field": Peer("column_map", "{text: COLUMN} with template: text"),
}
"""Peers' names for a dataset's keys (in ``datasets`` and ``eval.datasets``), relative to it."""


def _models(annotation: Any) -> tuple[list[type[BaseModel]], bool]:
    """The models a field's annotation holds, and whether it is a list of them."""
    origin = typing.get_origin(annotation)
    if origin is list:
        return _models(typing.get_args(annotation)[0])[0], True
    if origin in (typing.Union, types.UnionType):
        found = [m for a in typing.get_args(annotation) for m in _models(a)[0]]
        return found, False
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], False
    return [], False


def section_at(path: tuple[Any, ...], raw: Any) -> tuple[type[BaseModel] | None, list[type]]:
    """The section (model) that ``path`` names in a config (``train.model``: the kind its
    ``kind`` in ``raw`` says) and the other models that could have stood there; None for a
    free-form mapping (``train.model.config``) or a path that names no section."""
    model: type[BaseModel] | None = Config
    others: list[type] = []
    node, in_list = raw, False
    for part in path:
        if in_list:  # an index into a list of sections
            fits = isinstance(node, list) and isinstance(part, int) and part < len(node)
            node, in_list = (node[part] if fits else None), False
            continue
        field = model.model_fields.get(str(part)) if model else None
        if field is None:
            return None, []
        node = node.get(part) if isinstance(node, dict) else None
        found, in_list = _models(field.annotation)
        if set(found) == {ModelConfig, HFModelConfig}:
            kind = node.get("kind", "demo") if isinstance(node, dict) else "demo"
            model = MODEL_KINDS.get(kind)
            others = [m for m in found if m is not model]
        else:
            model, others = (found[0] if found else None), []
    return (None, []) if in_list else (model, others)


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of the schema under ``model``, dotted (a list of sections as ``name[]``)."""
    keys = []
    for name, field in model.model_fields.items():
        found, in_list = _models(field.annotation)
        keys.append(f"{prefix}{name}")
        for inner in found:
            keys += _leaves(inner, f"{prefix}{name}{'[]' if in_list else ''}.")
    return list(dict.fromkeys(keys))


KEYS = [key for key in _leaves(Config) if not key.endswith(".files")]
"""Every rayjobs key, dotted (``datasets[].source``, ``train.model.path``, ...)."""


def _use(key: str | None, note: str) -> str:
    if key is None:
        return note
    return f"use {key}" + (f" ({note})" if note else "")


def unknown_key(loc: tuple[Any, ...], raw: Any) -> str:
    """What to say of an unknown key at ``loc`` in the config mapping ``raw``: the rayjobs key
    for a peer's name, the kind of ``train.model`` that has it, the closest key of its section,
    the same key in another section, or the keys its section has."""
    *section, name = loc
    name = str(name)
    prefix = "".join(f"{part}." for part in section)
    model, others = section_at(tuple(section), raw)
    if model is DatasetConfig and name in DATASET_PEERS:
        peer = DATASET_PEERS[name]
        return _use(f"{prefix}{peer.key}", peer.note)
    for other in others:
        if name in other.model_fields:
            (kind,) = typing.get_args(other.model_fields["kind"].annotation)
            return f"a key of train.model.kind: {kind}"
    if name in PEERS:
        return _use(*PEERS[name])
    known = list(model.model_fields) if model else []
    # 0.8: a typo (seq_lenn, templat); at 0.7 streaming was "did you mean train?"
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    elsewhere = [key for key in KEYS if key.rsplit(".", 1)[-1] == name]
    if elsewhere:
        return _use(" or ".join(elsewhere), "")
    if known and len(known) <= 12:
        return f"{prefix or 'the top level'} has {', '.join(known)}"
    return "see docs/config.md for the keys"


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|tuple)\[.*\]|function-.*)$")
"""How pydantic names the member of a union in an error's location (``source.list[str]``)."""

TYPE_ERRORS = ("int_type", "float_type", "bool_type", "int_parsing", "float_parsing")


def _reads_as(kind: str, value: str) -> bool:
    """Whether text ``value`` would be the type a ``kind`` error wants, were it unquoted (``abc``
    is no number with or without quotes)."""
    if kind == "bool_type":
        return value.strip().lower() in ("true", "false", "yes", "no", "on", "off")
    try:
        float(value)
    except ValueError:
        return False
    return True


def _message(item: dict[str, Any], raw: Any) -> str:
    kind, loc, value = item["type"], item["loc"], item.get("input")
    if kind == "extra_forbidden":
        return f"unknown key; {unknown_key(loc, raw)}"
    if kind == "missing":
        return "required key is missing"
    message = item["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    if kind in ("value_error", "assertion_error"):
        return message  # a validator's own words; its input may be a whole section
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        message = "must be a mapping of keys"
    if isinstance(value, str | int | float | bool) or value is None:
        shown = repr(value)
        message += f" (got {shown if len(shown) <= 60 else shown[:57] + '...'})"
        if isinstance(value, str) and kind in TYPE_ERRORS and _reads_as(kind, value):
            message += "; a quoted value is text in YAML: write it without quotes"
    if loc == ("packing",) and isinstance(value, bool):
        message += "; rayjobs always packs: packing holds its settings (seq_len, mode, ...)"
    return message


def describe(error: ValidationError, raw: Any) -> str:
    """Every error of ``error`` as one ``key.path: message`` line, never the input: a section's
    validator gets the whole section as its input, and pydantic's own text (``input_value=``)
    printed the config. The errors of a union's members (``source``: a string or a list) are one
    line."""
    found: dict[str, list[str]] = {}
    for item in error.errors():
        loc = list(item["loc"])
        while loc and isinstance(loc[-1], str) and _UNION_TAG.match(loc[-1]):
            loc.pop()
        where = ".".join(str(part) for part in loc) or "(top level)"
        message = _message({**item, "loc": tuple(loc)}, raw)
        if message not in found.setdefault(where, []):
            found[where].append(message)
    return "\n".join(
        ["invalid config:", *(f"  {where}: {' or '.join(m)}" for where, m in found.items())]
    )


def idle_keys(given: Config, resolved: Config) -> list[str]:
    """The keys ``given`` sets (``model_fields_set``) that do nothing with its other settings,
    each with what to do; ``resolved``: the same config with its datasets' files and formats
    found (see module note: warned of, not refused)."""
    idle = []

    def unused(section: BaseModel, path: str, keys: tuple[str, ...], why: str) -> None:
        idle.extend(
            f"{path}.{k}: has no effect {why}" for k in keys if k in section.model_fields_set
        )

    packing, train = given.packing, given.train
    if packing.mode == "stream":
        unused(
            packing,
            "packing",
            ("window",),
            "in stream mode (planned only); stream mode packs windows of packing.window_tokens",
        )
    else:
        unused(
            packing,
            "packing",
            ("window_tokens", "warmup_tokens"),
            "in planned mode (stream only); planned mode packs windows of packing.window samples",
        )
        unused(given.ray, "ray", ("pack_concurrency",), "in planned mode (stream only)")
    if given.task != "dpo":
        unused(given.dpo, "dpo", tuple(type(given.dpo).model_fields), "with task: sft")
    if train.schedule == "constant":
        unused(
            train,
            "train",
            ("min_lr_ratio",),
            "with a constant learning rate (the decay's "
            "floor: set lr_schedule cosine or linear and max_steps)",
        )
    if train.checkpoint_every is None:
        unused(
            train,
            "train",
            ("keep_checkpoints",),
            "without train.checkpoint_every (it keeps the latest periodic checkpoints)",
        )
    weighted = any(d.weight is not None for d in given.datasets)
    if not weighted and given.mix.epoch_tokens is None and given.mix.epoch_samples is None:
        unused(given.mix, "mix", ("by",), "without weights or an epoch size")
    for section, specs, done in (
        ("datasets", given.datasets, resolved.datasets),
        ("eval.datasets", given.eval.datasets, resolved.eval.datasets),
    ):
        for index, (spec, found) in enumerate(zip(specs, done, strict=True)):
            path, fmt = f"{section}.{index}", found.format
            if spec.format != formats.HF:
                unused(spec, path, ("split",), f"with format {fmt} (format: hf only)")
            if fmt != "text":
                unused(spec, path, ("text_split",), f"with format {fmt} (format: text only)")
            if fmt not in ("parquet", formats.HF):
                unused(spec, path, ("binary",), f"with format {fmt} (Parquet and hf only)")
            sources = [spec.source] if isinstance(spec.source, str) else spec.source
            if spec.format != formats.HF and not any(files.is_remote(s) for s in sources):
                unused(spec, path, ("storage",), "for local files (object storage only)")
    return idle
