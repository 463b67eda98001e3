"""Hugging Face causal LMs on packed rows (``rayjobs.train.model.PackedLM``, ``build_hf_model``):
the document mask reaches each attention backend, the chunked loss equals the full one at a fraction
of its memory (a 2-worker run of configs/tiny_llama.yaml and its checkpoints: ``test_prometheus``).

Fidelity rows are real: Alpaca samples from configs/data through the job's own template and
tokenization, with the real GPT-2 tokenizer, assembled by ``rows.assemble`` as the packer does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ALPACA, GPT2, ROOT
from rayjobs.config import TokenizerConfig
from rayjobs.data import templates
from rayjobs.data.rows import IGNORE_INDEX, assemble
from rayjobs.data.samples import encode_segments
from rayjobs.data.tokenizer import Tokenizer
from rayjobs.train.hf import build_hf_model
from rayjobs.train.model import Decoder, DecoderConfig, PackedLM, chunked_loss_sum
from support.models import tiny_llama

ARCHITECTURES = {
    "llama": tiny_llama(512),  # initializer_range 0.2: attention matters (the guard below)
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 512,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.2,
    },
}
SEQ_LEN = 320


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(TokenizerConfig(path=str(GPT2)))


@pytest.fixture(scope="module")
def documents(tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) of the first short Alpaca samples, tokenized as the job does (prompt
    untrained, EOS appended, labels shifted per sample)."""
    out = []
    for record in json.loads(ALPACA.read_text()):
        segments = templates.alpaca(record, {})
        ((ids, starts),) = tokenizer.encode_with_starts(["".join(s.text for s in segments)])
        input_ids, labels = encode_segments(segments, ids, starts, tokenizer.eos_id, False)
        if len(input_ids) <= 90:
            out.append((input_ids, labels))
        if len(out) == 4:
            return out
    raise AssertionError("guard: the bundled Alpaca subset has 4 samples of at most 90 tokens")


