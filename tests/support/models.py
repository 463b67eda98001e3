"""Tiny Hugging Face model configs for tests: real architectures at a size that trains in
milliseconds on a CPU."""

from __future__ import annotations


def tiny_llama(max_position_embeddings: int, **changes) -> dict:
    """A two-layer Llama config (hidden 32, 4 heads over 2 key/value heads) for
    ``build_hf_model(overrides=...)``; ``initializer_range`` 0.2 gives random weights whose
    attention matters (a test that masks documents apart can see a leak)."""
    return {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.2,
        **changes,
    }


def tiny_qwen2(**changes) -> dict:
    """Qwen2.5-Instruct's architecture (Qwen2: biased q/k/v, tied embeddings, 32,768 positions,
    a sliding window it does not use) at ``tiny_llama``'s size, for a local stand-in of the
    Hub model."""
    return {
        **tiny_llama(32768),
        "model_type": "qwen2",
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 32768,
        **changes,
    }


CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML chat template (Qwen's layout) for the tokenizer of ``pretrained_folder``."""


def pretrained_folder(
    folder, tokenizer, architecture: dict, chat_template: str | None = None, seed: int = 0
):
    """A local pretrained Hugging Face model folder, as a Hub download looks: ``architecture``
    (``model_type`` and sizes) at random weights from ``seed``, saved with ``save_pretrained``
    next to the files of the ``tokenizer`` folder (the bundled GPT-2's: its vocabulary and
    special token ids are the model's), with ``chat_template`` added. Returns ``folder``."""
    import json
    import shutil
    from pathlib import Path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, tokenizer = Path(folder), Path(tokenizer)
    settings = json.loads((tokenizer / "tokenizer_config.json").read_text())
    vocab = json.loads((tokenizer / "tokenizer.json").read_text())
    size = len(vocab["model"]["vocab"]) + sum(
        t["id"] not in vocab["model"]["vocab"].values() for t in vocab["added_tokens"]
    )
    eos = vocab["model"]["vocab"].get(settings["eos_token"])
    fields = dict(architecture)
    model_type = fields.pop("model_type")
    ids = {"vocab_size": size, "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": None}
    config = AutoConfig.for_model(model_type, **{**ids, **fields})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for file in tokenizer.iterdir():
        shutil.copyfile(file, folder / file.name)
    if chat_template is not None:
        settings["chat_template"] = chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder
