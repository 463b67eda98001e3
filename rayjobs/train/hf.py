"""Hugging Face causal LMs on packed rows: reading and building the model, and the document mask
each of its attention layers needs (sliding-window layers get a windowed one)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from rayjobs.train import masks

logger = logging.getLogger(__name__)

ATTENTION_LAYERS = ("full_attention", "sliding_attention")
"""The kinds of attention layer (``config.layer_types``) whose document masks rayjobs builds."""


def attention_layers(config: Any) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding window, layer kinds) of a Hugging Face text config: the window is None when no
    layer slides; the kinds are None for models that read one mask for every layer (Mistral,
    Phi-3: all layers slide when ``sliding_window`` is set), else the kinds in
    ``config.layer_types`` (Gemma 2/3, Qwen2/3...), whose forward takes a mask per kind.

    Raises:
        ValueError: for a kind of layer other than full or sliding-window attention (chunked,
            linear or convolutional layers would mix the documents of a packed row).
    """
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return window, None
    kinds = tuple(dict.fromkeys(kinds))
    unknown = [kind for kind in kinds if kind not in ATTENTION_LAYERS]
    if unknown:
        raise ValueError(
            f"layer types {unknown}: rayjobs builds document masks for "
            f"{' and '.join(ATTENTION_LAYERS)} layers only"
        )
    return (window if "sliding_attention" in kinds else None), kinds


def hf_model_mask(
    config: Any,
    document_ids: torch.Tensor,
    position_ids: torch.Tensor,
    implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
    parent_ids: torch.Tensor | None = None,
) -> Any:
    """The ``attention_mask`` a Hugging Face model with ``config`` takes for packed rows: one
    document mask (``masks.hf_attention_mask``) when every layer sees the same, windowed when all
    layers slide, and ``{"full_attention": ..., "sliding_attention": ...}`` for models with both
    kinds of layer (their forward takes a mask per kind of layer as it is). transformers would
    take a single 4-D mask for every layer as it is, so without this the sliding layers of a
    packed row attended to the whole document. A window of at least the row's length changes
    nothing and is left out. ``implementation``: default ``config._attn_implementation``."""
    implementation = implementation or config._attn_implementation
    window, kinds = attention_layers(config)
    if window is not None and window >= document_ids.shape[1]:
        window = None

    def mask(sliding: bool) -> Any:
        return masks.hf_attention_mask(
            document_ids, implementation, dtype, parent_ids, position_ids,
            window if sliding else None,
        )  # fmt: skip

    if kinds is None or window is None:
        return mask(window is not None)
    return {kind: mask(kind == "sliding_attention") for kind in kinds}


def _refuse_unknown_overrides(config: Any, overrides: dict[str, Any], unused: dict) -> None:
    """Refuse ``train.model.config`` keys the model does not read. transformers drops them
    silently: ``from_pretrained`` returns them unused (in transformers 5 a legacy key such as
    ``rope_theta`` too: it moved into ``rope_parameters``), ``for_model`` stores them as attributes
    no layer reads (a typo such as ``num_hiden_layers`` would train the default architecture). A
    key that is not among the config class's defaults but that the model's code names (Qwen2 and
    Phi-3 read an optional ``head_dim``) is kept."""
    import inspect
    import re
    import sys

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        known = type(config)().to_dict()
    except Exception:  # noqa: BLE001 - no defaults (e.g. Gemma4Assistant's strict dataclass):
        # then only what transformers left unused is refused
        known = config.to_dict()
    stored = config.to_dict()
    try:  # the causal LM class's module: the code that reads the config
        source = inspect.getsource(
            sys.modules[MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__module__]
        )
    except (KeyError, OSError, TypeError):  # no such class here: its loading will say so
        source = ""
    unknown = sorted(
        key
        for key in overrides
        if key != "model_type"
        and key not in getattr(config, "attribute_map", {})
        and (
            key in unused
            or (key not in known and key in stored and not re.search(rf"\b{key}\b", source))
        )
    )
    if unknown:
        raise ValueError(
            f"train.model.config: {', '.join(unknown)} not a setting of {type(config).__name__} "
            f"here (transformers ignores such keys); see its documented fields"
        )


