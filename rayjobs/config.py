"""Typed run configuration: YAML plus dotted overrides, validated once before Ray starts.

A config is a YAML mapping with the sections below; ``load_config`` reads it, applies
``dotted.key=value`` overrides (values parsed as YAML scalars), and validates everything with
pydantic. Unknown keys, wrong types and missing local files fail here with a ``ConfigError`` whose
message names the dotted key, the bad value and what would be valid, so no Ray work starts on a bad
config. Relative paths (dataset sources, the tokenizer, ``train.storage_path``) are resolved
against the directory of the config file, which makes a config and its data movable together
(``configs/demo.yaml`` points at ``configs/demo/``); overrides are resolved the same way.

A dataset's ``source`` is resolved to its ``files`` here, once: directories and globs expanded and
sorted, and a file reached twice (listed twice, under a relative and an absolute spelling, through
a symlink, or by a glob and a path: the same ``os.path.realpath``) kept once, under its first
spelling. Design note: a file read twice is a silent duplication of its samples, almost always an
accident of overlapping sources; training on a dataset more than once is what ``weight`` is for.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rayjobs import formats, pack, templates


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the dotted key or file."""


def _registered(value: str, registry, kind: str) -> str:
    """``value`` if it names an entry of ``registry``; else a message listing the entries."""
    if value not in registry:
        choices = ", ".join(repr(name) for name in registry)
        raise ValueError(f"unknown {kind} {value!r}; registered: {choices}")
    return value


class _Strict(BaseModel):
    # allow_inf_nan: a weight or lr of .inf passes gt=0 (and NaN fails every check silently)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DatasetConfig(_Strict):
    name: str = Field(min_length=1)
    """Unique name; used in metrics, the run summary and error messages."""
    source: str | list[str]
    """Local file(s), directory or glob; or a Hugging Face dataset name / saved-to-disk folder
    (``format: hf``)."""
    format: str | None = None
    """Input format: a file format of ``rayjobs.formats.FORMATS`` (json, jsonl, parquet, csv, text)
    or ``hf``; inferred from the file extension when omitted."""
    split: str = "train"
    """Split to read for ``format: hf``."""
    template: str
    """How a row becomes training text, a name in ``rayjobs.templates.TEMPLATES``: ``alpaca``
    (instruction/input/output), ``chat`` (``messages`` or ShareGPT ``conversations``), ``text``
    (raw text, every token trained)."""
    column_map: dict[str, str] = Field(default_factory=dict)
    """Template field → dataset column, e.g. ``{output: response}``; the keys must be fields the
    template reads (``templates.TEMPLATE_FIELDS``)."""
    train_on_input: bool = False
    """Also train on prompt / user tokens (default: only responses / assistant turns)."""
    weight: float | None = Field(default=None, gt=0)
    """Target share of the epoch (normalised over datasets), in samples or tokens (``mix.by``).
    Set it on every dataset or on none (none: each dataset in its natural proportion)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A bad row (``rayjobs.formats.SKIP_REASONS``: a JSONL line that is not JSON, bytes that are
    not UTF-8, a ragged CSV row, a field of the wrong type, missing or empty, a template that
    raises): stop with an error naming dataset, file, row and field or reason, or skip it and count
    it under ``skipped_rows`` and, by reason, ``skipped_by_reason``. Over-length samples follow
    ``packing.overflow`` instead."""
    binary: Literal["error", "utf8"] = "error"
    """Parquet / Hugging Face columns of bytes: refuse the file (``error``; ``str`` of bytes would
    train on the text ``b'...'``), or decode them as UTF-8 text (``utf8``; a value that does not
    decode is a bad row, ``invalid_utf8``)."""
    text_split: Literal["line", "paragraph", "file"] = "paragraph"
    """For ``format: text``: one document per line, per blank-line separated paragraph, or per
    file."""
    files: tuple[str, ...] = ()
    """Resolved file list, filled in by validation (a config that sets it is refused)."""

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str | None) -> str | None:
        return (
            value if value is None else _registered(value, [*formats.FORMATS, formats.HF], "format")
        )

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        return _registered(value, templates.TEMPLATES, "template")

    @model_validator(mode="after")
    def _column_map_names_template_fields(self) -> DatasetConfig:
        fields = templates.TEMPLATE_FIELDS.get(self.template)
        unknown = sorted(set(self.column_map) - fields) if fields is not None else []
        if unknown:
            raise ValueError(
                f"column_map key(s) {unknown} name no field of template {self.template!r}, "
                f"which reads {sorted(fields)} (column_map maps a template field to a column)"
            )
        return self


