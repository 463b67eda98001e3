"""The run configuration's sections: pydantic models, validated against the registries.

Every section forbids unknown keys and is frozen; ``rayjobs.config.load`` reads YAML into them. A
dataset's ``files`` are filled in by that loader (resolved once, before Ray starts).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from rayjobs.config.base import Strict, registered
from rayjobs.config.models import (
    MODEL_KINDS,
    HFModelConfig,
    LoraConfig,
    ModelConfig,
    check_training_choices,
)
from rayjobs.config.runtime import RayConfig
from rayjobs.data import formats, pack, templates


class StorageConfig(Strict):
    """A dataset's object-store settings (``rayjobs.data.files``); credentials never go here:
    they come from each node's environment."""

    endpoint_url: str | None = None
    """An S3-compatible store's endpoint (``http://minio:9000``) or a GCS emulator's; default:
    ``AWS_ENDPOINT_URL`` for ``s3://`` sources."""
    region: str | None = None
    """S3 region; default: ``AWS_REGION`` / ``AWS_DEFAULT_REGION``."""
    anonymous: bool = False
    """Read a public bucket without credentials."""


class DatasetConfig(Strict):
    name: str = Field(min_length=1)
    """Unique name; used in metrics, the run summary and error messages."""
    source: str | list[str]
    """Local file(s), folder or glob, or URIs of them on object storage (``s3://``, ``gs://``,
    ``abfs://``, ``az://``, ``hf://``: a folder is a prefix, ``**`` matches across folders); or a
    Hugging Face dataset: a Hub name, a local Hub-layout folder or a ``save_to_disk`` folder
    (``format: hf``)."""
    format: str | None = None
    """Input format: a file format of ``rayjobs.data.formats.FORMATS`` (json, jsonl, parquet, csv,
    text) or ``hf``; inferred from the file extension when omitted."""
    split: str = "train"
    """Split to read for ``format: hf``."""
    subset: str | None = None
    """``format: hf``: the dataset's configuration, ``load_dataset``'s ``name`` (c4's ``en``,
    gsm8k's ``main``)."""
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    """``format: hf``: the data files that make the dataset, as ``load_dataset``'s
    ``data_files``."""
    revision: str | None = None
    """``format: hf``: a Hub dataset's branch, tag or commit."""
    storage: StorageConfig = Field(default_factory=StorageConfig)
    """Object-store settings of the dataset's URIs (endpoint, region, anonymous)."""
    ignore_columns: list[str] = Field(default_factory=list)
    """Columns the template does not read, named as known and not trained on: silences the
    unused-column warning, and lets through a column that would otherwise be refused because it
    changes what a row means (a KTO-style ``label``)."""
    template: str
    """How a row becomes training text, a name in ``rayjobs.data.templates.TEMPLATES``: ``alpaca``
    (instruction/input/output), ``chat`` (``messages`` or ShareGPT ``conversations``),
    ``prompt_completion`` (TRL's prompt and completion), ``text`` (raw text, every token
    trained), ``preference`` (``task: dpo``), or one of ``template_modules``."""
    dataset_info: str | None = None
    """A LLaMA-Factory ``dataset_info.json`` (``PATH``, its entry named as the dataset, or
    ``PATH#ENTRY``) whose entry sets ``source``, ``template``, ``column_map``, ``message_keys``
    and ``roles`` (``rayjobs.config.llamafactory``)."""
    column_map: dict[str, str] = Field(default_factory=dict)
    """Template field → dataset column, e.g. ``{output: response}``; the keys must be fields the
    template reads (``Template.fields``)."""
    message_keys: dict[str, str] = Field(default_factory=dict)
    """The keys of a conversation turn's role and text in the data, ``{role: from, content:
    value}`` (Axolotl's ``message_property_mappings``); default: ``role``/``content``, and
    ``from``/``value`` for ShareGPT ``conversations``."""
    roles: dict[str, str] = Field(default_factory=dict)
    """The data's role names → ``system``, ``user``, ``assistant`` or ``tool``, e.g.
    ``{human: user, bot: assistant}``, on top of the OpenAI and ShareGPT names known already."""
    train_on_input: bool = False
    """Also train on prompt / user tokens (default: only responses / assistant turns)."""
    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """Chat turns: train every assistant turn, or only the last (LLaMA-Factory's
    ``mask_history``); a turn's own ``train`` (bool) or ``weight`` (0/1) wins over it."""
    train_on_eos: Literal["turn", "last", "none"] = "turn"
    """Whether EOS tokens train (Axolotl's ``train_on_eos``): ``turn``, an EOS that ends a trained
    turn or response (the one appended to a sample, a chat template's own); ``last``, only the
    sample's last such EOS; ``none``, never."""
    weight: float | None = Field(default=None, gt=0)
    """Target share of the epoch (normalised over datasets), in samples or tokens (``mix.by``).
    Set it on every dataset or on none (none: each dataset in its natural proportion)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A bad row (``rayjobs.data.formats.SKIP_REASONS``: a JSONL line that is not JSON, bytes that
    are not UTF-8, a ragged CSV row, a field of the wrong type, missing or empty, a template that
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
    max_row_bytes: int = Field(default=formats.MAX_ROW_BYTES, gt=0)
    """A row's bytes at most (a JSONL line, a text document, a ``text_split: file`` file): a
    larger one is a bad row, ``too_large``, read past without being held."""
    max_depth: int = Field(default=formats.MAX_DEPTH, gt=0)
    """How deep a JSONL row's arrays and objects may nest: a deeper one is a bad row,
    ``too_deep``."""
    max_turns: int = Field(default=templates.MAX_TURNS, gt=0)
    """Turns of a conversation at most: a longer one is a bad row, ``too_many_turns``."""
    files: tuple[str, ...] = Field(default=(), strict=False)
    """Resolved file list, filled in by validation (a config that sets it is refused)."""

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str | None) -> str | None:
        return (
            value if value is None else registered(value, [*formats.FORMATS, formats.HF], "format")
        )

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        try:
            return registered(value, templates.TEMPLATES, "template")
        except ValueError as error:
            raise ValueError(f"{error} (a template of your own: name its module in "
                             "template_modules)") from None  # fmt: skip

    @model_validator(mode="after")
    def _hub_options_need_hf(self) -> DatasetConfig:
        """``subset``, ``data_files`` and ``revision`` say which Hugging Face dataset to read
        (a resolved one has become its ``files``)."""
        given = [k for k in ("subset", "data_files", "revision") if getattr(self, k) is not None]
        if given and self.format != "hf" and not self.files:
            raise ValueError(f"{', '.join(given)} apply to format: hf only")
        return self

    @field_validator("message_keys", "roles", mode="before")
    @classmethod
    def _turn_settings(cls, value: Any, info: Any) -> Any:
        templates.check_turn_setting(info.field_name, value)
        return value

    @model_validator(mode="after")
    def _turn_settings_need_turns(self) -> DatasetConfig:
        given = [key for key in ("message_keys", "roles") if getattr(self, key)]
        given += ["train_on"] if self.train_on != "all_assistant" else []
        if given and templates.TEMPLATES[self.template].turns is False:
            raise ValueError(
                f"{', '.join(given)} apply to templates that read conversation turns; template "
                f"{self.template!r} reads none"
            )
        return self

    @property
    def columns(self) -> templates.Columns:
        """``column_map`` as templates receive it, with ``message_keys`` and ``roles``."""
        return templates.Columns(
            self.column_map, self.message_keys, self.roles, self.train_on, self.max_turns
        )

    @model_validator(mode="after")
    def _column_map_names_template_fields(self) -> DatasetConfig:
        fields = templates.TEMPLATES[self.template].fields
        unknown = sorted(set(self.column_map) - fields) if fields is not None else []
        if unknown:
            raise ValueError(
                f"column_map key(s) {unknown} name no field of template {self.template!r}, "
                f"which reads {sorted(fields)} (column_map maps a template field to a column)"
            )
        return self


class TokenizerConfig(Strict):
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
    backend: Literal["auto", "tokenizers", "fastokens"] = "auto"
    """The library that encodes text: ``tokenizers`` (Hugging Face's, which loads the tokenizer,
    its special tokens and chat template whichever encodes) or ``fastokens`` (a core dependency:
    a faster encoder of the same ``tokenizer.json``, no offsets; refused, before Ray starts, where
    it cannot load the tokenizer, and where it encodes the head of a dataset otherwise).
    ``auto``: fastokens where it is installed, loads the tokenizer and gives the same ids and
    samples as tokenizers on the head of every dataset, checked once by the driver at start-up;
    else tokenizers, with the reason (a warning, and the summary's ``tokenizer``)."""


class MixConfig(Strict):
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


class PackingConfig(Strict):
    seq_len: int = Field(default=2048, gt=1)
    """Length of every packed row (at least 2: a one-token row has nothing to predict)."""
    mode: Literal["stream", "planned"] = "stream"
    """``stream``: read, tokenize and pack as the data flows, all epochs one stream
    (docs/design.md); ``planned``: tokenize everything once, then plan every epoch's mix and packs
    in the driver (exact shares, the same packs for the same seed)."""
    window_tokens: int = Field(default=4_194_304, gt=0)
    """stream: tokens packed together by one packer call (its shuffle window); each call leaves
    about half a row of padding behind, so larger windows pack tighter and use more memory."""
    warmup_tokens: int = Field(default=262_144, ge=0)
    """stream: tokens at the head of the first epoch packed in a lane of their own, in one call,
    so the first batch waits for them and not for a whole ``window_tokens`` window (0: no warm-up
    lane; none either for a first epoch expected to hold at most 4 times this)."""
    window: int = Field(default=4096, gt=0)
    """planned: samples packed together by one pass of ``packing.strategy``."""
    overflow: Literal["truncate", "drop", "split"] = "truncate"
    """Samples longer than seq_len: cut to seq_len, drop, or split into seq_len chunks."""
    strategy: str = "bfd"
    """Bin-choice rule of the packer, a name in ``rayjobs.data.pack.STRATEGIES``."""
    warn_lost_share: float = Field(default=0.01, ge=0, le=1)
    """Warn about a dataset when more than this share of its samples has nothing left to train
    (its whole response cut, or a prompt as long as ``seq_len``) or lost most of its tokens to
    truncation; the warning names the setting to change."""

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
        return registered(value, pack.STRATEGIES, "packing strategy")


class TrainConfig(Strict):
    num_workers: int = Field(default=2, ge=0)
    """Ray Train workers (0 runs the loop in the driver process: Ray Train's local mode, which
    rayjobs' loop persists checkpoints for itself; no restarts, no ``--resume``)."""
    use_gpu: bool = False
    cpus_per_worker: float = Field(default=0.5, gt=0)
    """Logical CPUs each train worker reserves; keep it fractional on small CPU clusters so the
    data operators are not starved (docs/training.md, "Resources and CPU vs GPU")."""
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
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """The forward's autocast. bf16: under bf16 autocast (fp32 parameters keep fp32 gradients
    and optimizer state; the loss is computed in fp32); fp16: fp16 autocast with a loss scaler
    (``torch.amp.GradScaler``), CUDA only; auto: bf16 on GPUs that support it, else none."""
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    """The parameters' dtype (torchtune's ``dtype``): bf16 halves the weights' memory and the
    AdamW state's, which torch keeps in the parameters' dtype (docs/training.md, "Precision");
    LoRA adapters stay fp32 on a bf16 base (bf16 under FSDP2, which gathers one dtype)."""
    lora: LoraConfig | None = None
    """LoRA adapters through PEFT (``kind: hf``); null: full fine-tuning."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """ddp: every worker holds the whole model (Ray Train's ``prepare_model``); fsdp: FSDP2
    (``fully_shard`` per transformer block, then the whole model) shards parameters, gradients
    and optimizer state over the workers, for models that do not fit one GPU."""
    max_failures: int = Field(default=3, ge=-1)
    """Worker-group failures (a dead worker or node) to recover from by restarting the workers
    from the latest checkpoint; -1: no limit, 0: none (Ray Train's ``FailureConfig``). A
    rayjobs ``UserError`` in a worker (a bad row, counts that do not add up) is not retried:
    it would fail again (docs/resume.md)."""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """auto: FlexAttention on CUDA, SDPA with the dense document mask on CPU."""
    report_every: int = Field(default=10, gt=0)
    """Steps between reports: ``ray.train.report``, rank 0's progress line and the trackers."""
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(default_factory=list)
    """Experiment trackers rank 0 logs to, each an optional extra (``pip install
    'rayjobs[tensorboard]'``), writing into the run's folder under ``storage_path``
    (docs/tracking.md)."""
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
    checkpoint_every: int | None = Field(default=None, ge=0)
    """Save a checkpoint every this many steps (the summary lists them); null or 0: not by
    steps."""
    checkpoint_every_minutes: float | None = Field(default=30.0, ge=0)
    """Save a checkpoint after the first step, then after the first step that ends this many
    minutes after the last checkpoint (``checkpoint_every`` steps or this, whichever comes
    first), so a lost worker costs minutes, not the run, whatever the run's length; null or 0:
    not by time (docs/resume.md)."""
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

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # report_to: tensorboard, as HF's

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} named more than once")
        return value

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

    @model_validator(mode="after")
    def _choices_fit(self) -> TrainConfig:
        check_training_choices(self)
        return self

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


class DPOConfig(Strict):
    min_prompt_tokens: int = Field(default=64, ge=1)
    """A triple longer than ``seq_len`` keeps at least this many tokens of its prompt (its end,
    where the turn the responses answer is): its responses are cut first, and a triple that
    cannot fit even so is dropped, counted (``dropped_by_reason``)."""
    beta: float = Field(default=0.1, gt=0)
    """The DPO temperature: the implicit reward is ``beta`` × the policy's log-ratio to the
    reference."""
    disable_dropout: bool = True
    """Zero the model's dropout (policy and reference), as TRL's ``disable_dropout`` does by
    default: with dropout in the training policy and none in the eval-mode reference, the
    log-ratios are noise even at equal weights (a GPT-2 config's 0.1 gave a step-0 loss of 0.756,
    not log 2)."""


class EvalConfig(Strict):
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


class Config(Strict):
    template_modules: list[str] = Field(default_factory=list)
    """Python modules that register templates of the user's own (``@register_template``),
    imported by name before the datasets are validated: from the config's folder first, then the
    installed packages (``rayjobs.config.load``). Their templates reach the Tokenize actors with
    the datasets (docs/data.md, "Your own templates")."""
    task: Literal["sft", "dpo"] = "sft"
    """sft: samples packed as documents, token cross entropy; dpo: preference triples (template
    ``preference``) packed as units of three documents, the DPO loss against a frozen reference
    (the initial model)."""
    datasets: list[DatasetConfig] = Field(min_length=1)
    tokenizer: TokenizerConfig
    """The run's tokenizer; may be left out (or given without ``path``) with a pretrained
    ``train.model.path`` (``kind: hf``): the model's own tokenizer, chat template and special
    tokens, as TRL takes them (``_tokenizer_from_model``)."""
    packing: PackingConfig = Field(default_factory=PackingConfig)
    mix: MixConfig = Field(default_factory=MixConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    seed: int = Field(default=0, ge=0)  # numpy's SeedSequence takes no negative entropy
    allow_duplicate_sources: bool = False
    """Let one file be read by two datasets (two training datasets, or an eval dataset and
    another); by default that is refused, naming both (``rayjobs.config.load``)."""

    @model_validator(mode="before")
    @classmethod
    def _tokenizer_from_model(cls, data: Any) -> Any:
        """No ``tokenizer.path``: the pretrained model's folder (or Hub name) is the tokenizer's,
        resolved against the config's folder as the model's path is."""
        if not isinstance(data, dict):
            return data
        tokenizer, train = data.get("tokenizer"), data.get("train")
        model = train.get("model") if isinstance(train, dict) else None
        if tokenizer is not None and (not isinstance(tokenizer, dict) or "path" in tokenizer):
            return data
        if isinstance(model, dict) and model.get("kind") == "hf" and model.get("path"):
            return {**data, "tokenizer": {**(tokenizer or {}), "path": model["path"]}}
        if tokenizer is None:
            raise ValueError(
                "tokenizer: missing; set tokenizer.path, or train.model.path (kind: hf, a "
                "pretrained model) to use the model's own tokenizer"
            )
        return data

    @model_validator(mode="after")
    def _task_fits(self) -> Config:
        for section, specs in (("datasets", self.datasets), ("eval.datasets", self.eval.datasets)):
            preference = [d.name for d in specs if templates.TEMPLATES[d.template].task == "dpo"]
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
