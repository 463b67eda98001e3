"""A pretrained Hugging Face model folder as ``train.model.path``: its own tokenizer when the
config names none, and a tokenizer or ``packing.seq_len`` that does not fit it refused by
``validate`` before Ray starts, naming both values and the keys to change."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from conftest import ALPACA, DEMO_TOKENIZER, GPT2, ROOT
from rayjobs.cli import main
from rayjobs.config import load_config
from rayjobs.data.tokenizer import Tokenizer
from support.models import CHATML, pretrained_folder, tiny_llama, tiny_qwen2


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama with the GPT-2 tokenizer's files and a ChatML template, 1,024 positions."""
    return pretrained_folder(tmp_path_factory.mktemp("llama"), GPT2, tiny_llama(1024), CHATML)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A tiny Llama whose own tokenizer is the demo's 4,096-token BPE."""
    tokenizer = tmp_path_factory.mktemp("demo_tokenizer")
    shutil.copyfile(DEMO_TOKENIZER["path"], tokenizer / "tokenizer.json")
    settings = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(settings))
    return pretrained_folder(tmp_path_factory.mktemp("small"), tokenizer, tiny_llama(1024))


def _config(tmp_path, model: str, tokenizer: dict | None, seq_len: int = 256) -> str:
    config = {
        "datasets": [{"name": "alpaca", "source": str(ALPACA), "template": "alpaca"}],
        "packing": {"seq_len": seq_len},
        "train": {"model": {"kind": "hf", "path": model}},
    }
    if tokenizer is not None:
        config["tokenizer"] = tokenizer
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_without_a_tokenizer_section_the_models_own_is_used(tmp_path, llama, capsys):
    """Acceptance 1: no tokenizer section: the model folder's tokenizer, its chat template and
    special tokens included; validate says so and exits 0."""
    path = _config(tmp_path, str(llama), None)
    config = load_config(path)
    assert config.tokenizer.path == str(llama)
    tokenizer = Tokenizer(config.tokenizer)
    assert tokenizer.chat_template == CHATML and tokenizer.eos_id == 50256
    # a tokenizer section without path keeps its settings, the path still the model's
    chosen = load_config(_config(tmp_path, str(llama), {"add_bos": False}))
    assert chosen.tokenizer.path == str(llama) and chosen.tokenizer.add_bos is False
    assert main(["validate", path, "--rows", "4"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "model: kind hf, llama from " in out and "tokenizer: the model's own" in out
    assert "vocab_size 50257, max_position_embeddings 1024" in out


def test_no_tokenizer_and_no_pretrained_model_is_refused(tmp_path, capsys):
    config = {"datasets": [{"name": "a", "source": str(ALPACA), "template": "alpaca"}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["validate", str(tmp_path / "c.yaml")]) == 2
    assert "tokenizer: missing; set tokenizer.path, or train.model.path" in capsys.readouterr().err


# model, tokenizer section, seq_len → the refusal's fragments (every one names both values)
REFUSED = {
    "tokenizer_larger_than_the_model": (
        "small_vocab",
        {"path": str(GPT2)},
        256,
        ["tokenizer.path: the tokenizer has 50257 token ids but train.model", "embeds 4096"],
    ),
    "seq_len_above_the_positions": (
        "llama",
        None,
        2048,
        ["packing.seq_len (2048) is above train.model", "max_position_embeddings (1024)"],
    ),
    "another_familys_eos": (
        "llama",
        {"path": DEMO_TOKENIZER["path"], "pad_token": "<|pad|>"},
        256,
        ["tokenizer.eos_token: the tokenizer's eos id is 0 but train.model", "is 50256"],
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_tokenizer_or_seq_len_that_does_not_fit_the_model_is_refused(
    tmp_path, case, llama, small_vocab, capsys
):
    """Acceptance 1: exit 2 before Ray starts, both numbers and the keys to change named."""
    model, tokenizer, seq_len, fragments = REFUSED[case]
    folder = {"llama": llama, "small_vocab": small_vocab}[model]
    assert main(["validate", _config(tmp_path, str(folder), tokenizer, seq_len)]) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, err


def test_a_chosen_eos_token_is_a_warning_not_an_error(tmp_path, llama, capsys):
    """A tokenizer whose eos differs from the model's, where the config names the eos itself
    (a base model fine-tuned to end its turns with another token): validated, with a warning."""
    tokenizer = {**DEMO_TOKENIZER, "eos_token": "<|pad|>"}
    assert main(["validate", _config(tmp_path, str(llama), tokenizer)]) == 0
    warned = capsys.readouterr().err
    assert "rayjobs: warning: tokenizer.eos_token: the tokenizer's eos id is 3 but" in warned
    assert "(tokenizer.eos_token: '<|pad|>' chosen)" in warned


QWEN_EXAMPLE = ROOT / "configs" / "qwen2_5_0_5b_lora.yaml"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A local stand-in for Qwen/Qwen2.5-0.5B-Instruct (no Qwen tokenizer offline): its
    architecture at tiny sizes, random weights, the GPT-2 tokenizer's files with a ChatML
    template."""
    return pretrained_folder(tmp_path_factory.mktemp("qwen"), GPT2, tiny_qwen2(), CHATML)


def test_the_pretrained_example_validates_against_a_local_folder(qwen, capsys):
    """configs/qwen2_5_0_5b_lora.yaml names the Hub model (and so its tokenizer), LoRA, bf16 and
    GPUs; offline, ``validate`` checks it with ``train.model.path`` overridden to a folder of the
    same architecture: the model's own tokenizer and chat template, seq_len within its
    positions."""
    config = load_config(QWEN_EXAMPLE)
    assert config.train.model.path == config.tokenizer.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert config.train.lora.target_modules == "all-linear" and config.train.use_gpu
    assert config.train.param_dtype == "bf16"
    override = f"train.model.path={qwen}"
    assert main(["validate", str(QWEN_EXAMPLE), override, "--rows", "4"]) == 0
    out = capsys.readouterr().out
    assert f"model: kind hf, qwen2 from {qwen}, vocab_size 50257" in out
    assert "tokenizer: the model's own" in out
    assert Tokenizer(load_config(QWEN_EXAMPLE, [override]).tokenizer).chat_template == CHATML