class TokenizerConfig(_Strict):
    path: str
    """A tokenizer.json file, a local tokenizer directory, or a Hugging Face tokenizer name."""
    chat_template: str | None = None
    """Jinja chat template overriding the tokenizer's; when neither exists a ChatML layout is
    used."""
    eos_token: str | None = None
    """End-of-sequence token appended to every sample; default: the tokenizer's eos token."""
    pad_token: str | None = None
    """Token used for padding packs (never trained); default: pad token, else eos."""
    add_bos: bool | None = None
    """Start every sample (a DPO triple: its prompt) with the BOS token, unless its text already
    does (a chat template writing ``{{ bos_token }}``); default: as the tokenizer's own
    post-processor does (Llama, Gemma: yes; GPT-2: no), so fine-tuning sees what
    ``tokenizer(text)`` gives at inference."""


class MixConfig(_Strict):
    by: Literal["tokens", "samples"] = "tokens"
    """What each dataset's ``weight`` is a share of: the epoch's tokens or its samples."""
    epoch_samples: int | None = Field(default=None, gt=0)
    """Epoch size in samples (mix.by: samples); default all samples of all datasets once."""
    epoch_tokens: int | None = Field(default=None, gt=0)
    """Epoch size in tokens (mix.by: tokens); default all tokens of all datasets once."""

    @model_validator(mode="after")
    def _size_matches_unit(self) -> MixConfig:
        wrong = "epoch_samples" if self.by == "tokens" else "epoch_tokens"
        if getattr(self, wrong) is not None:
            right = "epoch_tokens" if self.by == "tokens" else "epoch_samples"
            raise ValueError(f"{wrong} does not apply with by: {self.by}; set {right} instead")
        return self


class PackingConfig(_Strict):
    seq_len: int = Field(default=2048, gt=1)
    """Length of every packed row (at least 2: a one-token row has nothing to predict)."""
    mode: Literal["stream", "planned"] = "stream"
    """``stream``: read, tokenize and pack as the data flows, all epochs one stream (README,
    "Design"); ``planned``: tokenize everything once, then plan every epoch's mix and packs in
    the driver (exact shares, the same packs for the same seed)."""
    window_tokens: int = Field(default=4_194_304, gt=0)
    """stream: tokens packed together by one packer call (its shuffle window); each call leaves
    about half a row of padding behind, so larger windows pack tighter and use more memory."""
    warmup_tokens: int = Field(default=262_144, ge=0)
    """stream: tokens at the head of the first epoch packed in a lane of their own, in windows of
    a quarter of this, so the first batch waits for them and not for a whole ``window_tokens``
    window (0: no warm-up lane)."""
    window: int = Field(default=4096, gt=0)
    """planned: samples packed together by one pass of ``packing.strategy``."""
    overflow: Literal["truncate", "drop", "split"] = "truncate"
    """Samples longer than seq_len: cut to seq_len, drop, or split into seq_len chunks."""
    strategy: str = "bfd"
    """Bin-choice rule of the packer, a name in ``rayjobs.pack.STRATEGIES``."""

    @model_validator(mode="after")
    def _window_holds_a_row(self) -> PackingConfig:
        if self.window_tokens < self.seq_len:
            raise ValueError(
                f"window_tokens ({self.window_tokens}) is below seq_len ({self.seq_len}): a "
                f"packer call could not fill one row, so nothing would be packed together"
            )
        return self

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        return _registered(value, pack.STRATEGIES, "packing strategy")


class ModelConfig(_Strict):
    """``train.model`` with ``kind: demo`` (the default): the small decoder of ``rayjobs.model``."""

    kind: Literal["demo"] = "demo"
    dim: int = Field(default=128, gt=0)
    n_layers: int = Field(default=2, gt=0)
    n_heads: int = Field(default=4, gt=0)

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> ModelConfig:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"dim ({self.dim}) must be n_heads ({self.n_heads}) heads of even width "
                f"(RoPE rotates pairs of dimensions)"
            )
        return self


