"""Mixing: exact shares by samples or tokens, repetition and subsampling, interleaving, seeds;
then the same properties end to end on real data through Ray."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from conftest import ALPACA, GPT2, GPTEACHER, HH_CHAT, ROOT
from rayjobs.config import ConfigError, config_from_dict
from rayjobs.data.mix import plan_epoch
from rayjobs.data.samples import TOKEN_LIST

RNG = np.random.default_rng(7)
LENGTHS = [RNG.integers(50, 400, 999), RNG.integers(100, 800, 2300), RNG.integers(20, 200, 1923)]
WEIGHTS = [0.5, 0.3, 0.2]


def _shares(dataset_ids, tokens, by):
    values = tokens if by == "tokens" else np.ones_like(tokens)
    return np.array([values[dataset_ids == d].sum() for d in range(3)]) / values.sum()


def _tokens(dataset_ids, sample_ids, lengths=LENGTHS):
    return np.array([lengths[d][i] for d, i in zip(dataset_ids, sample_ids)])


@pytest.mark.parametrize("by", ["tokens", "samples"])
def test_realized_shares_match_weights(by):
    dataset_ids, sample_ids = plan_epoch(LENGTHS, WEIGHTS, by=by)
    shares = _shares(dataset_ids, _tokens(dataset_ids, sample_ids), by)
    assert np.abs(shares - WEIGHTS).max() < 0.01
    other = _shares(
        dataset_ids, _tokens(dataset_ids, sample_ids), "samples" if by == "tokens" else "tokens"
    )
    assert np.abs(other - WEIGHTS).max() > 0.05, "guard: the two units really differ on this data"


def test_by_samples_counts_are_exact():
    # 5222 samples split 0.5 / 0.3 / 0.2 by largest remainder: 2611, 1566.6 → 1567, 1044.4 → 1044.
    dataset_ids, _ = plan_epoch(LENGTHS, WEIGHTS, by="samples")
    assert np.bincount(dataset_ids).tolist() == [2611, 1567, 1044]


def test_a_share_that_rounds_to_no_sample_leaves_its_dataset_out():
    """10 samples at weights 0.95 / 0.05: the second dataset's 0.5 sample rounds to none, the
    epoch is all the first's (largest remainder); it raised on an empty concatenation."""
    lengths = [np.full(100, 5), np.full(100, 5)]
    dataset_ids, sample_ids = plan_epoch(lengths, [0.95, 0.05], by="samples", epoch_samples=10)
    assert dataset_ids.tolist() == [0] * 10 and len(set(sample_ids.tolist())) == 10


@pytest.mark.parametrize(
    "by,size", [("samples", {"epoch_samples": 1000}), ("tokens", {"epoch_tokens": 200_000})]
)
def test_epoch_size(by, size):
    dataset_ids, sample_ids = plan_epoch(LENGTHS, WEIGHTS, by=by, **size)
    total = len(dataset_ids) if by == "samples" else _tokens(dataset_ids, sample_ids).sum()
    target = next(iter(size.values()))
    assert abs(total - target) <= (0 if by == "samples" else 3 * 800)


def test_small_dataset_with_large_weight_is_repeated_with_fresh_shuffles():
    lengths = [np.full(10, 100), np.full(1000, 100)]
    dataset_ids, sample_ids = plan_epoch(lengths, [0.5, 0.5], by="samples", epoch_samples=1000)
    small = sample_ids[dataset_ids == 0]  # a dataset's draws keep their order in the epoch
    assert np.bincount(small, minlength=10).tolist() == [50] * 10  # 50 whole passes
    first, second = small[:10], small[10:20]
    assert sorted(first) == sorted(second) == list(range(10))  # each pass is a permutation
    assert not np.array_equal(first, second), "passes are reshuffled"


def test_large_dataset_with_small_weight_is_subsampled_without_replacement():
    lengths = [np.full(10, 100), np.full(1000, 100)]
    dataset_ids, sample_ids = plan_epoch(lengths, [0.5, 0.5], by="samples", epoch_samples=20)
    big = sample_ids[dataset_ids == 1]
    assert len(big) == 10 and len(set(big.tolist())) == 10


