"""SentencePiece models (``tokenizer.model``) load without torch and give the ids SentencePiece
itself gives, on real text from the bundled data; unsupported files and missing special tokens are
refused saying what is supported. The models are SentencePiece's own test models (configs/data,
SOURCES.md): a BPE one as a folder, a unigram one as a bare file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import ALPACA, DATA, GPT2, HH_CHAT, SHAKESPEARE, SHAREGPT
from rayjobs.config import ConfigError, TokenizerConfig
from rayjobs.data.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")

MODELS = DATA / "tokenizers" / "sentencepiece"
BPE_FOLDER = MODELS / "botchan_bpe"  # tokenizer.model, no tokenizer.json
UNIGRAM_FILE = MODELS / "botchan_unigram.model"


def _texts() -> list[str]:
    """Real text from the bundled sets: Alpaca's fields, hh-rlhf turns, glaive's ShareGPT turns
    and Shakespeare's paragraphs (newlines, runs of spaces, digits, code, non-ASCII)."""
    alpaca = json.loads(ALPACA.read_text())
    texts = [row[k] for row in alpaca for k in ("instruction", "input", "output") if row[k]]
    chats = [json.loads(line) for line in HH_CHAT.read_text().splitlines()[:150]]
    texts += [turn["content"] for chat in chats for turn in chat["messages"]]
    texts += [turn["value"] for row in json.loads(SHAREGPT.read_text()) for turn in
              row["conversations"]]  # fmt: skip
    texts += SHAKESPEARE.read_text().split("\n\n")[:300]
    return texts


TEXTS = _texts()