class HFModelConfig(_Strict):
    """``train.model`` with ``kind: hf``: a Hugging Face causal LM, pretrained (``path``) or an
    architecture initialised at random with the run's seed (``config_path`` or
    ``config.model_type``)."""

    kind: Literal["hf"]
    path: str | None = None
    """Pretrained weights: a local checkpoint directory or a Hub name (from the local cache unless
    ``allow_download``), loaded with ``AutoModelForCausalLM.from_pretrained``."""
    config_path: str | None = None
    """An architecture from a local ``config.json`` (or a folder holding one), random init."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Config values: overrides of the loaded config; without ``path`` or ``config_path`` the
    whole architecture, ``model_type`` included (``AutoConfig.for_model``). ``vocab_size`` and the
    bos/eos/pad token ids default to the tokenizer's for a random init."""
    attn_implementation: Literal["sdpa", "eager", "flex_attention"] | None = None
    """Attention backend; default from ``train.attention`` (flex: ``flex_attention``, sdpa:
    ``sdpa``). ``flex_attention`` trains on CUDA only."""
    allow_download: bool = False
    """Let ``path`` (a Hub name) download; by default only the local cache is read."""

    @model_validator(mode="after")
    def _one_source(self) -> HFModelConfig:
        if self.path is not None and self.config_path is not None:
            raise ValueError("set path (pretrained weights) or config_path (random init), not both")
        has_type = "model_type" in self.config
        if (self.path is not None or self.config_path is not None) and has_type:
            raise ValueError("config.model_type comes from path / config_path; remove it")
        if self.path is None and self.config_path is None and not has_type:
            raise ValueError(
                "set path (pretrained weights), config_path (a config.json) or "
                "config.model_type (an architecture, e.g. llama) to say which model to build"
            )
        return self


MODEL_KINDS = {"demo": ModelConfig, "hf": HFModelConfig}
"""``train.model.kind`` → its section."""


