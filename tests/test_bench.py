"""rayjobs bench packing: the reference packers behave as published, and the default strategy holds
its claims on real data (efficiency within 0.1 point of global BFD, ahead of both references)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import DATA
from rayjobs import bench
from rayjobs.cli import main

# lengths, seq_len 10 → expected packs (sample indices, in placement order)
REFERENCES = {
    # torchtune: the oldest sample opens a pack, then the oldest buffered samples that still fit.
    # 6 opens, 5 does not fit (4 left), 4 does: [6, 4]. Then 5 opens, 3 fits: [5, 3].
    "torchtune": ([6, 5, 4, 3], [[0, 2], [1, 3]]),
    # TRL: BFD inside chunks of 2 here: [6, 5] cannot share a pack; [4, 3] can.
    "trl": ([6, 5, 4, 3], [[0], [1], [2, 3]]),
}


@pytest.mark.parametrize("name", REFERENCES)
def test_reference_packers(name):
    lengths, expected = REFERENCES[name]
    lengths = np.array(lengths)
    packs = (
        bench.torchtune_fifo(lengths, 10)
        if name == "torchtune"
        else bench.trl_chunk_bfd(lengths, 10, chunk=2)
    )
    assert [p.tolist() for p in packs] == expected


def test_torchtune_buffer_limits_the_lookahead():
    # With a buffer of 2, the 4 that would complete the first pack is not yet visible.
    packs = bench.torchtune_fifo(np.array([6, 5, 5, 4]), 10, buffer_size=2)
    assert [p.tolist() for p in packs] == [[0], [1, 2], [3]]


def test_bench_cli_on_real_sets(tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = main(
        [
            "bench",
            "packing",
            "--data",
            "alpaca",
            "chat/hh_rlhf_harmless_chosen.messages.jsonl",
            "hh_dpo_triples",
            "--data-dir",
            str(DATA),
            "--seq-len",
            "2048",
            "8192",
            "--json",
            str(out),
            "--no-pipeline",
            "--window-tokens",
            "200000",
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())
    assert set(rows[0]) == {
        "dataset",
        "seq_len",
        "strategy",
        "window",
        "efficiency",
        "global_bfd_efficiency",
        "lower_bound_packs",
        "packs",
        "samples_per_s",
        "max_delay_windows",
    }
    by_key = {(r["dataset"], r["seq_len"], r["strategy"]): r for r in rows}
    global_rows = {r["dataset"]: r for r in rows if r["strategy"] == "global_bfd"}
    len_stream = {name: r["window"] for name, r in global_rows.items()}  # the whole stream
    # hh_dpo_triples: preference triples packed as units (task: dpo), never split
    assert {k[0] for k in by_key} == {"alpaca", "hh_chat", "hh_dpo_triples"}
    for dataset in ("alpaca", "hh_chat", "hh_dpo_triples"):
        for seq_len in (2048, 8192):
            bfd = by_key[(dataset, seq_len, "bfd")]
            assert bfd["window"] == 4096 and bfd["max_delay_windows"] <= 1
            assert bfd["efficiency"] >= bfd["global_bfd_efficiency"] - 0.001
            assert bfd["efficiency"] >= by_key[(dataset, seq_len, "trl")]["efficiency"]
            assert bfd["efficiency"] >= by_key[(dataset, seq_len, "torchtune")]["efficiency"]
            assert bfd["packs"] >= bfd["lower_bound_packs"]
            next_fit = by_key[(dataset, seq_len, "next_fit")]
            assert next_fit["efficiency"] < bfd["efficiency"] - 0.01, "guard: strategies differ"
            stream = by_key[(dataset, seq_len, "stream")]  # windows of 200k tokens: several
            assert 0 < stream["window"] * 2 < len_stream[dataset], "guard: several windows"
            # The design's price: at most one row more than global BFD per packer call.
            calls = -(-len_stream[dataset] // stream["window"])
            global_packs = by_key[(dataset, seq_len, "global_bfd")]["packs"]
            assert global_packs <= stream["packs"] <= global_packs + calls
            assert stream["max_delay_windows"] == 0  # nothing waits for a later call
    printed = capsys.readouterr().out
    assert "bfd (planned, window 4096) vs global BFD" in printed
    assert "stream (the streaming path's packer, windows of 200,000 tokens)" in printed


def test_the_stage_timers_config_holds_every_sft_set_and_validates():
    # `bench packing` without --no-pipeline runs this config; preference triples in it made the
    # config invalid (they need task: dpo), so the bench failed after its packing table.
    config = bench.pipeline_config(DATA)
    names = {spec.name for spec in config.datasets}
    templates = {name: template for name, _, _, template, _, _ in bench.BENCH_SETS}
    assert names == {n for n, t in templates.items() if t != "preference"} - {"hh_dpo_text"}
    assert "preference" in templates.values()  # guard: there was a set to leave out
    assert all(spec.files for spec in config.datasets)  # the bundled files are there


def test_bench_rejects_unknown_set(capsys):
    assert (
        main(["bench", "packing", "--data", "nope", "--data-dir", str(DATA), "--no-pipeline"]) == 2
    )
    assert "not a bench set" in capsys.readouterr().err


def test_pipeline_bench_shards_and_report(tmp_path):
    """The pipeline bench's input is the real sets repeated, one shard per copy, and its report
    reads ratios between scales off one run."""
    from rayjobs import bench_pipeline

    folders = bench_pipeline.write_shards(DATA, tmp_path, scale=3)
    alpaca = sorted(folders["alpaca"].iterdir())
    assert [p.name for p in alpaca] == ["part-0000.jsonl", "part-0001.jsonl", "part-0002.jsonl"]
    assert len(alpaca[0].read_text().splitlines()) == len(
        json.loads((DATA / "sft" / "alpaca_en_demo.json").read_text())
    )
    chat = (DATA / "chat" / "hh_rlhf_harmless_chosen.messages.jsonl").read_text()
    assert all(p.read_text() == chat for p in folders["hh_chat"].iterdir())
    rows = [bench_pipeline.PipelineRow(scale, 700 * scale, first, 1000.0, 800.0, 0.1, 0.2,
                                       memory, 500.0, 2)
            for scale, first, memory in ((1, 10.0, 1000.0), (30, 12.0, 1300.0))]  # fmt: skip
    rows[-1].paced_step_s, rows[-1].paced_median_s, rows[-1].paced_gap_s = 0.2, 0.25, 0.4
    report = bench_pipeline.format_rows(rows)
    assert "30x vs 1x: first batch 1.20x, peak memory 1.30x" in report
    assert "at every consumer" not in report  # not measured
    rows[0].every_first_batch_s, rows[1].every_first_batch_s = 12.5, 28.0
    assert (
        "first batch at every consumer: 12.5 s at 1x, 28.0 s at 30x (2.24x)"
        in bench_pipeline.format_rows(rows)
    )
    assert "steady throughput at 30x = 80% of 2 tokenize CPU(s) x the 1-core reference" in report
    assert "epoch gap 0.400 s = 1.60x the median time between batches (0.250 s)" in report
    assert "CPU s by process" not in report  # none sampled
    assert "steal" not in report  # no /proc/stat: no steal figures
    for row, steal in zip(rows, (0.02, 0.115), strict=True):
        row.steal_share = steal
    rows[-1].reference_steal_share, rows[-1].reference_max = 0.031, 650.0
    rows[-1].reference_min, rows[-1].reference_cpu_tokens_per_s = 420.0, 530.0
    report = bench_pipeline.format_rows(rows)
    assert (
        "1-core reference: 500 tokens/s, the median of 10 passes before and after the runs "
        "(420-650); 530 per CPU second" in report
    )
    assert (
        "CPU time taken by the host (steal): 2.0% during 1x, 11.5% during 30x, 3.1% during the "
        "reference" in report
    )
    rows[-1].cpu_by_process = {"MapWorker(MapBatches(Tokenize))": 30.5, "raylet": 4.25}
    assert (
        "    CPU s by process (34.8 in all): MapWorker(MapBatches(Tokenize)) 30.5, raylet 4.2"
        in bench_pipeline.format_rows(rows)
    )


@pytest.mark.parametrize(
    ("cmdline", "driver", "label"),
    [
        (["ray::MapWorker(MapBatches(Tokenize))"], False, "MapWorker(MapBatches(Tokenize))"),
        (["ray::ReadRowFile->SplitBlocks(2) extra"], False, "ReadRowFile->SplitBlocks(2)"),
        (["/site-packages/ray/core/src/ray/raylet/raylet", "--flag"], False, "raylet"),
        (["python", "-m", "rayjobs.cli", "bench"], True, "driver (consumers)"),
        (["python3.11", "/x/ray/_private/workers/default_worker.py"], False, "worker start-up"),
        ([], False, "?"),
    ],
)
def test_process_labels_of_the_cpu_table(cmdline, driver, label):
    from rayjobs import bench_pipeline

    assert bench_pipeline.process_label(cmdline, driver) == label


@pytest.mark.parametrize(
    "stamps, expected",
    [
        # steady arrivals, a stall at the boundary: the wait before epoch 1's first batch
        ([(0.0, 0, 0), (1.0, 0, 0), (2.0, 0, 0), (5.0, 1, 1), (6.0, 1, 1)], (1.0, 3.0)),
        # a batch straddling the boundary counts as epoch 1's first
        ([(0.0, 0, 0), (0.5, 0, 0), (1.5, 1, 0), (2.0, 1, 1)], (0.5, 1.0)),
        # one epoch only: no boundary, no gap
        ([(0.0, 0, 0), (2.0, 0, 0), (3.0, 0, 0)], (1.5, 0.0)),
    ],
)
def test_epoch_gap_is_the_wait_before_the_first_batch_of_epoch_1(stamps, expected):
    from rayjobs import bench_pipeline

    assert bench_pipeline.epoch_gap(stamps) == expected


def test_pipeline_bench_examples():
    """The pipeline bench's docstring examples (epoch gap, process labels, the reference's
    median) hold."""
    import doctest

    from rayjobs import bench_pipeline

    results = doctest.testmod(bench_pipeline)
    assert results.attempted >= 5 and results.failed == 0