@pytest.mark.parametrize("path", [BPE_FOLDER, UNIGRAM_FILE], ids=["bpe_folder", "unigram_file"])
def test_ids_equal_sentencepiece_on_real_text(path):
    """Acceptance: the converted tokenizer's ids are SentencePiece's and transformers' slow
    tokenizer's, text by text. transformers' slow tokenizer is ``SentencePieceBackend``: since
    transformers 5 ``LlamaTokenizer``/``T5Tokenizer`` (and ``AutoTokenizer``, which ignores
    ``use_fast``) are fast tokenizers built by transformers' converters (``SpmConverter``, which
    rayjobs itself uses), so they would check the conversion against itself;
    ``SentencePieceBackend`` is the Python class every remaining slow SentencePiece tokenizer
    derives from (it runs ``sentencepiece`` with transformers' own special-token splitting and
    ``legacy`` handling). It gets the model's
    ``<s>``/``</s>``/``<unk>`` as special tokens, as a Llama ``tokenizer_config.json`` names them,
    and no BOS is added (rayjobs adds none unless asked)."""
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    model = path / "tokenizer.model" if path.is_dir() else path
    reference = spm.SentencePieceProcessor(model_file=str(model))
    slow = SentencePieceBackend(
        vocab_file=str(model), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    assert not slow.is_fast and slow.all_special_ids == [1, 2, 0], "guard: the slow tokenizer"
    ours = Tokenizer(TokenizerConfig(path=str(path)))
    expected = [reference.encode(text) for text in TEXTS]
    assert len(TEXTS) > 1000, "guard: hundreds of real texts"
    assert sum(0 in ids for ids in expected) > 10, "guard: pieces unknown to the model occur"
    assert any("\n" in t for t in TEXTS) and any("  " in t for t in TEXTS), "guard: whitespace"
    got = ours.encode_batch(TEXTS)
    transformers_ids = slow(TEXTS, add_special_tokens=False)["input_ids"]
    mismatched = [
        (text[:60], mine[:12], want[:12], theirs[:12])
        for text, mine, want, theirs in zip(TEXTS, got, expected, transformers_ids)
        if mine != want or mine != theirs
    ]
    assert mismatched == []


def test_the_models_special_tokens_are_eos_bos_and_found_whole_in_text():
    """EOS is the model's ``</s>`` (no ``<|endoftext|>`` default to fail on), BOS is added only
    when asked (SentencePiece adds none), and ``</s>`` written by a chat template is one token;
    the text after it is encoded as SentencePiece encodes a text alone (``legacy``)."""
    reference = spm.SentencePieceProcessor(model_file=str(UNIGRAM_FILE))
    ours = Tokenizer(TokenizerConfig(path=str(UNIGRAM_FILE)))
    assert (ours.eos_id, ours.pad_id, ours.bos_id) == (2, 2, None)
    assert ours.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert ours.encode_batch(["Hi</s>there"]) == [
        reference.encode("Hi") + [2] + reference.encode("there")
    ]
    assert ours.ends_with_eos("Hello.</s>\n")
    assert Tokenizer(TokenizerConfig(path=str(UNIGRAM_FILE), add_bos=True)).bos_id == 1


def test_a_folders_tokenizer_config_sets_bos_legacy_and_names(tmp_path):
    """``add_bos_token`` adds BOS (as transformers' Llama tokenizer), ``legacy: false`` gives the
    text after a special token no dummy prefix, and ``eos_token`` there wins over the model's."""
    shutil.copy(BPE_FOLDER / "tokenizer.model", tmp_path / "tokenizer.model")
    settings = {"add_bos_token": True, "legacy": False, "eos_token": "<s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    ours = Tokenizer(TokenizerConfig(path=str(tmp_path)))
    assert (ours.bos_id, ours.eos_id) == (1, 1)
    model = (BPE_FOLDER / "tokenizer.model").read_bytes()
    reference = spm.SentencePieceProcessor(model_proto=model)
    proto = spm.sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    proto.normalizer_spec.add_dummy_prefix = False
    no_prefix = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    assert no_prefix.encode("there") != reference.encode("there"), "guard: the prefix matters"
    assert ours.encode_batch(["Hi</s>there"]) == [
        reference.encode("Hi") + [2] + no_prefix.encode("there")
    ]


def test_tokenize_actor_with_a_sentencepiece_model_never_imports_torch():
    code = f"""
import json, sys
from rayjobs.config import DatasetConfig, TokenizerConfig
from rayjobs.data.sources import record_table
from rayjobs.data.tokenize import Tokenize
spec = DatasetConfig(name="d", source="unused", template="alpaca")
tokenize = Tokenize([spec], TokenizerConfig(path={str(BPE_FOLDER)!r}), 256, "truncate")
record = {{"instruction": "Say hi.", "output": "Hi!"}}
table = tokenize(record_table("d", ["x"], [1], [json.dumps(record)]))
assert table.num_rows == 1 and table.column("input_ids").to_pylist()[0][-1] == 2, table
assert "torch" not in sys.modules, "torch was imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def _tiktoken(path):
    path.write_text("IQ== 0\nIg== 1\nIw== 2\n")


def _text(path):
    path.write_text("these are not tokenizer files\n")


def _word_model(path):
    proto = spm.sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(UNIGRAM_FILE.read_bytes())
    proto.trainer_spec.model_type = 3  # WORD
    path.write_bytes(proto.SerializeToString())


UNSUPPORTED = {
    "tiktoken_file": (_tiktoken, "tokenizer.model", "is a tiktoken BPE file"),
    "tiktoken_in_a_folder": (_tiktoken, "dir/tokenizer.model", "is a tiktoken BPE file"),
    "text_file": (_text, "vocab.txt", "is neither a tokenizer.json nor a SentencePiece model"),
    "word_model": (_word_model, "word.model", "is a SentencePiece word model"),
}


@pytest.mark.parametrize(("write", "name", "said"), UNSUPPORTED.values(), ids=UNSUPPORTED)
def test_an_unsupported_tokenizer_file_says_what_is_and_what_is_supported(
    tmp_path, write, name, said
):
    file = tmp_path / name
    file.parent.mkdir(exist_ok=True)
    write(file)
    path = file.parent if name.startswith("dir/") else file
    with pytest.raises(ConfigError) as caught:
        Tokenizer(TokenizerConfig(path=str(path)))
    message = str(caught.value)
    assert message.startswith("tokenizer.path: ") and said in message
    assert "unigram" in message and "BPE" in message  # what is supported


def test_a_missing_eos_default_lists_the_special_tokens(tmp_path):
    """A tokenizer.json that names no EOS (a bare file has no settings) and has no
    ``<|endoftext|>``: the message says the default was not found, lists the tokenizer's special
    tokens and names the key to set."""
    file = tmp_path / "tokenizer.json"
    Tokenizer(TokenizerConfig(path=str(UNIGRAM_FILE))).backend.save(str(file))
    with pytest.raises(ConfigError) as caught:
        Tokenizer(TokenizerConfig(path=str(file)))
    assert str(caught.value) == (
        "tokenizer.eos_token: the tokenizer names no eos_token, and the default '<|endoftext|>' "
        "is not in its vocabulary; set tokenizer.eos_token to one of its special tokens: "
        "'<unk>', '<s>', '</s>'"
    )
    assert Tokenizer(TokenizerConfig(path=str(file), eos_token="</s>")).eos_id == 2
    with pytest.raises(ConfigError, match="token 'nope' is not in the vocabulary; set tokeniz"):
        Tokenizer(TokenizerConfig(path=str(GPT2), eos_token="nope"))
