"""rayjobs bench packing: the reference packers behave as published, and the default strategy holds
its claims on real data (efficiency within 0.1 point of global BFD, ahead of both references)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import DATA
from rayjobs.bench import packing as bench
from rayjobs.cli import main

# lengths, seq_len 10 → expected packs (sample indices, in placement order)
REFERENCES = {
    # torchtune: the oldest sample opens a pack, then the oldest buffered samples that still fit.
    # 6 opens, 5 does not fit (4 left), 4 does: [6, 4]. Then 5 opens, 3 fits: [5, 3].
    "torchtune": ([6, 5, 4, 3], [[0, 2], [1, 3]]),
    # The oldest sample that fits, not the best fit: 6 opens (4 left), 3 fits and is older than
    # the 4 that would fill the pack exactly: [6, 3]. Then [4].
    "torchtune_oldest_fit": ([6, 3, 4], [[0, 1], [2]]),
    # TRL: BFD inside chunks of 2 here: [6, 5] cannot share a pack; [4, 3] can.
    "trl": ([6, 5, 4, 3], [[0], [1], [2, 3]]),
}


@pytest.mark.parametrize("name", REFERENCES)
def test_reference_packers(name):
    lengths, expected = REFERENCES[name]
    lengths = np.array(lengths)
    packs = (
        bench.torchtune_fifo(lengths, 10)
        if name.startswith("torchtune")
        else bench.trl_chunk_bfd(lengths, 10, chunk=2)
    )
    assert [p.tolist() for p in packs] == expected


@pytest.fixture(scope="module")
def bundled_lengths() -> dict[str, np.ndarray]:
    """Every bundled bench set's sample lengths (GPT-2, the job's templates), as the bench
    streams them (10 shuffled copies), the sets once each, and a mix of all of them of ~1 M
    tokens (two copies of every set, shuffled together)."""
    lengths = bench.load_lengths(DATA)
    sets = {f"{name} x1": bench.stream(values, copies=1) for name, values in lengths.items()}
    sets |= {f"{name} x10": bench.stream(values) for name, values in lengths.items()}
    sets["mix of all, ~1M tokens"] = bench.stream(np.concatenate(list(lengths.values())), 2)
    return sets


@pytest.mark.parametrize("seq_len", [2048, 4096, 8192])
def test_the_default_path_packs_within_a_tenth_of_a_point_of_global_bfd(bundled_lengths, seq_len):
    """The job's default streaming path, warm-up lane included (``bench.default_path``: the
    packer functions the job calls, with its lane rule): within 0.1 point of global BFD and
    ahead of TRL's chunk BFD and a FIFO(100) first-fit on every bundled set, once and streamed
    ten times, and on a ~1 M-token mix."""
    behind = {}
    for name, stream in bundled_lengths.items():
        clipped = np.minimum(stream, seq_len)
        packs, _, first, _ = bench.default_path(clipped, seq_len, bench.DEFAULT_WINDOW_TOKENS)
        best = len(bench.pack_lengths(clipped, seq_len, "bfd"))
        peers = (
            len(bench.trl_chunk_bfd(clipped, seq_len)),
            len(bench.torchtune_fifo(clipped, seq_len)),
        )
        slots = seq_len * np.array([len(packs), best, *peers])
        efficiency = clipped.sum() / slots
        if efficiency[0] < efficiency[1] - 0.001 or efficiency[0] < efficiency[2:].max():
            behind[name] = efficiency.round(4).tolist()
        assert first == clipped.sum()  # no lane on sets this small: the epoch is one window
    assert not behind, behind
    assert 800_000 < bundled_lengths["mix of all, ~1M tokens"].sum() < 1_200_000  # guard


def test_the_warm_up_lane_runs_on_a_large_epoch_and_costs_its_tail_row_only(bundled_lengths):
    """On an epoch of ~9 M tokens the lane runs: its first row leaves after the lane's tokens,
    not a window's, and it costs at most one row more than the windows alone."""
    clipped = np.minimum(bench.stream(bundled_lengths["mix of all, ~1M tokens"], 10), 2048)
    window = bench.DEFAULT_WINDOW_TOKENS
    packs, _, first, starts = bench.default_path(clipped, 2048, window)
    alone, _, first_alone, _ = bench.default_path(clipped, 2048, window, warmup_tokens=0)
    assert first < bench.DEFAULT_WARMUP_TOKENS + 2048 < window <= first_alone
    assert len(starts) == len(bench.default_path(clipped, 2048, window, warmup_tokens=0)[3]) + 1
    assert len(alone) <= len(packs) <= len(alone) + 1
    assert bench.packed_delay_windows(packs, starts) == 0


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
        "first_row_tokens",
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
    assert (
        "stream (the job's default path: a warm-up lane where it runs, then windows of " in printed
    )


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
    from rayjobs.bench import pipeline as bench_pipeline

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
    assert "per data CPU" not in report  # no tokenizer-alone reference
    rows[-1].data_cpus, rows[-1].tokenizer = 2, "fastokens"
    rows[-1].tokenizer_tokens_per_s, rows[-1].tokenizer_cpu_tokens_per_s = 1600.0, 2000.0
    assert (
        "steady at 30x per data CPU: 400 tokens/s (2 cores) = 20.0% of the tokenizer alone on "
        "the same texts (fastokens: 2,000 tokens per CPU second; 1,600 tokens/s of wall time in a "
        "1-CPU task)" in bench_pipeline.format_rows(rows)
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
    from rayjobs.bench import pipeline as bench_pipeline

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
    from rayjobs.bench import pipeline as bench_pipeline

    assert bench_pipeline.epoch_gap(stamps) == expected


def test_pipeline_bench_examples():
    """The pipeline bench's docstring examples (epoch gap, process labels, the reference's
    median) hold."""
    import doctest

    from rayjobs.bench import pipeline as bench_pipeline
    from rayjobs.bench import reference

    results = doctest.testmod(bench_pipeline)
    assert results.attempted >= 5 and results.failed == 0
    results = doctest.testmod(reference)
    assert results.attempted >= 2 and results.failed == 0


def test_pipeline_memory_sampler_counts_only_the_drivers_process_tree(monkeypatch):
    """The sampler's memory and CPU are the driver's and its descendants' (the local Ray it
    started), not every process whose command line says "ray": another Ray on the host is not
    the bench's. Here a process outside the tree with "ray" in its arguments (started through a
    shell that exits, so it is nobody's child here) and a child of the driver without it."""
    import subprocess
    import sys
    import time

    import psutil

    from rayjobs.bench import pipeline as bench_pipeline

    monkeypatch.setattr(bench_pipeline, "_object_store_used", lambda: 0)  # no Ray here
    monkeypatch.setattr(bench_pipeline, "SAMPLE_S", 0.01)
    sleeper = f"{sys.executable} -c 'import time; time.sleep(60)' ray-of-another-session"
    foreign = int(
        subprocess.run(
            ["sh", "-c", f"{sleeper} >/dev/null 2>&1 & echo $!"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert foreign not in {p.pid for p in psutil.Process().children(recursive=True)}
        assert "ray-of-another-session" in " ".join(psutil.Process(foreign).cmdline())  # guard
        memory = bench_pipeline._Memory()
        memory.start()
        while psutil.Process().pid not in memory.last_cpu:  # its first sweep
            time.sleep(0.01)
        time.sleep(0.05)  # a few more
        memory.running = False
        memory.join()
        assert foreign not in memory.last_cpu
        assert child.pid in memory.last_cpu
    finally:
        child.kill()
        child.wait()
        psutil.Process(foreign).kill()


def test_attention_bench_draws_full_rows_and_counts_no_padding_as_a_document():
    """``bench attention``'s batches are rows as the packer makes them of a long stream: the
    under-filled leftover bin of one BFD draw (7% tokens at 8192, seed 0) is not one of them, and
    a row's padding, which ``layout_rows`` gives a document id of its own, is no document."""
    import doctest

    import torch

    from rayjobs.bench import attention as bench_attention

    padded_rows = 0
    for seq_len in (2048, 4096, 8192):
        batch_size = bench_attention.TOKENS_PER_STEP // seq_len
        document_ids, _, num_tokens = bench_attention.packed_layout(
            np.random.default_rng(0), batch_size, seq_len, 300.0
        )
        assert document_ids.shape == (batch_size, seq_len)
        assert (seq_len - num_tokens < 300).all(), (seq_len, num_tokens.tolist())
        documents = [
            len(torch.unique(row[:n])) for row, n in zip(document_ids, num_tokens, strict=True)
        ]
        assert bench_attention.documents_per_row(document_ids, num_tokens) == np.mean(documents)
        padded_rows += int((num_tokens < seq_len).sum())
    assert padded_rows > 0  # guard: rows with padding, whose id is not counted
    results = doctest.testmod(bench_attention)
    assert results.attempted >= 2 and results.failed == 0


def test_read_bench_shared_column_is_shared_memory_not_library_pages():
    """``bench read``'s "of it shmem" is the process's resident shared memory (``RssShmem``: the
    object store's pages in /dev/shm), not psutil's ``shared`` (``RssFile`` + ``RssShmem``), which
    also held every library the process maps. Here 32 MiB of shared memory, touched, in this
    process, which maps far more than that in libraries (numpy, pyarrow)."""
    import mmap
    import os
    import time

    import psutil
    import pyarrow  # noqa: F401 - file-backed pages the column must leave out

    from rayjobs.bench import read as bench_read

    if bench_read.rss_shmem(os.getpid()) is None:
        pytest.skip("no RssShmem in /proc/<pid>/status (not Linux)")
    size = 32 * bench_read.MiB
    shared = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)  # anonymous shared: RssShmem
    try:
        shared.write(b"x" * size)
        shmem = bench_read.rss_shmem(os.getpid())
        assert shmem >= size
        file_pages = psutil.Process().memory_info().shared - shmem
        assert file_pages > 16 * bench_read.MiB  # guard: what the old column added
        sampler = bench_read._Sampler(interval=0.01)
        sampler.start()
        while not sampler.samples:
            time.sleep(0.01)
        sampler.stop()
        _, sampled, _ = sampler.peaks[os.getpid()]
        assert abs(sampled - shmem) < 8 * bench_read.MiB, (sampled, shmem, file_pages)
    finally:
        shared.close()
    row = bench_read.ReadRow("chunked", bench_read.MiB, 1, 1.0, 100.0, 40.0, "p", 50.0, 1, [])
    table = bench_read.format_rows([row], bench_read.MiB, 1)
    assert "of it shmem" in table and "of it shared" not in table


def _never(*args, **kwargs):
    raise AssertionError("the bench ran with an argument it should have refused")


@pytest.fixture
def benches_never_run(monkeypatch):
    """Every bench's work replaced by a failure: a refused argument must stop it first (a
    pipeline bench that ran would take minutes)."""
    from rayjobs.bench import pipeline as bench_pipeline
    from rayjobs.bench import read as bench_read
    from rayjobs.bench import train as bench_train

    monkeypatch.setattr(bench, "load_lengths", _never)
    monkeypatch.setattr(bench_pipeline, "bench_pipeline", _never)
    monkeypatch.setattr(bench_read, "write_jsonl", _never)
    monkeypatch.setattr(bench_train, "read_export", _never)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # bench packing: -100 ran with windows of one sample, 0 with the default 4M tokens
        (["packing", "--window-tokens", "-100"], "--window-tokens must be positive, got -100"),
        (["packing", "--window-tokens", "0"], "--window-tokens must be positive, got 0"),
        (["packing", "--window", "0"], "--window must be positive, got 0"),
        (["packing", "--window", "-3"], "--window must be positive, got -3"),
        (["packing", "--seq-len"], "--seq-len needs at least one length"),
        (["packing", "--seq-len", "2048", "0"], "--seq-len must be positive, got [2048, 0]"),
        # bench pipeline: 0 fell back to the job's default; -0.5 failed after every run
        (["pipeline", "--window-tokens", "0"], "--window-tokens must be positive, got 0"),
        (["pipeline", "--tokenize-actors", "0"], "--tokenize-actors must be positive, got 0"),
        (["pipeline", "--pace", "-0.5"], "--pace must be 0 (no paced pass) or a positive share"),
        (["pipeline", "--weights", "0.7"], "--weights takes two positive weights"),
        (["pipeline", "--scales", "1", "0"], "--scales must be positive numbers of copies"),
        (["pipeline", "--data-dir", "/nonexistent"], "--data-dir /nonexistent is not a folder"),
        (["read", "--size-mb", "0"], "--size-mb must be positive, got 0"),
        # bench attention: the tile share counts whole 128-token tiles
        (["attention", "--seq-len", "200"], "--seq-len must be multiples of 128"),
        (["attention", "--seq-len", "100"], "--seq-len must be multiples of 128"),
        (["attention", "--seq-len"], "--seq-len needs at least one length"),
        (["attention", "--mean-length", "0"], "--mean-length must be at least 1 token"),
        # another bench's options, which were dropped without a word
        (["pipeline", "--seq-len", "8192", "--window", "512"], "bench pipeline does not take "
         "--seq-len, --window"),
        (["read", "--data-dir", "x", "--window-tokens", "5"], "bench read does not take "
         "--data-dir, --window-tokens"),
        (["packing", "--scales", "3"], "bench packing does not take --scales"),
        (["packing", "--pace", "0"], "bench packing does not take --pace"),
        (["attention", "--no-pipeline"], "bench attention does not take --no-pipeline"),
        (["--json", "out.json", "train"], "bench train takes its options after `bench train`"),
        # bench train (its own parser): 0 rows failed in range(), negatives sliced from the end
        (["train", "--export", "x", "--rows", "0"], "--rows must be positive, got 0"),
        (["train", "--export", "x", "--warmup", "-1"], "--warmup must be 0 or more steps"),
        (["train", "--export", "x", "--steps", "-1"], "--steps -1 must be more than --warmup 3"),
        (["train", "--export", "x", "--heads", "0"], "--heads must be positive, got 0"),
    ],
)  # fmt: skip
def test_bench_refuses_bad_arguments_before_it_runs(argv, message, benches_never_run, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayjobs: ") and message in err, err


def test_bench_takes_its_own_options_from_the_cli(monkeypatch):
    """The CLI's own start time (``args.started``, for validate) is not a bench option: it made
    every ``rayjobs bench pipeline`` refuse to run ("does not take --started")."""
    from rayjobs.bench import pipeline as bench_pipeline

    ran = []
    monkeypatch.setattr(bench_pipeline, "bench_pipeline", lambda *a, **k: ran.append(a) or [])
    monkeypatch.setattr(bench_pipeline, "format_rows", lambda rows: "")
    assert main(["bench", "pipeline", "--scales", "1"]) == 0
    assert ran


@pytest.mark.parametrize(
    ("chunk_mb", "message"),
    [
        ("0", "--chunk-mb must be positive, got 0"),  # was read with the default 16 MiB
        ("-1", "--chunk-mb must be positive, got -1"),  # was the whole file, labelled chunked
        ("1e-9", "--chunk-mb 1e-09 is under one byte"),  # 0 bytes: the default again
    ],
)
def test_read_bench_refuses_a_chunk_it_would_not_read_in(chunk_mb, message, benches_never_run,
                                                         capsys):  # fmt: skip
    from rayjobs.bench import read as bench_read

    assert bench_read.main(["--chunk-mb", chunk_mb, "--modes", "chunked"]) == 2
    assert capsys.readouterr().err == f"rayjobs: {message}\n"


def test_bench_passes_each_bench_its_own_options(monkeypatch):
    """What ``rayjobs bench X`` hands each bench: the options given, 0 included (``--pace 0``,
    no paced pass, is a value, not "none given"), the bench's own defaults for the rest."""
    from rayjobs.bench import pipeline as bench_pipeline
    from rayjobs.bench import read as bench_read

    seen = {}

    def record(name, value, result):
        seen[name] = value
        return result

    monkeypatch.setattr(bench_pipeline, "bench_pipeline", lambda *a: record("pipeline", a, []))
    monkeypatch.setattr(bench_pipeline, "format_rows", lambda rows: "")
    monkeypatch.setattr(bench_read, "main", lambda argv: record("read", argv, 0))
    argv = ["bench", "pipeline", "--scales", "2", "--window-tokens", "100", "--pace", "0"]
    assert main(argv) == 0
    assert seen["pipeline"] == (bench.DEFAULT_DATA_DIR, [2], 100, None, 0.0, None)
    assert main([*argv, "--weights", "0.7", "0.3"]) == 0
    assert seen["pipeline"][-1] == [0.7, 0.3]
    assert main(["bench", "read"]) == 0 and seen["read"] == []  # bench_read's defaults


def test_stream_rows_wait_is_read_off_their_packs(monkeypatch):
    """The stream row's ``max_delay_windows`` is measured, so the real-data test's "nothing
    waits for a later call" can fail: a stream packer that carries samples to the next call (the
    planned path's ``StreamPacker``, in its place) shows its wait."""
    rng = np.random.default_rng(0)
    lengths = {"x": rng.integers(50, 1500, 3000)}
    clipped = np.minimum(bench.stream(lengths["x"]), 2048)
    carried, waited = bench.stream_pack(clipped, 2048, "bfd", 1000)
    assert waited >= 1  # guard: this packer does carry samples
    assert 1 <= bench.packed_delay_windows(carried, 1000) <= waited

    def carrying(lengths, seq_len, window_tokens, seed=0):
        starts = np.arange(0, len(lengths), 1000)
        return bench.stream_pack(lengths, seq_len, "bfd", 1000)[0], 1000, 0, starts

    monkeypatch.setattr(bench, "default_path", carrying)
    rows = bench.bench_packing(lengths, seq_lens=(2048,))
    stream_row = next(r for r in rows if r.strategy == "stream")
    assert stream_row.max_delay_windows >= 1


def test_pipeline_reference_is_one_copy_of_the_data_whatever_the_first_scale(monkeypatch):
    """The 1-core reference is over the 1x data at every first scale (``--scales 3 5`` measured
    it over the first scale's 3 copies): the pipeline, Ray and the reference's passes are
    stand-ins here, and what each reference pass was given is counted in shard files."""
    import rayjobs.data.backends
    import rayjobs.data.placement
    import rayjobs.job.pipeline
    from rayjobs.bench import pipeline as bench_pipeline

    given = []

    def measure_reference(config, repeats=bench_pipeline.REFERENCE_REPEATS):
        given.append([len(spec.files) for spec in config.datasets])
        return [(500.0, 600.0)], None

    measured = {"samples_per_epoch": 1, "first_batch_s": 1.0, "every_first_batch_s": 1.0}
    measured |= {"tokens_per_s": 1.0, "steady_tokens_per_s": 1.0, "last_batch_s": 1.0}
    measured |= {"tokens": 1, "median_batch_s": 0.1, "epoch_gap_s": 0.1, "peak_rss_mb": 1.0}
    measured |= {"tokenize_cpu_s": 1.0, "pack_cpu_s": 1.0, "cpu_by_process": {}}
    monkeypatch.setattr(bench_pipeline, "measure_reference", measure_reference)
    monkeypatch.setattr(bench_pipeline, "tokenizer_rates", lambda config: ("x", [(1.0, 1.0)]))
    monkeypatch.setattr(bench_pipeline, "run_scale", lambda *a, **k: {**measured})
    monkeypatch.setattr(rayjobs.job.pipeline, "init_ray", lambda config: None)
    monkeypatch.setattr(rayjobs.job.pipeline, "load_tokenizer", lambda config: None)
    monkeypatch.setattr(rayjobs.data.backends, "choose", lambda config, tokenizer: (config, None))
    monkeypatch.setattr(rayjobs.data.placement, "cluster_cpus", lambda config: 2)
    for scales in ([3, 5], [1, 3]):
        given.clear()
        rows = bench_pipeline.bench_pipeline(DATA, scales, pace=0)
        assert [row.scale for row in rows] == scales
        assert given == [[1, 1], [1, 1]], scales  # before and after the runs: one shard a set