def _rows(documents: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> dict:
    """One packed row of ``documents`` (padding after them), as torch int64 [1, seq_len]."""
    lengths = np.array([len(ids) for ids, _ in documents])
    row = assemble(
        [ids for ids, _ in documents],
        [labels for _, labels in documents],
        starts=np.cumsum(lengths) - lengths,
        document_lengths=lengths,
        documents_per_row=np.array([len(documents)]),
        seq_len=seq_len,
        pad_id=pad_id,
    )
    return {
        key: torch.from_numpy(row[key]).long()
        for key in ("input_ids", "labels", "position_ids", "document_ids")
    }


def _loss_and_grads(model: PackedLM, rows: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Token-weighted mean loss over ``rows`` (each run on its own) and its parameter gradients."""
    model.zero_grad(set_to_none=True)
    results = [
        model(r["input_ids"], r["position_ids"], r["document_ids"], r["labels"]) for r in rows
    ]
    count = sum(int(c) for _, c in results)
    loss = sum(total for total, _ in results) / count
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


@pytest.fixture(scope="module")
def hf_models(tokenizer) -> dict[str, PackedLM]:
    """Tiny random Llama and GPT-2 at the GPT-2 vocabulary, fp32, eval mode (no dropout); tests
    switch their attention backend with ``set_attn_implementation``."""
    models = {}
    for name, overrides in ARCHITECTURES.items():
        torch.manual_seed(0)
        model = build_hf_model(
            vocab_size=tokenizer.vocab_size,
            seq_len=SEQ_LEN,
            overrides=overrides,
            attn_implementation="sdpa",
            token_ids={"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id},
        )
        models[name] = PackedLM(model, loss_chunk_tokens=64).eval()
    return models


def _with_attention(models: dict[str, PackedLM], architecture: str, attention: str) -> PackedLM:
    model = models[architecture]
    model.model.set_attn_implementation(attention)
    assert model.attention == attention
    return model


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_packed_row_trains_like_its_documents_alone(
    hf_models, documents, tokenizer, architecture, attention
):
    """Acceptance 1: loss within 1e-5 and every parameter gradient within 1e-4 of the documents
    run one by one; and without the document mask (one causal mask over the row, positions still
    restarting) the loss differs, so this test can fail."""
    model = _with_attention(hf_models, architecture, attention)
    packed = _rows(documents, SEQ_LEN, tokenizer.pad_id)
    num_documents = int(packed["document_ids"].max())  # padding is one more document
    assert num_documents >= 3 and int((packed["labels"] != IGNORE_INDEX).sum()) > 0  # guards
    assert int(packed["document_ids"][0, -1]) == num_documents  # guard: padding present
    alone = [_rows([document], len(document[0]), tokenizer.pad_id) for document in documents]

    packed_loss, packed_grads = _loss_and_grads(model, [packed])
    alone_loss, alone_grads = _loss_and_grads(model, alone)
    assert abs(packed_loss - alone_loss) <= 1e-5, (packed_loss, alone_loss)
    assert packed_grads.keys() == alone_grads.keys() and len(packed_grads) > 10
    worst = max(float((packed_grads[n] - alone_grads[n]).abs().max()) for n in packed_grads)
    assert worst <= 1e-4, worst

    causal = {**packed, "document_ids": torch.zeros_like(packed["document_ids"])}
    causal_loss, causal_grads = _loss_and_grads(model, [causal])
    assert abs(causal_loss - packed_loss) > 1e-3, (causal_loss, packed_loss)
    assert max(float((causal_grads[n] - packed_grads[n]).abs().max()) for n in packed_grads) > 1e-2


def test_sdpa_and_eager_agree(hf_models, documents, tokenizer):
    """The boolean mask (sdpa) and the additive mask (eager) give the same logits, padding rows
    included (no NaN where a padding query attends only to padding)."""
    row = _rows(documents[:3], SEQ_LEN, tokenizer.pad_id)
    inputs = row["input_ids"], row["position_ids"], row["document_ids"]
    for architecture in ARCHITECTURES:
        with torch.no_grad():
            sdpa = _with_attention(hf_models, architecture, "sdpa").logits(*inputs)
            eager = _with_attention(hf_models, architecture, "eager").logits(*inputs)
        assert torch.isfinite(sdpa).all() and torch.isfinite(eager).all()
        torch.testing.assert_close(sdpa, eager, atol=1e-4, rtol=0)


def test_head_matches_the_models_own_forward(hf_models):
    """``PackedLM.head`` reproduces the model's logits (``check_head`` raises otherwise), and a
    logit transformation it does not know is caught."""
    model = _with_attention(hf_models, "gpt2", "sdpa")
    assert model.check_head() <= 1e-5
    model._softcap = 1.0  # pretend the architecture soft-caps while its forward does not
    try:
        with pytest.raises(ValueError, match="differ from the model's own"):
            model.check_head()
    finally:
        model._softcap = None


# ---------------------------------------------------------------- chunked cross entropy


def _batch(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two rows of 3 documents and padding, some prompt positions unlabelled."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [[30, 20, 25], [10, 40, 24]]
    rows = []
    for row_lengths in lengths:
        documents = []
        for length in row_lengths:
            ids = torch.randint(0, vocab_size, (length,), generator=generator)
            labels = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])
            labels[: length // 3] = IGNORE_INDEX  # a prompt
            documents.append((ids.numpy().astype(np.int32), labels.numpy().astype(np.int32)))
        rows.append(_rows(documents, 80, pad_id=0))
    return {key: torch.cat([row[key] for row in rows]) for key in rows[0]}


def _demo() -> PackedLM:
    torch.manual_seed(0)
    return PackedLM(Decoder(DecoderConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4)))


@pytest.mark.parametrize("which", ["demo", "llama"])
def test_chunked_loss_equals_full_loss(hf_models, which):
    """Loss and gradients within 1e-5 of the full-logits loss (acceptance 5), with chunks that do
    not divide the labelled positions (a short last chunk)."""
    model = _demo() if which == "demo" else _with_attention(hf_models, "llama", "sdpa")
    batch = _batch(vocab_size=300)
    inputs = batch["input_ids"], batch["position_ids"], batch["document_ids"], batch["labels"]
    labelled = int((batch["labels"] != IGNORE_INDEX).sum())
    assert labelled % 17 and labelled > 3 * 17  # guard: several chunks, the last one short
    results = {}
    for chunk in (0, 17):
        model.loss_chunk_tokens = chunk
        model.zero_grad(set_to_none=True)
        total, count = model(*inputs)
        (total / count).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[chunk] = float(total.detach() / count), int(count), grads
    model.loss_chunk_tokens = 64
    (full, full_count, full_grads), (chunked, chunked_count, chunked_grads) = results.values()
    assert full_count == chunked_count == labelled
    # A loss near 11 has an fp32 spacing of 9.5e-7: summing per chunk moves the last bits (a
    # 2-ulp difference on one CPU, none on another), hence not 1e-6.
    assert abs(full - chunked) <= 1e-5, (full, chunked)
    assert full_grads.keys() == chunked_grads.keys()
    for name in full_grads:
        torch.testing.assert_close(chunked_grads[name], full_grads[name], atol=1e-5, rtol=0)


def test_chunked_loss_without_labels_still_reaches_the_head():
    """A batch with no labelled position: loss 0, count 0, and the head still gets a (zero)
    gradient, so DDP sees every parameter used."""
    head = torch.nn.Linear(8, 11)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    total, count = chunked_loss_sum(hidden, head, torch.full((2, 5), IGNORE_INDEX), chunk_tokens=3)
    total.backward()
    assert int(count) == 0 and float(total) == 0.0
    assert head.weight.grad is not None and not head.weight.grad.any()
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_loss_sum(hidden, head, torch.zeros(2, 5, dtype=torch.long), chunk_tokens=0)


MEMORY_SCRIPT = """
import resource, sys, torch
torch.set_num_threads(1)
from rayjobs.train.model import Decoder, DecoderConfig, PackedLM
torch.manual_seed(0)
decoder = Decoder(DecoderConfig(vocab_size=50257, dim=64, n_layers=2, n_heads=4))
model = PackedLM(decoder, "sdpa", loss_chunk_tokens=int(sys.argv[1]))
batch, seq_len = 4, 2048
input_ids = torch.randint(0, 50257, (batch, seq_len))
labels = input_ids.roll(-1, 1)
labels[:, 511::512] = -100  # 4 documents of 512 tokens a row, each one's last unlabelled
document_ids = (torch.arange(seq_len) // 512).expand(batch, seq_len).contiguous()
position_ids = (torch.arange(seq_len) % 512).expand(batch, seq_len).contiguous()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
total, count = model(input_ids, position_ids, document_ids, labels)
(total / count).backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before, peak, float(total.detach() / count))
"""


@pytest.mark.e2e
def test_chunked_loss_halves_peak_memory():
    """Acceptance 5: one forward + backward of the demo decoder at the GPT-2 vocabulary (50257),
    seq_len 2048 × batch 4, every position but each document's last labelled: the peak RSS of a
    process with the chunked loss (1024 tokens a chunk) is at most half that with full logits
    (measured here: 1.18 GiB against 5.10 GiB), with the same loss. Each variant runs in its
    own process, both at once, one torch thread each."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    processes = {
        chunk: subprocess.Popen(
            [sys.executable, "-c", MEMORY_SCRIPT, str(chunk)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for chunk in (0, 1024)
    }
    results = {}
    for chunk, process in processes.items():
        out, err = process.communicate(timeout=900)
        assert process.returncode == 0, err[-2000:]
        before, peak, loss = out.split()
        results[chunk] = int(before) / 1024, int(peak) / 1024, float(loss)  # MiB (Linux: KiB)
    (full_before, full_peak, full_loss), (_, chunked_peak, chunked_loss) = results.values()
    # guard: the full-logits process held the [4, 2048, 50257] fp32 logits (1.5 GiB) and more;
    # how many copies the allocator keeps resident at once varies between runs (2.8-3.5 GiB seen)
    assert full_peak - full_before > 1.5 * 1536, results
    assert chunked_peak <= full_peak / 2, results
    assert abs(chunked_loss - full_loss) <= 1e-5, results


def test_build_refuses_a_model_too_small_for_the_tokenizer_or_seq_len():
    tiny = {**ARCHITECTURES["llama"], "vocab_size": 100, "max_position_embeddings": 64}
    with pytest.raises(ValueError, match="100 token embeddings but the tokenizer 200"):
        build_hf_model(vocab_size=200, seq_len=64, overrides=tiny)
    with pytest.raises(ValueError, match=r"max_position_embeddings \(64\) is below .*\(128\)"):
        build_hf_model(vocab_size=100, seq_len=128, overrides=tiny)


@pytest.mark.parametrize("source", ["architecture", "config_path", "path"])
def test_config_overrides_apply_or_are_refused_naming_the_key(tmp_path, source):
    """``train.model.config`` keys on each way of building: a real setting takes effect; a typo
    is refused by name instead of being dropped (which ``from_pretrained`` does silently) or
    stored where no layer reads it (``for_model``). The legacy ``rope_theta`` (in
    ``rope_parameters`` since transformers 5): ``for_model`` converts it, ``from_pretrained``
    drops it, so there it is refused (set ``rope_parameters``)."""
    tiny = dict(ARCHITECTURES["llama"])
    kwargs = {"vocab_size": 100, "seq_len": 64}
    if source != "architecture":
        built = build_hf_model(**kwargs, overrides=tiny)
        (built.save_pretrained if source == "path" else built.config.save_pretrained)(tmp_path)
        kwargs[source] = str(tmp_path)
        tiny = {}
    model = build_hf_model(**kwargs, overrides={**tiny, "num_hidden_layers": 1})
    assert model.config.num_hidden_layers == 1 == len(model.model.layers)  # applied
    if source == "architecture":
        model = build_hf_model(**kwargs, overrides={**tiny, "rope_theta": 1e6})
        assert model.config.rope_parameters["rope_theta"] == 1e6
        # not among Qwen2Config's defaults, but its attention reads it: kept
        qwen2 = build_hf_model(**kwargs, overrides={**tiny, "model_type": "qwen2", "head_dim": 4})
        assert (
            qwen2.model.layers[0].self_attn.q_proj.out_features == 4 * tiny["num_attention_heads"]
        )
    for bad in (
        {"num_hiden_layers": 1},
        *([{"rope_theta": 1e6}] if source != "architecture" else []),
    ):
        with pytest.raises(ValueError, match=f"train.model.config: {next(iter(bad))} not a"):
            build_hf_model(**kwargs, overrides={**tiny, **bad})


SLIDING = {  # window 16 < documents of 40-90 tokens
    "mistral": ({"model_type": "mistral", "sliding_window": 16, "head_dim": 8}, None),
    "qwen2": (  # layer 0 full, layer 1 sliding: a mask per kind of layer
        {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1,
         "sliding_window": 16},
        ("full_attention", "sliding_attention"),
    ),
    "gemma3_text": (
        {"model_type": "gemma3_text", "sliding_window": 16, "head_dim": 8,
         "query_pre_attn_scalar": 8, "layer_types": ["sliding_attention", "full_attention"]},
        ("sliding_attention", "full_attention"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("architecture", sorted(SLIDING))
def test_sliding_window_layers_see_a_packed_document_as_they_see_it_alone(
    documents, tokenizer, architecture, attention
):
    """Models with sliding-window layers (every layer: Mistral; some: Qwen2, Gemma 3): the
    logits of each document of a packed row equal the model's own forward on the document alone
    (its own sliding-window mask). transformers takes one 4-D mask as it is for every layer, so
    the document mask alone gave the sliding layers whole documents: logits 3-5 off."""
    from rayjobs.train.hf import attention_layers, hf_model_mask

    overrides, kinds = SLIDING[architecture]
    torch.manual_seed(0)
    model = build_hf_model(
        vocab_size=tokenizer.vocab_size,
        seq_len=SEQ_LEN,
        overrides={**ARCHITECTURES["llama"], **overrides},
        attn_implementation=attention,
    ).eval()
    assert attention_layers(model.config) == (16, kinds)
    packed = PackedLM(model)
    assert packed.check_head() <= 1e-4  # 24 tokens: past the window
    row = _rows(documents, SEQ_LEN, tokenizer.pad_id)
    inputs = row["input_ids"], row["position_ids"], row["document_ids"]
    mask = hf_model_mask(model.config, row["document_ids"], row["position_ids"])
    assert isinstance(mask, dict) == (kinds is not None)
    with torch.no_grad():
        logits = packed.logits(*inputs)
        start, worst = 0, 0.0
        for input_ids, _ in documents:
            assert len(input_ids) > 2 * 16  # guard: every document outgrows the window
            alone = model(input_ids=torch.from_numpy(input_ids).long()[None]).logits
            end = start + len(input_ids)
            worst = max(worst, float((logits[0, start:end] - alone[0]).abs().max()))
            start = end
    assert worst <= 1e-4, worst


def test_layers_without_a_document_mask_are_refused():
    """Chunked, linear or convolutional layers would mix a packed row's documents: refused."""
    from types import SimpleNamespace

    from rayjobs.train.hf import attention_layers

    config = SimpleNamespace(sliding_window=None, layer_types=["full_attention", "conv"])
    with pytest.raises(ValueError, match=r"layer types \['conv'\]: rayjobs builds document"):
        attention_layers(config)


def test_a_lora_model_trains_a_packed_row_like_its_documents_alone(documents, tokenizer):
    """The fidelity test above for a model with PEFT's LoRA adapters (``train.lora``) on every
    attention and MLP projection, their B matrices made non-zero (as after some training) so the
    adapters shape the forward: the adapters' gradients from one packed row equal those of its
    documents run one by one, and without the document mask they differ."""
    from rayjobs.config import LoraConfig
    from rayjobs.train.lora import adapt

    torch.manual_seed(0)
    model = build_hf_model(
        vocab_size=tokenizer.vocab_size,
        seq_len=SEQ_LEN,
        overrides=ARCHITECTURES["llama"],
        token_ids={"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id},
    )
    adapted = adapt(model, LoraConfig(r=4, target_modules="all-linear"))
    for name, parameter in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.2)
    lora = PackedLM(adapted, loss_chunk_tokens=64).eval()
    packed = _rows(documents, SEQ_LEN, tokenizer.pad_id)
    alone = [_rows([document], len(document[0]), tokenizer.pad_id) for document in documents]
    packed_loss, packed_grads = _loss_and_grads(lora, [packed])
    alone_loss, alone_grads = _loss_and_grads(lora, alone)
    assert len(packed_grads) == 2 * 2 * 7 and all("lora_" in n for n in packed_grads)  # guard
    assert abs(packed_loss - alone_loss) <= 1e-5, (packed_loss, alone_loss)
    worst = max(float((packed_grads[n] - alone_grads[n]).abs().max()) for n in packed_grads)
    assert worst <= 1e-4, worst
    causal = {**packed, "document_ids": torch.zeros_like(packed["document_ids"])}
    _, causal_grads = _loss_and_grads(lora, [causal])
    assert max(float((causal_grads[n] - packed_grads[n]).abs().max()) for n in packed_grads) > 1e-2