class TrainConfig(_Strict):
    num_workers: int = Field(default=2, ge=0)
    """Ray Train workers (0 runs the loop in the driver process)."""
    use_gpu: bool = False
    cpus_per_worker: float = Field(default=0.5, gt=0)
    """Logical CPUs each train worker reserves; keep it fractional on small CPU clusters so the
    data operators are not starved (see README, Resources)."""
    resources_per_worker: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each train worker also reserves, e.g. ``{trainer: 1}`` where only
    trainer nodes declare ``trainer`` (CPU and GPU come from ``cpus_per_worker`` / ``use_gpu``)."""
    label_selector: dict[str, str] = Field(default_factory=dict)
    """Ray node labels every train worker requires, e.g. ``{rayjobs.io/role: train}``; empty:
    any node with the worker's resources (with ``use_gpu``, a GPU node)."""
    batch_size: int = Field(default=4, gt=0)
    """Packed rows per step per worker."""
    epochs: int = Field(default=1, gt=0)
    max_steps: int | None = Field(default=None, gt=0)
    """Stop after this many steps (per worker, all workers stop together)."""
    lr: float = Field(default=1e-3, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW's decoupled weight decay, on weight matrices and embeddings only: biases and norm
    gains (every parameter of fewer than 2 dimensions) never decay, as in HF's Trainer."""
    drop_last: bool = False
    """Skip each dataset's last batch on a worker when it is short (fewer than ``batch_size``
    rows, the same on every worker): static batch shapes, at the cost of up to
    ``num_workers × batch_size − 1`` untrained packs an epoch (planned) or a run (stream).
    False (HF's Trainer default): trained, its loss weighed by its tokens like any other."""
    grad_accum_steps: int = Field(default=1, gt=0)
    """Micro-batches of ``batch_size`` rows per optimizer step on each worker; one step's loss is
    the mean over every labelled token of its micro-batches on every worker."""
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this before each optimizer step; null: no clipping."""
    lr_schedule: Literal["auto", "constant", "cosine", "linear"] = "auto"
    """After ``warmup_steps`` of linear warm-up: hold ``lr`` (constant) or decay it to
    ``min_lr_ratio`` × ``lr`` at ``max_steps`` (cosine, linear). auto: cosine when ``max_steps``
    is set, else constant (a streamed run's length is not known before its data is read)."""
    warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps of linear warm-up from 0 to ``lr``."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """bf16: the forward runs under bf16 autocast (weights, gradients and optimizer state stay
    fp32, the loss is computed in fp32); auto: bf16 on GPUs that support it, fp32 on CPU."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """ddp: every worker holds the whole model (Ray Train's ``prepare_model``); fsdp: FSDP2
    (``fully_shard`` per transformer block, then the whole model) shards parameters, gradients
    and optimizer state over the workers, for models that do not fit one GPU."""
    max_failures: int = Field(default=0, ge=-1)
    """Worker-group failures (a dead worker or node) to recover from by restarting the workers
    from the latest checkpoint (``checkpoint_every``); -1: no limit (Ray Train's
    ``FailureConfig``)."""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """auto: FlexAttention on CUDA, SDPA with the dense document mask on CPU."""
    report_every: int = Field(default=10, gt=0)
    storage_path: str = "runs"
    """Where Ray Train writes checkpoints: a folder (relative to the config file's folder, like
    every path in the config) or a URI with a scheme (``s3://bucket/runs``), kept as is."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of keeping them
    (torchtune's ``enable_activation_checkpointing``, HF's ``gradient_checkpointing``): memory
    for about one more forward per step."""
    loss_chunk_tokens: int = Field(default=1024, ge=0)
    """Labelled positions whose logits the loss computes at once (chunked cross entropy, each
    chunk recomputed in backward); 0: the whole batch's logits at once."""
    checkpoint_every: int | None = Field(default=None, gt=0)
    """Also save a checkpoint every this many steps (the summary lists them)."""
    keep_checkpoints: int | None = Field(default=None, gt=0)
    """Keep only the latest this many periodic checkpoints (Ray Train deletes older ones; the
    final checkpoint is kept besides them), as HF's ``save_total_limit``; null: keep all."""
    model: ModelConfig | HFModelConfig = Field(default_factory=ModelConfig)
    """``kind: demo`` (default) or ``kind: hf``; see ``ModelConfig`` and ``HFModelConfig``."""

    @model_validator(mode="after")
    def _schedule_horizon(self) -> TrainConfig:
        if self.lr_schedule in ("cosine", "linear") and self.max_steps is None:
            raise ValueError(
                f"lr_schedule: {self.lr_schedule} decays to max_steps; set train.max_steps "
                "(a streamed run's length is not known before its data is read) or use constant"
            )
        if self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) exceeds max_steps ({self.max_steps})"
            )
        return self

    @model_validator(mode="after")
    def _flex_needs_a_gpu(self) -> TrainConfig:
        """Refused here rather than in every train worker once Ray and the data have started."""
        if self.use_gpu:
            return self
        if self.attention == "flex":
            key = "train.attention: flex"
        elif getattr(self.model, "attn_implementation", None) == "flex_attention":
            key = "train.model.attn_implementation: flex_attention"
        else:
            return self
        raise ValueError(
            f"{key} trains on CUDA only (FlexAttention has no CPU backward pass in torch 2.13); "
            f"set train.use_gpu: true, or use sdpa (train.attention: auto picks flex on CUDA)"
        )

    @property
    def schedule(self) -> str:
        """The LR schedule ``lr_schedule`` resolves to."""
        if self.lr_schedule != "auto":
            return self.lr_schedule
        return "cosine" if self.max_steps is not None else "constant"

    @field_validator("resources_per_worker")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float]) -> dict[str, float]:
        reserved = sorted({"CPU", "GPU", "memory"} & set(value))
        if reserved:
            raise ValueError(
                f"{', '.join(reserved)}: set CPUs with cpus_per_worker and GPUs with use_gpu; "
                "resources_per_worker is for custom resources"
            )
        negative = sorted(name for name, amount in value.items() if amount <= 0)
        if negative:
            raise ValueError(f"{', '.join(negative)}: amounts must be positive")
        return value

    @field_validator("model", mode="wrap")
    @classmethod
    def _model_kind(cls, value: Any, handler: Any) -> ModelConfig | HFModelConfig:
        # Dispatch on kind by hand: a pydantic discriminated union would put the kind into error
        # locations (train.model.hf.path), naming a key that does not exist.
        if isinstance(value, (ModelConfig, HFModelConfig)):
            return handler(value)
        if not isinstance(value, dict):
            raise ValueError("must be a mapping (kind: demo or kind: hf, and its keys)")
        kind = value.get("kind", "demo")
        if kind not in MODEL_KINDS:
            raise ValidationError.from_exception_data(
                "model",
                [
                    {
                        "type": "literal_error",
                        "loc": ("kind",),
                        "input": kind,
                        "ctx": {"expected": " or ".join(repr(k) for k in MODEL_KINDS)},
                    }
                ],
            )
        return MODEL_KINDS[kind].model_validate(value)