def hf_config(
    *,
    vocab_size: int,
    path: str | None = None,
    config_path: str | None = None,
    overrides: dict[str, Any] | None = None,
    local_files_only: bool = True,
    token_ids: dict[str, int] | None = None,
) -> Any:
    """The ``PretrainedConfig`` :func:`build_hf_model` builds its model from (see there), read
    without any weights: cheap enough for the driver to check a config before Ray starts.

    Raises:
        ValueError: an unknown ``model_type``, a config file that cannot be read, a value of the
            wrong type, or an override the model does not read.
    """
    from transformers import AutoConfig

    overrides = dict(overrides or {})
    try:
        if path is not None:
            config, unused = AutoConfig.from_pretrained(
                path, local_files_only=local_files_only, return_unused_kwargs=True, **overrides
            )
        else:
            settings = {"vocab_size": vocab_size, **(token_ids or {}), **overrides}
            if config_path is not None:
                config, unused = AutoConfig.from_pretrained(
                    config_path, return_unused_kwargs=True, **settings
                )
            else:
                config, unused = AutoConfig.for_model(settings.pop("model_type"), **settings), {}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{error}"[:400]) from None  # transformers lists every model_type
    except Exception as error:  # huggingface_hub's strict dataclasses: a value of the wrong type
        if "StrictDataclass" not in type(error).__name__:
            raise
        raise ValueError(" ".join(str(error).split())) from None
    _refuse_unknown_overrides(config, overrides, unused)
    return config


def supports_flex(config: Any) -> bool:
    """Whether transformers' causal-LM class for ``config`` runs ``flex_attention`` (its
    ``_supports_flex_attn``; an architecture the mapping does not know is left to transformers)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return True
    return bool(getattr(model_class, "_supports_flex_attn", False))


def build_hf_model(
    *,
    vocab_size: int,
    seq_len: int,
    path: str | None = None,
    config_path: str | None = None,
    overrides: dict[str, Any] | None = None,
    attn_implementation: str = "sdpa",
    local_files_only: bool = True,
    token_ids: dict[str, int] | None = None,
    flex_fallback: str | None = None,
) -> nn.Module:
    """A Hugging Face causal LM in fp32, in train mode.

    - ``path``: pretrained weights, ``AutoModelForCausalLM.from_pretrained(path)`` (a local
      checkpoint directory, or a Hub name found in the local cache unless ``local_files_only`` is
      False); ``overrides`` update its config.
    - otherwise an architecture, randomly initialised from the current torch seed: the config from
      ``config_path`` (a config.json or its folder) or ``AutoConfig.for_model(overrides
      ["model_type"], ...)``, with ``overrides`` applied. ``vocab_size`` and ``token_ids``
      (``bos_token_id``, ``eos_token_id``, ``pad_token_id``: the tokenizer's) fill what the
      overrides do not set.

    ``flex_fallback``: the backend to build with instead of ``flex_attention`` where the
    architecture's transformers class has no flex support (GPT-2, for one): for a default
    choice, not a user's explicit one (which transformers then refuses, naming the class).

    Raises:
        ValueError: if the model has fewer token embeddings than ``vocab_size`` or fewer positions
            than ``seq_len``, or does not know ``model_type``.
    """
    from transformers import AutoModelForCausalLM

    common = {"attn_implementation": attn_implementation, "dtype": torch.float32}
    config = hf_config(
        vocab_size=vocab_size,
        path=path,
        config_path=config_path,
        overrides=overrides,
        local_files_only=local_files_only,
        token_ids=token_ids,
    )  # before loading any weights
    if attn_implementation == "flex_attention" and flex_fallback and not supports_flex(config):
        logger.warning(
            "%s has no flex_attention in transformers: training with %s and the dense "
            "document mask",
            config.model_type,
            flex_fallback,
        )
        attn_implementation = common["attn_implementation"] = flex_fallback
    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(
            path, config=config, local_files_only=local_files_only, **common
        )
    else:
        model = AutoModelForCausalLM.from_config(config, **common)
    model.train()
    embeddings = model.get_input_embeddings().num_embeddings
    if embeddings < vocab_size:
        raise ValueError(
            f"the model has {embeddings} token embeddings but the tokenizer {vocab_size} token ids"
        )
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if positions is not None and positions < seq_len:
        raise ValueError(
            f"max_position_embeddings ({positions}) is below packing.seq_len ({seq_len})"
        )
    return model
