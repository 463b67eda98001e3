"""LoRA through PEFT: adapters on a Hugging Face causal LM (``train.lora``), the parameter
counts the summary reports, and what a checkpoint of an adapted model holds.

A checkpoint holds the adapters as ``PeftModel.save_pretrained`` writes them
(``adapter_config.json``, ``adapter_model.safetensors``), which ``PeftModel.from_pretrained``
loads on the base model: the pretrained ``train.model.path``, or for a randomly initialised
base, its weights in ``BASE`` beside them (a random base exists nowhere else). On request the
final one also holds ``MERGED``: the adapters merged into the weights, a plain model folder.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from rayjobs.config import LoraConfig

BASE = "base_model"
"""The folder of a checkpoint that holds a randomly initialised base model's weights."""
MERGED = "merged"
"""The folder of the final checkpoint that holds the merged model (``save_merged``)."""


def adapt(model: torch.nn.Module, spec: LoraConfig, fp32_adapters: bool = True) -> PeftModel:
    """``model`` with LoRA adapters (PEFT's ``get_peft_model``): every base parameter frozen,
    the adapters (and ``modules_to_save``) trainable; on a bf16 base the adapters are fp32 (PEFT's
    ``autocast_adapter_dtype``) where ``fp32_adapters``, else the base's dtype (FSDP2 gathers a
    group's parameters in one dtype).

    Raises:
        ValueError: naming ``train.lora`` and what PEFT refused (a target module the model does
            not have, for one).
    """
    try:
        config = PeftLoraConfig(task_type="CAUSAL_LM", **spec.peft())
        return get_peft_model(model, config, autocast_adapter_dtype=fp32_adapters)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"train.lora: {error}") from None


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a ``PackedLM``'s inner model) carries PEFT adapters."""
    return isinstance(model, PeftModel)


def parameter_counts(module: torch.nn.Module) -> dict[str, int]:
    """The summary's ``parameters``: trainable and total elements (each shared tensor, a tied
    embedding, once)."""
    params = list(module.parameters())
    return {
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "total": sum(p.numel() for p in params),
    }


def save_adapted(
    model: PeftModel, directory: str, state_dict: dict[str, Any] | None, merged: bool
) -> list[str]:
    """Write an adapted model's checkpoint into ``directory`` (module docstring): the adapters,
    the base where it was a random init, the merged model where ``merged``. Returns the folders
    written besides ``directory`` that a tokenizer belongs in."""
    model.save_pretrained(directory, state_dict=state_dict)
    folders = []
    if not model.peft_config["default"].base_model_name_or_path:  # a random init
        _whole_copy(model, state_dict).unload().save_pretrained(os.path.join(directory, BASE))
    if merged:
        folders.append(os.path.join(directory, MERGED))
        _whole_copy(model, state_dict).merge_and_unload().save_pretrained(folders[-1])
    return folders


def _whole_copy(model: PeftModel, state_dict: dict[str, Any] | None) -> PeftModel:
    """A copy of ``model`` to unload or merge (both change the model they run on): a deep copy,
    or, for a sharded model (FSDP2, whose ``state_dict`` is the gathered one), the same
    architecture and adapters built whole on the CPU with that state loaded."""
    if state_dict is None:
        return copy.deepcopy(model)
    base = model.get_base_model()
    dtype = next(p.dtype for n, p in model.named_parameters() if "lora_" not in n)
    whole = AutoModelForCausalLM.from_config(base.config, dtype=dtype)
    whole = get_peft_model(whole, copy.deepcopy(model.peft_config["default"]))
    whole.load_state_dict(state_dict)
    return whole