def test_every_tenth_of_the_epoch_holds_every_dataset():
    dataset_ids, sample_ids = plan_epoch(LENGTHS, WEIGHTS, by="tokens")
    tokens = _tokens(dataset_ids, sample_ids)
    for tenth in np.array_split(np.arange(len(dataset_ids)), 10):
        shares = _shares(dataset_ids[tenth], tokens[tenth], "tokens")
        assert np.abs(shares - WEIGHTS).max() < 0.05
    first = dataset_ids[: len(dataset_ids) // 3]
    assert len(set(first.tolist())) == 3, "guard: not one dataset after another"


def test_seeded_and_different_each_epoch():
    a = plan_epoch(LENGTHS, WEIGHTS, seed=3, epoch=0)
    b = plan_epoch(LENGTHS, WEIGHTS, seed=3, epoch=0)
    c = plan_epoch(LENGTHS, WEIGHTS, seed=3, epoch=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[1], c[1])


def test_empty_dataset_cannot_be_mixed():
    with pytest.raises(ValueError, match="dataset 1 has no samples"):
        plan_epoch([np.array([3]), np.array([], dtype=np.int64)], [1, 1])


def _mix_config(by: str, **extra) -> dict:
    return {
        "datasets": [
            {"name": "alpaca", "source": str(ALPACA), "template": "alpaca", "weight": 0.5},
            {"name": "hh_chat", "source": str(HH_CHAT), "template": "chat", "weight": 0.3},
            {
                "name": "roleplay",
                "source": str(GPTEACHER),
                "template": "alpaca",
                "weight": 0.2,
                "column_map": {"output": "response"},
            },
        ],
        "tokenizer": {"path": str(GPT2)},
        # planned: exact shares; 15+ windows of 64 samples make tenths of the epoch
        "packing": {"mode": "planned", "seq_len": 1024, "window": 64},
        "mix": {"by": by, **extra},
    }


@pytest.mark.parametrize(
    "bad,key",
    [
        (
            {"mix": {"by": "tokens", "epoch_samples": 10}},
            "mix: epoch_samples does not apply",
        ),
        ({"mix": {"by": "words"}}, "mix.by"),
        (
            {"datasets": [{"name": "a", "source": str(ALPACA), "template": "alpaca", "weight": 0}]},
            "datasets.0.weight",
        ),
    ],
)
def test_bad_mix_config(bad, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        config_from_dict({**_mix_config("tokens"), **bad}, base_dir=ROOT)


def test_empty_file_is_refused_before_ray(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("[]\n")
    raw = _mix_config("tokens")
    raw["datasets"][0]["source"] = str(empty)
    with pytest.raises(
        ConfigError, match="datasets.0.source .dataset 'alpaca'.: every file is empty"
    ):
        config_from_dict(raw, base_dir=ROOT)


@pytest.fixture(scope="module")
def planned(ray_local):
    """A planned-mode job mixing three real datasets by tokens (by samples:
    ``test_realized_shares_match_weights``, on the planner alone)."""
    from rayjobs.job.pipeline import start_job

    return start_job(config_from_dict(_mix_config("tokens"), base_dir=ROOT), prefix="test")


@pytest.mark.e2e
def test_real_mix_shares_within_one_point(planned, ray_local):
    """The realized mix the run summary reports (``Job.mixes``: what the pack stage packed) is
    within one point of the weights, and counts every packed document."""
    rows = planned.epochs.packed(0).take_all()
    realized = planned.mixes(ray_local.get(planned.ledger.snapshot.remote()))[0]
    for name, weight in zip(("alpaca", "hh_chat", "roleplay"), WEIGHTS):
        assert abs(realized[name]["share"] - weight) <= 0.01, (name, realized)
    assert sum(int(r["num_documents"]) for r in rows) == sum(
        r["samples"] for r in realized.values()
    )


@pytest.mark.e2e
def test_an_epoch_consumed_twice_is_counted_once(planned, ray_local):
    """Planned mode's pack counts are exactly once, as stream mode's are (``test_faults``): each
    ``AssemblePacks`` call (one emission group) and ``ExpandPlan`` batch reports under its batch
    identity, so a group run again (an actor that died, or a user iterating an epoch's dataset
    twice, as an own loop over ``train_datasets()`` may) is not added again. Before the keys,
    the second pass doubled the epoch's packs, documents and tokens."""
    epochs, ledger = planned.epochs, planned.ledger
    plan = epochs.pack_plan(0)
    counts = []
    for _ in range(2):
        rows = epochs.packed(0).take_all()
        counts.append(ray_local.get(ledger.snapshot.remote()))
    first, second = (c["pack"][0] for c in counts)
    assert first["num_documents"] == len(plan["uid"]) == sum(r["num_documents"] for r in rows)
    assert first["num_packs"] == len(np.unique(plan["pack"])) == len(rows)
    assert second == {**first, "seconds": second["seconds"], "cpu_seconds": second["cpu_seconds"]}
    groups = len(np.unique(plan["group"]))
    assert groups >= 2  # guard: several emission groups, so several keyed reports
    assert counts[1]["repeated_reports"] - counts[0]["repeated_reports"] >= groups


@pytest.mark.e2e
def test_real_mix_is_interleaved_per_window(planned):
    """Real lengths, an epoch of 4x the data (tenths of ~600 samples, so one long sample does not
    swing a tenth's token shares): every tenth of the epoch is near the weights."""
    epochs = planned.epochs
    lengths = [lengths for _, lengths in epochs.samples]
    total = sum(int(x.sum()) for x in lengths)
    dataset_ids, sample_ids = plan_epoch(lengths, WEIGHTS, by="tokens", epoch_tokens=4 * total)
    tokens = _tokens(dataset_ids, sample_ids, lengths)
    window = epochs.config.packing.window
    windows = np.arange(len(dataset_ids)) // window
    assert windows.max() >= 9, "guard: enough windows to split into tenths"
    for tenth in np.array_split(np.unique(windows), 10):
        mine = np.isin(windows, tenth)
        shares = _shares(dataset_ids[mine], tokens[mine], "tokens")
        assert np.abs(shares - WEIGHTS).max() <= 0.05


@pytest.mark.e2e
def test_same_seed_same_packs_and_each_epoch_differs(planned, ray_local):
    """Planned mode's promise: the same seed gives the same packs, from a fresh tokenization
    too. Compared on the pack plans (which sample, by uid, goes to which pack and slot): rows are
    assembled from the plan by ``AssemblePacks``, whose output the other tests here check."""
    from rayjobs.job.pipeline import start_job

    epochs = planned.epochs

    def packs(plan):
        order = np.lexsort((plan["slot"], plan["pack"]))
        uids, starts = plan["uid"][order], np.flatnonzero(np.diff(plan["pack"][order], prepend=-1))
        return sorted(tuple(pack) for pack in np.split(uids, starts[1:]))

    first = packs(epochs.pack_plan(0))
    assert len(first) > 100, "guard: a real epoch of packs"
    again = packs(start_job(epochs.config).epochs.pack_plan(0))  # a fresh tokenization and plan
    assert first == again
    assert packs(epochs.pack_plan(1)) != first


# X1: no weights: every sample once, by either unit
@pytest.mark.parametrize("by", ["tokens", "samples"])
def test_natural_proportions_take_every_sample_once(by):
    dataset_ids, sample_ids = plan_epoch(LENGTHS, None, by=by)
    assert np.bincount(dataset_ids).tolist() == [999, 2300, 1923]
    for d in range(3):
        assert sorted(sample_ids[dataset_ids == d].tolist()) == list(range(len(LENGTHS[d])))


# X4: by tokens, the prefix closest to the target is taken
def test_by_tokens_takes_the_closest_prefix():
    lengths = [np.full(10, 100), np.full(10, 100)]
    dataset_ids, _ = plan_epoch(lengths, [0.5, 0.5], by="tokens", epoch_tokens=1020)
    assert np.bincount(dataset_ids).tolist() == [5, 5]  # 510 each: 500 is closer than 600


# X5 / X6: each epoch draws other samples and orders the datasets anew
def test_each_epoch_draws_and_orders_anew():
    # by samples: both epochs hold exactly 500 / 300 / 200 samples, so only the order keys differ
    a = plan_epoch(LENGTHS, WEIGHTS, by="samples", seed=3, epoch=0, epoch_samples=1000)
    c = plan_epoch(LENGTHS, WEIGHTS, by="samples", seed=3, epoch=1, epoch_samples=1000)
    assert not np.array_equal(a[0], c[0]), "the interleaving (mix_order) is the same"
    assert set(a[1][a[0] == 1].tolist()) != set(c[1][c[0] == 1].tolist()), "same subsample"


def test_each_epoch_draws_anew_by_tokens():
    a = plan_epoch(LENGTHS, WEIGHTS, by="tokens", seed=3, epoch=0, epoch_tokens=100_000)
    c = plan_epoch(LENGTHS, WEIGHTS, by="tokens", seed=3, epoch=1, epoch_tokens=100_000)
    assert set(a[1][a[0] == 1].tolist()) != set(c[1][c[0] == 1].tolist()), "same subsample"


# -- guards a mutation run found missing: ``Epochs`` in-process, on stand-in samples


class _Tokenized:
    """Stands in for the tokenized Ray dataset: what ``Epochs`` pulls from it."""

    def __init__(self, table: pa.Table):
        self.table = table

    def materialize(self):
        return self

    def set_name(self, name):
        self.name = name

    def select_columns(self, columns):
        return _Tokenized(self.table.select(columns))

    def to_arrow_refs(self):
        return [self.table]


def _samples(counts=(10, 7, 5)) -> pa.Table:
    """``counts`` tokenized samples (source, uid, num_tokens) of each of ``_mix_config``'s
    datasets, 5 to 40 tokens long."""
    rng = np.random.default_rng(0)
    names = [d["name"] for d in _mix_config("tokens")["datasets"]]
    sources = [name for name, n in zip(names, counts) for _ in range(n)]
    return pa.table(
        {
            "source": sources,
            "uid": rng.permutation(10_000)[: len(sources)].astype(np.int64),
            "num_tokens": rng.integers(5, 40, len(sources)),
        }
    )


def _epochs(samples: pa.Table, ledger, window: int = 4):
    """Planned mode over ``samples``, without weights, in rows of 64 tokens (``ledger``: the
    ``fake_ledger`` fixture, whose ``ray.get`` hands the stand-in's table through)."""
    from rayjobs.data.planned import Epochs

    raw = _mix_config("tokens")
    for spec in raw["datasets"]:
        del spec["weight"]
    raw["packing"] = {"mode": "planned", "seq_len": 64, "window": window}
    config = config_from_dict(raw, base_dir=ROOT)
    return Epochs(config, _Tokenized(samples), pad_id=0, ledger=ledger)


def test_planned_mode_without_weights_packs_every_sample_once(fake_ledger):
    samples = _samples()
    plan = _epochs(samples, fake_ledger).pack_plan(0)
    assert len(np.unique(plan["group"])) >= 3, "guard: packs emitted over several windows"
    assert sorted(plan["uid"].tolist()) == sorted(samples["uid"].to_pylist())
    length = dict(zip(samples["uid"].to_pylist(), samples["num_tokens"].to_pylist()))
    assert np.bincount(plan["pack"], weights=[length[u] for u in plan["uid"]]).max() <= 64


def test_two_samples_with_one_uid_are_refused(fake_ledger):
    samples = _samples()
    uids = samples["uid"].to_numpy().copy()
    uids[3] = uids[12]
    with pytest.raises(ValueError, match="two samples share a uid"):
        _epochs(samples.set_column(1, "uid", pa.array(uids)), fake_ledger)


def test_a_dataset_left_without_samples_is_a_config_error(fake_ledger):
    """Every row of a dataset skipped or dropped: a ``ConfigError`` naming it, not the
    planner's bare ``ValueError``."""
    with pytest.raises(ConfigError, match="dataset 'hh_chat' has no samples after tokenization"):
        _epochs(_samples(counts=(10, 0, 5)), fake_ledger)


def test_max_delay_is_the_largest_over_the_epochs_planned(fake_ledger):
    epochs = _epochs(_samples(), fake_ledger)
    delays = iter([2, 0])
    epochs._pack_plan = lambda epoch: ({"pack": np.zeros(0, np.int64)}, next(delays))
    epochs.pack_plan(0), epochs.pack_plan(1)
    assert epochs.max_delay_windows == 2


def test_planned_mode_orders_each_epoch_anew(fake_ledger):
    """``Epochs.plan`` plans the epoch it is asked for (the end-to-end check that epochs differ,
    ``test_same_seed_same_packs_and_each_epoch_differs``, is met by the pack shuffle alone)."""
    epochs = _epochs(_samples(counts=(30, 30, 30)), fake_ledger)
    first, second = epochs._occurrences(0)[0], epochs._occurrences(1)[0]
    assert sorted(first.tolist()) == sorted(second.tolist()), "guard: every sample, each epoch"
    assert not np.array_equal(first, second)


def test_the_pack_shuffle_is_drawn_anew_each_epoch(fake_ledger):
    """Two epochs of the same occurrences in the same order still get other packs."""
    epochs = _epochs(_samples(counts=(30, 30, 30)), fake_ledger, window=16)
    fixed = epochs.plan(0)
    epochs.plan = lambda epoch: fixed
    a, b = epochs.pack_plan(0), epochs.pack_plan(1)
    assert np.array_equal(a["uid"], b["uid"])
    assert not (np.array_equal(a["pack"], b["pack"]) and np.array_equal(a["slot"], b["slot"]))


def test_a_packs_documents_are_assembled_in_slot_order():
    """``AssemblePacks`` orders a group's samples by pack, then slot, whatever order the groupby
    hands them over in."""
    from rayjobs.data.planned import AssemblePacks

    docs = {(0, 0): [1, 2], (0, 1): [3, 4, 5], (0, 2): [6], (1, 0): [7, 8], (1, 1): [9]}
    order = [(0, 2), (1, 1), (0, 0), (1, 0), (0, 1)]
    batch = pa.table(
        {
            "pack": [pack for pack, _ in order],
            "slot": [slot for _, slot in order],
            "group": [0] * len(order),
            "source": ["alpaca"] * len(order),
            "num_tokens": [len(docs[k]) for k in order],
            "input_ids": pa.array([docs[k] for k in order], TOKEN_LIST),
            "labels": pa.array([docs[k] for k in order], TOKEN_LIST),
        }
    )
    rows = AssemblePacks(seq_len=8, pad_id=0)(batch)
    assert np.asarray(rows["input_ids"]).tolist() == [
        [1, 2, 3, 4, 5, 6, 0, 0],
        [7, 8, 9, 0, 0, 0, 0, 0],
    ]