class RayConfig(_Strict):
    address: str | None = None
    """Cluster to connect to; default: $RAY_ADDRESS, else an embedded local Ray."""
    num_cpus: float | None = Field(default=None, gt=0)
    """Logical CPUs of the embedded local Ray; default max(4, 2 × cores), see README."""
    tokenize_concurrency: int | None = Field(default=None, gt=0)
    """Maximum Tokenize actors (the pool grows to it as data waits); default half the cluster's
    CPUs, so adding CPU nodes adds tokenizers."""
    min_actors: int = Field(default=1, gt=0)
    """Actors each data pool (Tokenize, packers) starts with, before it grows."""
    pack_concurrency: int | None = Field(default=None, gt=0)
    """stream: maximum packer actors; default a quarter of the cluster's CPUs (at least 1)."""
    data_label_selector: dict[str, str] = Field(default_factory=dict)
    """Ray node labels every data task and actor (read, tokenize, pack) requires, e.g.
    ``{rayjobs.io/role: data}`` (Ray's label selector syntax: ``"!gpu"``, ``"in(a,b)"``); empty:
    anywhere with free CPUs."""


class DPOConfig(_Strict):
    beta: float = Field(default=0.1, gt=0)
    """The DPO temperature: the implicit reward is ``beta`` × the policy's log-ratio to the
    reference."""
    disable_dropout: bool = True
    """Zero the model's dropout (policy and reference), as TRL's ``disable_dropout`` does by
    default: with dropout in the training policy and none in the eval-mode reference, the
    log-ratios are noise even at equal weights (a GPT-2 config's 0.1 gave a step-0 loss of 0.756,
    not log 2)."""


class EvalConfig(_Strict):
    """Held-out evaluation: the loss (DPO: loss and rewards) over datasets never trained on, as
    HF's ``eval_dataset`` / ``eval_steps`` and torchtune's ``dataset_val``."""

    datasets: list[DatasetConfig] = Field(default_factory=list)
    """Datasets to evaluate on, in the same form as ``datasets`` (template, column_map,
    on_bad_row, ...) but without ``weight``: each is read, tokenized and packed once, whole,
    before training starts, and every evaluation runs over all of its packs. Empty: no
    evaluation."""
    every_steps: int | None = Field(default=None, gt=0)
    """Evaluate every this many optimizer steps, and always once when training ends; null: at
    the end only."""
    batch_size: int | None = Field(default=None, gt=0)
    """Packed rows per forward on each worker; null: ``train.batch_size``."""

    @field_validator("datasets")
    @classmethod
    def _unweighted(cls, datasets: list[DatasetConfig]) -> list[DatasetConfig]:
        weighted = [d.name for d in datasets if d.weight is not None]
        if weighted:
            raise ValueError(
                f"eval datasets {weighted} set weight: an evaluation reads each dataset whole, "
                "once; remove weight"
            )
        return _unique(datasets)

    @model_validator(mode="after")
    def _settings_need_datasets(self) -> EvalConfig:
        settings = [k for k in ("every_steps", "batch_size") if getattr(self, k) is not None]
        if settings and not self.datasets:
            raise ValueError(
                f"eval.{settings[0]} is set but eval.datasets is empty: list the held-out "
                "datasets to evaluate on"
            )
        return self


def _unique(datasets: list[DatasetConfig]) -> list[DatasetConfig]:
    names = [d.name for d in datasets]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"dataset names must be unique; repeated: {duplicates}")
    return datasets


