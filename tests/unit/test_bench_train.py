"""``rayjobs bench train`` on CPU: the padded baseline holds exactly the packed steps' documents,
and training either layout from the same weights gives the same loss at every step."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from rayjobs import cli
from rayjobs.bench import train as bench_train
from rayjobs.data.rows import IGNORE_INDEX, assemble
from rayjobs.errors import ConfigError
from rayjobs.job.export import to_arrow
from rayjobs.job.manifest import MANIFEST
from rayjobs.train.model import DecoderConfig

SEQ_LEN = 64
# Rows of documents (lengths); row 2 is exactly full (no padding document), row 5 one document.
ROWS = [[20, 30], [10, 11, 12, 13], [40, 24], [5, 50], [33, 17, 9], [60], [25, 25], [8, 8, 8]]


FINISHED = {"labels": "hf"}
"""The manifest of a finished hf export."""


def _write_export(folder, convention="hf", manifest=FINISHED):
    """An export of ``ROWS`` in the ``convention`` (``None``: a file without the metadata
    that states it), with ``manifest`` as its manifest.json (``None``: none, an unfinished
    export); returns each document's tokens and shifted labels."""
    rng = np.random.default_rng(0)
    lengths = np.array([n for row in ROWS for n in row])
    tokens, labels = [], []
    for n in lengths:
        ids = rng.integers(1, 300, n)
        prompt = n // 3  # untrained prompt, then a response trained on its next token
        label = np.r_[ids[1:], IGNORE_INDEX]
        label[: prompt - 1] = IGNORE_INDEX
        tokens.append(ids)
        labels.append(label)
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    rows = assemble(
        tokens, labels, starts, lengths, np.array([len(r) for r in ROWS]), SEQ_LEN, pad_id=0
    )
    (folder / "train").mkdir()
    table = to_arrow(rows, labels=convention or "shifted")
    if convention is None:
        table = table.replace_schema_metadata(None)
    pq.write_table(table, folder / "train" / "part-0.parquet")
    if manifest is not None:
        (folder / MANIFEST).write_text(json.dumps(manifest))
    return tokens, labels


@pytest.mark.parametrize(
    "convention, manifest",
    [("hf", {"labels": "hf"}), ("shifted", {"labels": "shifted"}), (None, {"seq_len": SEQ_LEN})],
    ids=["hf", "shifted", "before_the_convention"],
)
def test_unpack_gives_every_document_once_with_its_own_labels(tmp_path, convention, manifest):
    """Whatever convention the export states (an old manifest without ``labels``: shifted, as
    every export was then), the rows read are as rayjobs trains on them."""
    tokens, labels = _write_export(tmp_path, convention, manifest)
    rows, seq_len = bench_train.read_export(tmp_path)
    assert seq_len == SEQ_LEN and int(rows["num_tokens"][2]) == SEQ_LEN  # guard: a full row
    padded = bench_train.unpack(rows)
    assert padded["input_ids"].shape == (len(tokens), 60)  # one row per document, the longest
    for i, (ids, label) in enumerate(zip(tokens, labels, strict=True)):
        n = len(ids)
        assert padded["input_ids"][i, :n].tolist() == ids.tolist()
        assert padded["labels"][i, :n].tolist() == label.tolist()
        assert padded["position_ids"][i, :n].tolist() == list(range(n))
        assert (padded["document_ids"][i, :n] == 0).all()
        assert (padded["labels"][i, n:] == IGNORE_INDEX).all()
        assert (padded["document_ids"][i, n:] == 1).all()


def test_padded_and_packed_steps_train_alike(tmp_path):
    _write_export(tmp_path)
    config = DecoderConfig(vocab_size=384, dim=32, n_layers=2, n_heads=2)
    results = bench_train.bench_train(
        tmp_path, rows_per_step=2, config=config, warmup=1, device=torch.device("cpu")
    )
    padded, packed = results
    assert (padded.variant, packed.variant) == ("padded_sdpa", "packed_sdpa")
    assert padded.steps == packed.steps == 3  # 4 steps of 2 rows, 1 untimed
    assert packed.rows_per_step == 2 and padded.rows_per_step == pytest.approx(13 / 3)
    # The same documents per step: same tokens, so the same loss from the same initial weights,
    # at every step (the second step onward after updates from equal gradients).
    assert len(packed.losses) == 4 and packed.max_loss_diff < 1e-5
    assert packed.losses[0] != packed.losses[-1]  # guard: the weights did change
    ratio = packed.tokens_per_s / packed.trained_tokens_per_s
    assert ratio == pytest.approx(padded.tokens_per_s / padded.trained_tokens_per_s)
    assert padded.padding > packed.padding > 0
    assert bench_train.format_table(results).count("\n") == 2


