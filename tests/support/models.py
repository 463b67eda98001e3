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