class Config(_Strict):
    task: Literal["sft", "dpo"] = "sft"
    """sft: samples packed as documents, token cross entropy; dpo: preference triples (template
    ``preference``) packed as units of three documents, the DPO loss against a frozen reference
    (the initial model)."""
    datasets: list[DatasetConfig] = Field(min_length=1)
    tokenizer: TokenizerConfig
    packing: PackingConfig = Field(default_factory=PackingConfig)
    mix: MixConfig = Field(default_factory=MixConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    seed: int = Field(default=0, ge=0)  # numpy's SeedSequence takes no negative entropy

    @model_validator(mode="after")
    def _task_fits(self) -> Config:
        for section, specs in (("datasets", self.datasets), ("eval.datasets", self.eval.datasets)):
            preference = [d.name for d in specs if d.template in templates.PREFERENCE_TEMPLATES]
            if self.task == "sft" and preference:
                raise ValueError(
                    f"{section} {preference} use a preference template: set task: dpo to train "
                    "on preference triples"
                )
            others = [d.name for d in specs if d.name not in preference]
            if self.task == "dpo" and others:
                raise ValueError(
                    f"task: dpo trains on preference triples; {section} {others} need template: "
                    "preference"
                )
        if self.task == "dpo":
            if self.packing.mode != "stream":
                raise ValueError(
                    "task: dpo packs in stream mode (packing.mode: stream); the planned path "
                    "plans single documents"
                )
            if self.packing.overflow == "split":
                raise ValueError(
                    "task: dpo: packing.overflow split would part a response from its prompt; "
                    "use truncate or drop"
                )
        return self

    @field_validator("datasets")
    @classmethod
    def _unique_names(cls, datasets: list[DatasetConfig]) -> list[DatasetConfig]:
        _unique(datasets)
        weighted = [d.weight is not None for d in datasets]
        if any(weighted) and not all(weighted):
            unset = [d.name for d in datasets if d.weight is None]
            raise ValueError(f"set weight on every dataset or on none; missing on {unset}")
        return datasets


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, less two YAML 1.1 surprises: a key written twice in one mapping is
    refused (PyYAML keeps the last, so a second ``train:`` section silently replaced the
    first), and ``1e-5`` is a float as in YAML 1.2 and JSON (1.1 wants ``1.0e-5``; typed keys
    coerce the string, but ``train.model.config`` passes it to transformers as text)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} repeats the key of line {seen[key]}",
                    key_node.start_mark,
                )  # fmt: skip
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    """YAML as rayjobs reads configs and overrides (see :class:`_YamlLoader`)."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply ``dotted.key=value`` overrides, validate and resolve paths.

    Raises:
        ConfigError: naming the file, dotted key or value at fault.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    except UnicodeDecodeError as error:
        where = f"{error.reason} at byte {error.start}"
        raise ConfigError(f"{path} is not UTF-8 text ({where})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (datasets, tokenizer, ...)")
    for override in overrides:
        _apply_override(raw, override)
    return config_from_dict(raw, base_dir=path.parent)


def config_from_dict(raw: dict[str, Any], base_dir: str | os.PathLike = ".") -> Config:
    """Validate a config mapping and resolve its paths against ``base_dir``."""
    try:
        config = Config.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(_describe(error)) from None
    base_dir = Path(base_dir).resolve()
    datasets = [_resolve_dataset(d, i, base_dir) for i, d in enumerate(config.datasets)]
    held_out = [
        _resolve_dataset(spec, i, base_dir, "eval.datasets")
        for i, spec in enumerate(config.eval.datasets)
    ]
    tokenizer_path = _resolve_tokenizer(config.tokenizer.path, base_dir)
    storage_path = _resolve_storage(config.train.storage_path, base_dir)
    return config.model_copy(
        update={
            "datasets": datasets,
            "eval": config.eval.model_copy(update={"datasets": held_out}),
            "tokenizer": config.tokenizer.model_copy(update={"path": tokenizer_path}),
            "train": config.train.model_copy(
                update={
                    "storage_path": storage_path,
                    "model": _resolve_model(config.train.model, base_dir),
                }
            ),
        }
    )


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r} must look like dotted.key=value")
    node: Any = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(
                    f"override {key}: {'.'.join(parts[: depth + 1])} is not an index "
                    f"of a list of {len(node)}"
                )
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"override {key}: {'.'.join(parts[: depth + 1])} is not a section")
    last = parts[-1]
    try:
        parsed = yaml_load(value) if value else ""
    except yaml.YAMLError:
        parsed = value  # not a YAML scalar (a Jinja template, say): take it as text
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"override {key}: {last} is not an index of a list of {len(node)}")
        node[int(last)] = parsed
    else:
        node[last] = parsed


def _describe(error: ValidationError) -> str:
    lines = ["invalid config:"]
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"  {where}: unknown key")
        elif item["type"] == "missing":
            lines.append(f"  {where}: required key is missing")
        else:
            lines.append(f"  {where}: {item['msg']} (got {item.get('input')!r})")
    return "\n".join(lines)


def _resolve_dataset(
    spec: DatasetConfig, index: int, base_dir: Path, section: str = "datasets"
) -> DatasetConfig:
    key = f"{section}.{index}.source"
    if spec.files:  # the field exists so workers get the list validation resolved, once
        raise ConfigError(
            f"{section}.{index}.files: filled in from {key}, not set in a config; "
            f"list the files in {key} instead"
        )
    sources = [spec.source] if isinstance(spec.source, str) else list(spec.source)
    if spec.format == formats.HF:
        if len(sources) != 1:
            raise ConfigError(
                f"{key} (dataset {spec.name!r}): format hf reads one dataset (a Hub name or a "
                f"save_to_disk folder), got {len(sources)}; list each as a dataset of its own"
            )
        local = Path(os.path.expanduser(sources[0]))
        local = local if local.is_absolute() else base_dir / local
        resolved = str(local) if local.exists() else sources[0]
        return spec.model_copy(update={"source": resolved})
    if not sources:
        raise ConfigError(f"{key} (dataset {spec.name!r}): an empty list names no file")
    files: list[str] = []
    seen: set[str] = set()  # real paths of the files kept
    for source in sources:
        full = Path(os.path.expanduser(source))
        full = full if full.is_absolute() else base_dir / full
        if full.is_dir():
            matches = sorted(
                str(p)
                for p in full.rglob("*")
                if p.is_file()
                and formats.format_of(p.name) is not None
                and spec.format in (None, formats.format_of(p.name))
            )
        else:
            matches = sorted(glob.glob(str(full), recursive=True))
        if not matches:
            raise ConfigError(f"{key} (dataset {spec.name!r}): no file matches {full}")
        for match in matches:  # a file reached twice is read once, under its first spelling
            real = os.path.realpath(match)
            if real not in seen:
                seen.add(real)
                files.append(match)
    if all(_is_empty(f) for f in files):
        raise ConfigError(
            f"{key} (dataset {spec.name!r}): every file is empty ({files[:3]}); "
            f"a dataset in the mix needs at least one row"
        )
    fmt = spec.format
    if fmt is None:
        found = {formats.format_of(f) for f in files}
        if len(found) != 1 or None in found:
            raise ConfigError(
                f"{section}.{index}.format (dataset {spec.name!r}): cannot infer the "
                f"format from the extensions of {files[:3]}; set format to one of "
                f"{', '.join(formats.FORMATS)}"
            )
        fmt = found.pop()
    return spec.model_copy(update={"format": fmt, "files": tuple(files)})


def _is_empty(path: str) -> bool:
    """No rows for sure: zero bytes, or (small files only) just whitespace or an empty JSON list."""
    size = os.path.getsize(path)
    if size > 1 << 16:
        return False
    return Path(path).read_bytes().strip() in (b"", b"[]")


def _resolve_storage(path: str, base_dir: Path) -> str:
    """``train.storage_path``: a URI (``s3://…``) as is, a folder against ``base_dir``."""
    if "://" in path:
        return path
    local = Path(os.path.expanduser(path))
    return str(local if local.is_absolute() else base_dir / local)


def _resolve_model(
    spec: ModelConfig | HFModelConfig, base_dir: Path
) -> ModelConfig | HFModelConfig:
    """``train.model.path`` / ``config_path`` of ``kind: hf`` against ``base_dir``. ``path`` may
    also be a Hub name (anything that does not look like a path); ``config_path`` must exist."""
    if not isinstance(spec, HFModelConfig):
        return spec
    update = {}
    if spec.path is not None:
        local = Path(os.path.expanduser(spec.path))
        local = local if local.is_absolute() else base_dir / local
        if local.exists():
            update["path"] = str(local)
        elif spec.path.startswith((".", "/", "~")):
            raise ConfigError(f"train.model.path: no checkpoint directory at {local}")
    if spec.config_path is not None:
        local = Path(os.path.expanduser(spec.config_path))
        local = local if local.is_absolute() else base_dir / local
        if not local.exists():
            raise ConfigError(f"train.model.config_path: no config.json or folder at {local}")
        update["config_path"] = str(local)
    return spec.model_copy(update=update)


def _resolve_tokenizer(path: str, base_dir: Path) -> str:
    local = Path(os.path.expanduser(path))
    local = local if local.is_absolute() else base_dir / local
    if local.exists():
        return str(local)
    looks_local = path.startswith((".", "/", "~")) or path.endswith(".json")
    if looks_local:
        raise ConfigError(f"tokenizer.path: no tokenizer file or directory at {local}")
    return path  # a Hugging Face hub name; resolved by transformers at load time
