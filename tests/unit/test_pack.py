"""Tests for rayjobs.data.pack: scenario tables per strategy, packing invariants, the row contract
of streamed packs, determinism."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayjobs.data import pack, packer
from rayjobs.data.pack import STRATEGIES, StreamPacker, pack_lengths
from rayjobs.data.rows import IGNORE_INDEX
from support.packed import PAD_ID, assemble_bins, random_window

SEQ_LEN = 10

# Every strategy runs through the same table. Bins are listed in opening order, indices in placement
# order; "#i" is sample i, "A/B/C" are bins in opening order, "(n left)" their remaining capacity.
SCENARIOS: dict[str, tuple[list[int], dict[str, list[list[int]]]]] = {
    "order_matters": (
        [2, 3, 8, 7],
        {
            # Decreasing order: 8#2, 7#3, 3#1, 2#0. 8 opens A (2 left); 7 opens B (3 left);
            # 3 fits only B (0 left); 2 fits only A (0 left). Two full rows.
            "bfd": [[2, 0], [3, 1]],
            # Each item fits at most one open bin, so first fit decides exactly like best fit.
            "ffd": [[2, 0], [3, 1]],
            # Input order: 2 opens A (8 left); 3 -> A (5 left); 8 opens B (2 left); 7 opens C.
            # The small samples spent A's room before the big ones came: one row more than ffd.
            "first_fit": [[0, 1], [2], [3]],
            # 2, 3 -> A (5 left); 8 closes A, opens B (2 left); 7 closes B, opens C.
            "next_fit": [[0, 1], [2], [3]],
        },
    ),
    "every_strategy_differs": (
        [1, 4, 7, 4],
        {
            # Decreasing order: 7#2, 4#1, 4#3, 1#0. 7 opens A (3 left); 4 opens B (6 left);
            # 4 -> B (2 left); 1 fits A (3 left) and B (2 left): B is the tighter fit.
            "bfd": [[2], [1, 3, 0]],
            # Same until 1, which goes to the first bin with room: A.
            "ffd": [[2, 0], [1, 3]],
            # Input order: 1 opens A (9 left); 4 -> A (5 left); 7 opens B (3 left); 4 -> A (1 left).
            "first_fit": [[0, 1, 3], [2]],
            # 1, 4 -> A (5 left); 7 closes A, opens B (3 left); 4 closes B and opens C, although
            # closed A still had room for it: one row more than every other strategy.
            "next_fit": [[0, 1], [2], [3]],
        },
    ),
    "next_fit_beats_bfd": (
        [5, 3, 2, 4, 4, 2],
        {
            # Decreasing order: 5#0, 4#3, 4#4, 3#1, 2#2, 2#5. 5 opens A (5 left); 4 -> A (1 left);
            # 4 opens B (6 left); 3 -> B (3 left); 2 -> B (1 left); 2 fits neither, opens C.
            # Sorting broke up the perfect partition 5+3+2 | 4+4+2: BFD is not optimal.
            "bfd": [[0, 3], [4, 1, 2], [5]],
            # Each item fits at most one open bin: same decisions as bfd.
            "ffd": [[0, 3], [4, 1, 2], [5]],
            # Input order: 5, 3, 2 fill A exactly; 4, 4, 2 fill B exactly.
            "first_fit": [[0, 1, 2], [3, 4, 5]],
            # Same as first_fit: A is full when 4 arrives, so closing it costs nothing.
            "next_fit": [[0, 1, 2], [3, 4, 5]],
        },
    ),
    "ties_by_index": (
        [5, 5, 5, 10],
        {
            # Stable decreasing order: 10#3, 5#0, 5#1, 5#2 (equal lengths by index). 10 fills A;
            # 5 opens B (5 left); 5 -> B (0 left); 5 opens C.
            "bfd": [[3], [0, 1], [2]],
            "ffd": [[3], [0, 1], [2]],
            # Input order: 5, 5 fill A; 5 opens B (5 left); 10 fits nowhere, opens C.
            "first_fit": [[0, 1], [2], [3]],
            "next_fit": [[0, 1], [2], [3]],
        },
    ),
}


@pytest.mark.parametrize(
    ("lengths", "strategy", "expected"),
    [
        pytest.param(lengths, strategy, expected[strategy], id=f"{name}-{strategy}")
        for name, (lengths, expected) in SCENARIOS.items()
        for strategy in STRATEGIES
    ],
)
def test_scenarios(lengths: list[int], strategy: str, expected: list[list[int]]) -> None:
    bins = pack_lengths(np.array(lengths), SEQ_LEN, strategy)
    assert [indices.tolist() for indices in bins] == expected


def test_scenario_table_covers_every_strategy() -> None:
    for name, (_, expected) in SCENARIOS.items():
        assert set(expected) == set(STRATEGIES), name


def test_docstring_examples() -> None:
    results = doctest.testmod(pack)
    assert results.attempted >= 6 and results.failed == 0  # guard: the examples ran


# --- Properties of pack_lengths -----------------------------------------------------------------


def _window_of(seq_len: int) -> st.SearchStrategy[tuple[int, np.ndarray]]:
    """(seq_len, lengths): up to 60 samples, each 1..seq_len tokens."""
    lengths = st.lists(st.integers(1, seq_len), max_size=60)
    return st.tuples(st.just(seq_len), lengths.map(lambda values: np.array(values, dtype=np.int64)))


_windows = st.integers(1, 64).flatmap(_window_of)


def _fills(lengths: np.ndarray, bins: list[np.ndarray]) -> list[int]:
    return [int(lengths[indices].sum()) for indices in bins]


def _visit_order(lengths: np.ndarray, strategy: str) -> np.ndarray:
    """The lengths in the order the strategy places them."""
    return -np.sort(-lengths) if strategy in ("bfd", "ffd") else lengths


def _best_fit_decreasing_reference(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """BFD by a linear scan over all bins: slow and obviously right."""
    bins: list[list[int]] = []
    remaining: list[int] = []
    for index in np.argsort(-lengths, kind="stable").tolist():
        fitting = [bin_index for bin_index, room in enumerate(remaining) if room >= lengths[index]]
        if fitting:
            chosen = min(
                fitting, key=lambda bin_index: remaining[bin_index]
            )  # min keeps the first tie
        else:
            chosen = len(bins)
            bins.append([])
            remaining.append(seq_len)
        bins[chosen].append(index)
        remaining[chosen] -= int(lengths[index])
    return bins


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=150, deadline=None)
@given(window=_windows)
def test_every_sample_lands_in_exactly_one_bin_that_fits(
    strategy: str, window: tuple[int, np.ndarray]
) -> None:
    seq_len, lengths = window
    bins = pack_lengths(lengths, seq_len, strategy)
    assert all(indices.size > 0 for indices in bins)
    assert all(fill <= seq_len for fill in _fills(lengths, bins))
    placed = np.concatenate(bins) if bins else np.array([], dtype=np.int64)
    np.testing.assert_array_equal(np.sort(placed), np.arange(len(lengths)))


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=150, deadline=None)
@given(window=_windows)
def test_no_bin_opens_while_an_open_bin_has_room(
    strategy: str, window: tuple[int, np.ndarray]
) -> None:
    # Bins only fill up, so a final fill plus a later bin's first item must still exceed seq_len.
    # next_fit keeps only the newest bin open; the others keep every bin open.
    seq_len, lengths = window
    bins = pack_lengths(lengths, seq_len, strategy)
    fills = _fills(lengths, bins)
    for later in range(1, len(bins)):
        first_item = int(lengths[bins[later][0]])
        earlier_bins = [later - 1] if strategy == "next_fit" else range(later)
        assert all(fills[earlier] + first_item > seq_len for earlier in earlier_bins)


@pytest.mark.parametrize("strategy", ["bfd", "ffd", "first_fit"])
@settings(max_examples=150, deadline=None)
@given(window=_windows)
def test_bin_count_between_lower_bound_and_next_fit(
    strategy: str, window: tuple[int, np.ndarray]
) -> None:
    # An any-fit strategy opens at most one bin per next_fit bin over the same order: once it opens
    # a bin for an item, the rest of that next_fit bin (smaller than the new bin's room) fits there.
    # Over a different order next_fit can win (scenario "next_fit_beats_bfd").
    seq_len, lengths = window
    num_bins = len(pack_lengths(lengths, seq_len, strategy))
    num_next_fit_bins = len(pack_lengths(_visit_order(lengths, strategy), seq_len, "next_fit"))
    assert math.ceil(lengths.sum() / seq_len) <= num_bins <= num_next_fit_bins


@settings(max_examples=200, deadline=None)
@given(window=_windows)
def test_bfd_matches_linear_scan_reference(window: tuple[int, np.ndarray]) -> None:
    seq_len, lengths = window
    bins = pack_lengths(lengths, seq_len, "bfd")
    assert [indices.tolist() for indices in bins] == _best_fit_decreasing_reference(
        lengths, seq_len
    )


# --- Rows: rows.assemble over StreamPacker packs
# ----------------------------------------------------------


def _documents(rows: dict[str, np.ndarray]) -> list[tuple[bytes, bytes]]:
    """Every (input_ids, labels) document of every row, padding excluded."""
    documents = []
    for row in range(len(rows["num_tokens"])):
        document_ids = rows["document_ids"][row]
        for document in range(rows["num_documents"][row]):
            in_document = document_ids == document
            documents.append(
                (
                    rows["input_ids"][row][in_document].tobytes(),
                    rows["labels"][row][in_document].tobytes(),
                )
            )
    return documents


def _check_rows(
    rows: dict[str, np.ndarray], input_ids: list[np.ndarray], labels: list[np.ndarray], seq_len: int
) -> None:
    num_rows = len(rows["num_tokens"])
    for name in ("input_ids", "labels", "position_ids", "document_ids"):
        assert rows[name].shape == (num_rows, seq_len) and rows[name].dtype == np.int32, name
    assert rows["num_documents"].dtype == rows["num_tokens"].dtype == np.int32

    # Nothing lost, nothing duplicated: each sample is exactly one document of one row.
    samples = [
        (ids.tobytes(), sample_labels.tobytes()) for ids, sample_labels in zip(input_ids, labels)
    ]
    assert sorted(_documents(rows)) == sorted(samples)
    tokens = rows["input_ids"][rows["input_ids"] != PAD_ID]
    np.testing.assert_array_equal(np.sort(tokens), np.sort(np.concatenate(input_ids)))
    assert rows["num_tokens"].sum() == sum(map(len, input_ids))

    # Padding: after num_tokens, pad_id and -100; it is one extra document.
    is_padding = np.arange(seq_len) >= rows["num_tokens"][:, None]
    assert (rows["input_ids"][is_padding] == PAD_ID).all()
    assert (rows["labels"][is_padding] == IGNORE_INDEX).all()
    has_padding = rows["num_tokens"] < seq_len
    np.testing.assert_array_equal(
        rows["document_ids"][:, -1], rows["num_documents"] - 1 + has_padding
    )

    # Labels never cross a document: a label predicts the next token of the same document.
    document_ids, position_ids = rows["document_ids"], rows["position_ids"]
    assert (rows["labels"][:, -1] == IGNORE_INDEX).all()
    has_label = rows["labels"][:, :-1] != IGNORE_INDEX
    assert (document_ids[:, :-1] == document_ids[:, 1:])[has_label].all()
    assert (rows["labels"][:, :-1] == rows["input_ids"][:, 1:])[has_label].all()

    # Document ids count up from 0; position ids restart at 0 with each document.
    assert (document_ids[:, 0] == 0).all() and (position_ids[:, 0] == 0).all()
    starts = np.diff(document_ids, axis=1)
    assert np.isin(starts, (0, 1)).all()
    np.testing.assert_array_equal(
        position_ids[:, 1:], np.where(starts == 1, 0, position_ids[:, :-1] + 1)
    )


def _stream(
    lengths: np.ndarray, seq_len: int, window: int, seed: int = 0, strategy: str = "bfd", **options
) -> tuple[list[list[np.ndarray]], StreamPacker]:
    """Push ``lengths`` (ids 0..n-1) window by window, then flush: the packs of each push."""
    packer = StreamPacker(seq_len, strategy, rng=np.random.default_rng(seed), **options)
    ids = np.arange(len(lengths))
    pushes = [
        packer.push(ids[start : start + window], lengths[start : start + window])
        for start in range(0, len(lengths), window)
    ]
    return pushes + [packer.flush()], packer


def _stream_rows(input_ids, labels, seq_len, seed=0, strategy="bfd", window=64):
    lengths = np.array([len(ids) for ids in input_ids])
    pushes, _ = _stream(lengths, seq_len, window, seed, strategy)
    return assemble_bins(input_ids, labels, [p for push in pushes for p in push], seq_len)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stream_rows_keep_the_data_contract(strategy: str) -> None:
    seq_len = 64
    input_ids, labels = random_window(np.random.default_rng(7), num_samples=300, seq_len=seq_len)
    rows = _stream_rows(input_ids, labels, seq_len, 1, strategy)
    assert (rows["num_documents"] >= 2).any(), "guard: no row packs several documents"
    assert (rows["num_tokens"] < seq_len).any(), "guard: no row is padded"
    assert (rows["num_tokens"] == seq_len).any(), "guard: no row is exactly full"
    _check_rows(rows, input_ids, labels, seq_len)


def test_stream_is_deterministic_per_seed() -> None:
    input_ids, labels = random_window(np.random.default_rng(3), num_samples=100, seq_len=32)
    first, again, other = (_stream_rows(input_ids, labels, 32, seed) for seed in (0, 0, 1))
    assert all(np.array_equal(first[name], again[name]) for name in first)
    assert not np.array_equal(first["input_ids"], other["input_ids"])


def test_stream_shuffles_packs_and_documents() -> None:
    # BFD alone opens rows longest sample first and places each row's longest document first.
    seq_len = 64
    input_ids, labels = random_window(np.random.default_rng(5), num_samples=300, seq_len=seq_len)
    rows = _stream_rows(input_ids, labels, seq_len, window=300)
    first_lengths = (rows["document_ids"] == 0).sum(axis=1)
    rows_and_sizes = zip(rows["document_ids"], rows["num_tokens"])
    longest_lengths = np.array(
        [np.bincount(row[:num_tokens]).max() for row, num_tokens in rows_and_sizes]
    )
    assert (first_lengths < longest_lengths).any(), "documents inside a row are not shuffled"
    assert (np.diff(first_lengths) > 0).any(), "rows come out in packing order"


# StreamPacker scenarios: seq_len 10, one sample per window, max_delay 1. Each entry: lengths, then
# the packs (sorted ids) emitted by each push and, last, by the flush.
STREAM_SCENARIOS = {
    # [6] alone is 60% full: it waits. Next window the waiting 6 is placed first and 4 completes it.
    "underfilled_pack_waits_and_is_completed": ([6, 4], [[], [[0, 1]], []]),
    # A full pack never waits; the lone 3 waits and leaves at the flush.
    "full_pack_is_emitted_at_once": ([10, 3], [[[0]], [], [[1]]]),
    # 6#0 waits one window; 6#1 does not fit with it, so #0 leaves as it is (its one window of wait
    # is used up) while #1 starts waiting, and so on; the flush emits the last one.
    "wait_is_bounded": ([6, 6, 6], [[], [[0]], [[1]], [[2]]]),
    # 7#0 waits; 5#1 does not fit with it: #0 leaves alone, #1 waits; 3#2 joins #1 (8 tokens, not
    # full), but #1 has waited its window, so they leave together.
    "late_sample_rides_with_a_waiting_one": ([7, 5, 3], [[], [[0]], [[1, 2]], []]),
}


@pytest.mark.parametrize("lengths,expected", STREAM_SCENARIOS.values(), ids=STREAM_SCENARIOS.keys())
def test_stream_scenarios(lengths: list[int], expected: list[list[list[int]]]) -> None:
    pushes, packer = _stream(np.array(lengths), SEQ_LEN, window=1)
    assert [sorted(sorted(p.tolist()) for p in push) for push in pushes] == expected
    assert packer.max_delay_seen == 1  # every scenario has a sample that waited one window


@settings(max_examples=150, deadline=None)
@given(
    strategy=st.sampled_from(list(STRATEGIES)),
    seq_len=st.integers(4, 40),
    window=st.integers(1, 12),
    max_delay=st.integers(0, 3),
    data=st.data(),
)
def test_stream_packer_properties(strategy, seq_len, window, max_delay, data) -> None:
    lengths = np.array(
        data.draw(st.lists(st.integers(1, seq_len), min_size=0, max_size=60)), dtype=np.int64
    )
    pushes, packer = _stream(lengths, seq_len, window, strategy=strategy, max_delay=max_delay)
    packs = [p for push in pushes for p in push]
    emitted = np.concatenate(packs) if packs else np.empty(0, dtype=np.int64)
    assert sorted(emitted.tolist()) == list(range(len(lengths)))  # none lost, none duplicated
    assert all(len(p) > 0 and lengths[p].sum() <= seq_len for p in packs)
    assert packer.max_delay_seen <= max_delay
    again, _ = _stream(lengths, seq_len, window, strategy=strategy, max_delay=max_delay)
    assert [[p.tolist() for p in push] for push in again] == [
        [p.tolist() for p in push] for push in pushes
    ]
    for number, push in enumerate(pushes[:-1]):  # each sample leaves within max_delay windows
        for pack_ids in push:
            arrived = pack_ids // window
            assert (number - arrived <= max_delay).all()


# --- Errors
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([3, 4, 0, 2], "Sample 2 has length 0"),
        ([3, 11, 2], "Sample 1 has length 11"),
    ],
)
def test_out_of_range_length_names_the_sample(lengths: list[int], message: str) -> None:
    for strategy in STRATEGIES:
        with pytest.raises(ValueError, match=message):
            pack_lengths(np.array(lengths), SEQ_LEN, strategy)


def test_stream_error_names_the_sample_in_the_window() -> None:
    packer = StreamPacker(SEQ_LEN, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="Sample 3 has length 12"):
        packer.push(np.arange(5), np.array([3, 4, 5, 12, 2]))


def test_unknown_strategy() -> None:
    with pytest.raises(ValueError, match="Unknown packing strategy 'worst_fit'; choose one of bfd"):
        pack_lengths(np.array([1, 2]), SEQ_LEN, "worst_fit")


# P8: a waiting sample is placed before the new window's samples
def test_waiting_sample_is_placed_first_in_the_next_window():
    packer = StreamPacker(10, rng=np.random.default_rng(0))
    assert packer.push(np.array([0]), np.array([1])) == []  # 10% full: waits
    emitted = packer.push(np.array([1, 2, 3]), np.array([1, 8, 2]))
    # placed first, #0 (1) opens the first bin; 8 joins it, then 1 completes it: [0, 1, 2] is
    # full; 2#3 waits. Placed with the others (8, 2, 1, 1) it would be [1|2] + [0, 3].
    assert [sorted(b.tolist()) for b in emitted] == [[0, 1, 2]]
    assert [sorted(b.tolist()) for b in packer.flush()] == [[3]]


# (warmup_tokens, seq_len, ranks) -> rows per block of the warm-up lane's packed rows
LANE_BLOCKS = {
    "default lane, 2 ranks": ((262_144, 2048, 2), 8),
    "default lane, 8 ranks": ((262_144, 2048, 8), 2),
    "long rows, 8 ranks": ((262_144, 8192, 8), 1),
    "lane under a row": ((1000, 2048, 1), 1),
}


@pytest.mark.parametrize("name", LANE_BLOCKS)
def test_the_lane_is_cut_so_an_equal_split_feeds_every_rank_at_once(name):
    """Ray's streaming_split(equal=True) hands a block to a rank only if the blocks left can even
    the ranks out: a lane of one or two blocks fed one rank while the others waited for the main
    window. At ``LANE_BLOCKS_PER_RANK`` blocks per rank every rank gets rows from the lane."""
    (tokens, seq_len, ranks), rows = LANE_BLOCKS[name]
    assert packer.lane_block_rows(tokens, seq_len, ranks) == rows
    blocks = [rows] * (max(1, tokens // seq_len) // rows)
    handed = [0] * ranks  # Ray's rule (OutputSplitter._can_safely_dispatch), block by block
    left = sum(blocks)
    for block in blocks:
        target = handed.index(min(handed))
        after = handed.copy()
        after[target] += block
        if left - block < sum(max(after) - n for n in after):
            break
        handed, left = after, left - block
    assert min(handed) > 0