def test_too_few_steps_and_a_missing_export_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="rayjobs export CONFIG --out"):
        bench_train.read_export(tmp_path)
    _write_export(tmp_path)
    with pytest.raises(ValueError, match="export more epochs or lower --rows"):
        bench_train.bench_train(tmp_path, rows_per_step=4, warmup=2, device=torch.device("cpu"))


def test_the_command_refuses_a_missing_export_without_a_traceback(tmp_path, capsys):
    assert bench_train.main(["--export", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayjobs: ") and "rayjobs export CONFIG --out" in err


@pytest.mark.parametrize(
    "labels, manifest, message",
    [
        (None, None, "is not a finished export (no _manifest.json"),
        ("shifted", {"labels": "hf"}, "its labels are 'shifted' but the manifest says 'hf'"),
    ],
    ids=["unstated", "contradicted"],
)
def test_an_export_that_does_not_say_its_labels_is_refused(
    tmp_path, capsys, labels, manifest, message
):
    """A reader that guessed would train on the token after next, or on nothing trained."""
    _write_export(tmp_path, labels, manifest)
    assert bench_train.main(["--export", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys):
    _write_export(tmp_path)
    argv = ["bench", "train", "--export", str(tmp_path), "--rows", "2", "--warmup", "1"]
    argv += ["--dim", "32", "--layers", "1", "--heads", "2", "--json", str(tmp_path / "out.json")]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "CPU" in printed and "seq_len 64" in printed and "packed_sdpa" in printed
    rows = json.loads((tmp_path / "out.json").read_text())["bench"]  # (no fp32_check on CPU)
    assert [row["variant"] for row in rows] == ["padded_sdpa", "packed_sdpa"]
    assert rows[1]["max_loss_diff"] < 1e-5


def test_vocab_size_sets_the_decoders_vocabulary_and_must_hold_every_token_id(tmp_path, capsys):
    """``--vocab-size``: the model a run builds has its tokenizer's vocabulary (GPT-2: 50257), not
    the export's rounded one, and the bench can have the same; one without the export's largest
    id is refused before any training."""
    _write_export(tmp_path)
    largest = int(bench_train.read_export(tmp_path)[0]["input_ids"].max())
    argv = ["bench", "train", "--export", str(tmp_path), "--rows", "2", "--warmup", "1"]
    argv += ["--dim", "32", "--layers", "1", "--heads", "2", "--variants", "packed_sdpa"]
    assert cli.main([*argv, "--vocab-size", str(largest + 1)]) == 0
    assert f"vocab {largest + 1})" in capsys.readouterr().out
    assert cli.main([*argv, "--vocab-size", str(largest)]) == 2
    assert f"--vocab-size {largest} holds no token id {largest}" in capsys.readouterr().err


def test_a_variant_that_trains_otherwise_fails_the_command(tmp_path, capsys, monkeypatch):
    """Past the tolerance (here -1 on CPU: any Δloss crosses it) the bench prints the
    table, then says which variant trained unlike padded_sdpa, and exits 1."""
    from rayjobs.bench import train as bench_train

    monkeypatch.setattr(bench_train, "LOSS_TOLERANCE", -1.0)
    _write_export(tmp_path)
    argv = ["bench", "train", "--export", str(tmp_path), "--rows", "2", "--warmup", "1"]
    assert cli.main([*argv, "--dim", "32", "--layers", "1", "--heads", "2"]) == 1
    printed = capsys.readouterr().out
    assert "FAILED: packed_sdpa trained unlike padded_sdpa (fp32 Δloss above -1)" in printed
