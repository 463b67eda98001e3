"""SentencePiece models (``tokenizer.model``) as ``tokenizers`` tokenizers, without torch.

The model's protobuf is read with transformers' own schema (``import_protobuf``: the
``sentencepiece`` package's when it is installed, else ``protobuf``'s, a dependency of Ray) and
converted by transformers' ``SpmConverter.build_tokenizer_from_spm_proto``, which follows the
model's own normalizer, dummy prefix and piece scores, so plain text encodes to the ids
``SentencePieceProcessor.encode`` gives. Its control pieces (``<s>``, ``</s>``) and unknown piece
become special tokens, found whole in a chat template's text as transformers' tokenizers find
them; the text between two of them is encoded as SentencePiece encodes a text alone (``legacy``,
the slow tokenizers' default) unless the folder's ``tokenizer_config.json`` says ``legacy:
false``. Unigram and BPE models are converted; word and character models are not.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rayjobs.errors import ConfigError

MODEL_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
"""The names a SentencePiece model has in a tokenizer folder (Llama, Mistral, Gemma; T5;
XLM-R)."""

MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
"""SentencePiece's ``TrainerSpec.ModelType``."""

TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+\r?$")
"""A line of a tiktoken BPE file (Llama 3's original ``tokenizer.model``): base64 and a rank."""


def read_model(file: Path) -> Any | None:
    """The SentencePiece ``ModelProto`` in ``file``, or None when it holds none (not protobuf,
    or no pieces)."""
    from google.protobuf.message import DecodeError
    from transformers.convert_slow_tokenizer import import_protobuf

    proto = import_protobuf().ModelProto()
    try:
        proto.ParseFromString(file.read_bytes())
    except (DecodeError, ValueError):
        return None
    return proto if len(proto.pieces) else None


def unsupported(file: Path) -> ConfigError:
    """Why ``file`` (not JSON, no SentencePiece model) cannot be loaded, and what can."""
    with file.open("rb") as handle:
        head = handle.readline()[:200]
    what = (
        "a tiktoken BPE file, which rayjobs does not read"
        if TIKTOKEN_LINE.match(head.rstrip(b"\n"))
        else "neither a tokenizer.json nor a SentencePiece model"
    )
    return ConfigError(
        f"tokenizer.path: {file} is {what}; supported: a tokenizer.json file, a SentencePiece "
        f"model ({', '.join(MODEL_FILES)}, unigram or BPE), a folder holding one of them (and its "
        "tokenizer_config.json), or a Hugging Face tokenizer name"
    )


def load(file: Path, proto: Any, settings: dict[str, Any]) -> tuple[Any, dict[str, str | None]]:
    """The model ``proto`` (read from ``file``) as a ``tokenizers.Tokenizer``, and its special
    tokens by name (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``: the pieces its
    trainer spec names). ``settings``: the folder's ``tokenizer_config.json`` (``legacy``,
    ``add_bos_token``), empty for a bare file.

    Raises:
        ConfigError: a word or character model.
    """
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SpmConverter

    spec = proto.trainer_spec
    kind = MODEL_TYPES.get(spec.model_type, str(spec.model_type))
    if kind not in ("unigram", "bpe"):
        raise ConfigError(
            f"tokenizer.path: {file} is a SentencePiece {kind} model; rayjobs converts unigram "
            "and BPE models only (those of Llama, Mistral, Gemma, T5)"
        )
    pieces = [piece.piece for piece in proto.pieces]
    if kind == "unigram":
        vocab: Any = [(piece.piece, piece.score) for piece in proto.pieces]
    else:
        vocab = {piece: index for index, piece in enumerate(pieces)}
    legacy = settings.get("legacy") is not False  # unset or null: transformers' slow default
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=legacy)
    # Control and unknown pieces (types 3 and 2) are found whole in text, as special tokens.
    backend.add_special_tokens(
        [
            AddedToken(piece.piece, special=True, normalized=False)
            for piece in proto.pieces
            if piece.type in (2, 3)
        ]
    )
    ids = {"bos_token": spec.bos_id, "eos_token": spec.eos_id, "unk_token": spec.unk_id,
           "pad_token": spec.pad_id}  # fmt: skip
    special = {key: pieces[i] if 0 <= i < len(pieces) else None for key, i in ids.items()}
    bos = special["bos_token"]
    if settings.get("add_bos_token") and bos is not None:  # as transformers' Llama tokenizer
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos_token"])]
        )
    return backend, special
