"""Data on object storage: the bundled sets in a real S3-protocol server on loopback (moto, IAM
enforced), named by ``s3://`` URIs with credentials and endpoint from the standard environment.
Read tasks open their own files (the driver parses heads only), the same files give the same
counts and packs from the bucket as from the disk, exports write to the bucket, and a wrong
bucket, key, credential or scheme is refused before Ray starts, naming the dataset and URI."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from conftest import ALPACA, GPT2, HH_CHAT, ROOT, shutdown_shared_ray, start_shared_ray
from rayjobs.cli import main
from rayjobs.config import config_from_dict, load_config
from rayjobs.data import backends, estimate, files
from rayjobs.data.formats import registry
from rayjobs.errors import ConfigError
from support.s3 import Reads, counted, s3_server

BUCKET = "corpora"


def _layout(folder) -> dict[str, bytes]:
    """The files both sides hold, by relative path: a JSONL shard set (two plain, one gzipped),
    and Alpaca as Parquet."""
    chat = HH_CHAT.read_bytes().splitlines(keepends=True)
    alpaca = json.loads(ALPACA.read_text())
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(alpaca), sink, row_group_size=100)
    return {
        "chat/part-0.jsonl": b"".join(chat[:150]),
        "chat/part-1.jsonl": b"".join(chat[150:300]),
        "chat/part-2.jsonl.gz": gzip.compress(b"".join(chat[300:]), mtime=0),
        "sft/alpaca.parquet": sink.getvalue().to_pybytes(),
    }


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(the S3 server, the local folder holding the same files). The environment points this
    process's S3 clients at the server."""
    local = tmp_path_factory.mktemp("local")
    with s3_server() as s3:
        for relative, data in _layout(local).items():
            (local / relative).parent.mkdir(parents=True, exist_ok=True)
            (local / relative).write_bytes(data)
            s3.put(f"{BUCKET}/{relative}", data)
        saved = {key: os.environ.get(key) for key in s3.env}
        os.environ.update(s3.env)
        try:
            yield s3, local
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture
def ray_with_store(stores):
    """The shared Ray, restarted so that its workers get the store's environment as a job's
    runtime_env gives it (on a cluster: each node's own, or ``env_vars``), and again after."""
    shutdown_shared_ray()
    yield start_shared_ray(stores[0].env)
    shutdown_shared_ray()


def _config(root: str, **packing):
    return config_from_dict(
        {
            "datasets": [
                {"name": "chat", "source": f"{root}/chat/", "template": "chat"},
                {"name": "alpaca", "source": f"{root}/sft/*.parquet", "template": "alpaca"},
            ],
            "tokenizer": {"path": str(GPT2)},
            "packing": {"seq_len": 512, "mode": "planned", "window": 512, **packing},
            "train": {"epochs": 1},
            "ray": {"min_actors": 1, "tokenize_concurrency": 1},
        }
    )


def test_uris_resolve_on_the_store_as_paths_do_on_disk(stores):
    s3, local = stores
    remote, disk = _config(f"s3://{BUCKET}"), _config(str(local))
    for got, expected in zip(remote.datasets, disk.datasets, strict=True):
        assert [f.removeprefix(f"s3://{BUCKET}/") for f in got.files] == [
            os.path.relpath(f, local) for f in expected.files
        ]
        assert got.format == expected.format
    assert remote.datasets[0].files[-1] == f"s3://{BUCKET}/chat/part-2.jsonl.gz"
    globbed = config_from_dict(
        {
            "datasets": [
                {"name": "d", "source": f"s3://{BUCKET}/**/part-?.jsonl", "template": "chat"}
            ],
            "tokenizer": {"path": str(GPT2)},
        }
    ).datasets[0]
    assert globbed.files == (f"s3://{BUCKET}/chat/part-0.jsonl", f"s3://{BUCKET}/chat/part-1.jsonl")


def _written(config, tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config))
    return str(path)


def _raw(source: str) -> dict:
    return {
        "datasets": [{"name": "chat", "source": source, "template": "chat"}],
        "tokenizer": {"path": str(GPT2)},
    }


REFUSED = {
    # name: (source, environment changes, what the one line says besides dataset and URI)
    "missing_bucket": ("s3://no-such-bucket/chat/part-0.jsonl", {}, "no such bucket"),
    "missing_key": (f"s3://{BUCKET}/chat/part-9.jsonl", {}, "no file matches"),
    "wrong_credentials": (
        f"s3://{BUCKET}/chat/",
        {"AWS_SECRET_ACCESS_KEY": "not-the-secret"},
        "access denied",
    ),
    "unknown_scheme": ("ftp://example.com/chat.jsonl", {}, "unknown scheme 'ftp'"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_source_that_cannot_be_read_is_refused_before_ray_starts(
    stores, case, tmp_path, monkeypatch, capsys
):
    source, env, said = REFUSED[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = _written(_raw(source), tmp_path, case)
    assert main(["export", config, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayjobs: datasets.0.source (dataset 'chat'): ") and "\n" not in err
    assert source in err and said in err
    assert "not-the-secret" not in err
    assert not (tmp_path / "out").exists()


def _counting(monkeypatch) -> Reads:
    """Every byte this process (the driver) reads from the store, by key: each filesystem the
    product resolves for a URI (``files.filesystem``: the estimates' head parse, column checks,
    listings, sizes, manifests) counts what is read from the files it opens, streamed or ranged."""
    reads, real = Reads(), files.filesystem

    def counting(source, options=None):
        fs, path = real(source, options)
        return (counted(fs, reads) if files.is_remote(source) else fs), path

    monkeypatch.setattr(files, "filesystem", counting)
    return reads


def _heads_only(reads: Reads, local) -> None:
    """What each opening of a file read, checked to be a head: only the first file of each
    dataset is opened (once per head parse: the estimates', the column check's, the tokenizer
    backend's), each time the JSONL shard below half of it, the Parquet file its footer and
    first row group, below its size; no other data file is opened at all."""
    opened = {key.removeprefix(f"{BUCKET}/"): counts for key, counts in reads.opened.items()
              if not key.startswith(f"{BUCKET}/exports/")}  # fmt: skip
    assert set(opened) == {"chat/part-0.jsonl", "sft/alpaca.parquet"}
    for key, counts in opened.items():
        bound = (local / key).stat().st_size / (1 if key.endswith(".parquet") else 2)
        assert counts and all(0 < count < bound for count in counts), (key, counts, bound)


def test_the_driver_parses_only_the_head_of_each_datasets_first_file(stores, monkeypatch):
    """Streaming starts from estimates: the driver parses a bounded head of each dataset's
    first file, a part at a time; every other byte is a read task's."""
    s3, local = stores
    monkeypatch.setattr(estimate, "SAMPLE_ROWS", 40)
    monkeypatch.setattr(registry, "CHUNK_BYTES", 4096)  # a part of the head at a time
    monkeypatch.setattr(files, "STREAM_BUFFER_BYTES", 4096)  # and fetched (1 MiB: a big file's)
    config = _config(f"s3://{BUCKET}", mode="stream")
    reads = _counting(monkeypatch)
    found = estimate.estimate(config)
    assert found["chat"].mean_tokens > 0 and found["alpaca"].mean_tokens > 0
    _heads_only(reads, local)


@pytest.mark.e2e
def test_the_bucket_gives_the_disks_counts_and_packs_and_exports_into_a_bucket(
    stores, ray_with_store, tmp_path, monkeypatch
):
    """The same files, one side read from the bucket and exported into it, the other from the
    disk to a folder: the same per-dataset counts and the same packed rows for the same seed
    (planned mode packs deterministically), every row read by read tasks: the driver opens only
    the head of each dataset's first file, whose columns it holds against the template."""
    from rayjobs.job.export import export

    s3, local = stores
    monkeypatch.setattr(estimate, "COLUMN_ROWS", 40)
    monkeypatch.setattr(backends, "HEAD_ROWS", 40)  # the rows tokenizer.backend auto compares
    monkeypatch.setattr(registry, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(files, "STREAM_BUFFER_BYTES", 4096)
    config = _config(f"s3://{BUCKET}")
    reads = _counting(monkeypatch)
    remote = export(config, f"s3://{BUCKET}/exports/run-1")
    _heads_only(reads, local)  # planned mode: no estimates; read tasks read every file
    disk = export(_config(str(local)), tmp_path / "local")

    assert remote["datasets"]["chat"]["rows"] == 400 and remote["datasets"]["alpaca"]["rows"] > 0
    assert remote["packed"]["num_packs"] > 0 and disk["datasets"].keys() == {"chat", "alpaca"}

    # the manifests, as written: the same counts, mix, packs and config but for paths and timers
    fs = s3.filesystem()
    manifest = json.loads(fs.open_input_file(f"{BUCKET}/exports/run-1/_manifest.json").read())
    local_manifest = json.loads((tmp_path / "local" / "_manifest.json").read_text())
    # the manifest's local paths are relative to the folder the export ran in
    local_root = os.path.relpath(local)
    assert _comparable(manifest, f"s3://{BUCKET}") == _comparable(local_manifest, local_root)
    assert [e["path"] for e in manifest["epochs"]] == ["train"]
    for entry in manifest["epochs"]:
        from_bucket = pq.read_table(f"{BUCKET}/exports/run-1/{entry['path']}", filesystem=fs)
        from_disk = pq.read_table(tmp_path / "local" / entry["path"])
        assert from_bucket.schema == from_disk.schema
        assert from_bucket.num_rows == from_disk.num_rows > 0
        assert _sorted_rows(from_bucket) == _sorted_rows(from_disk)  # order follows the write


TIMERS = ("seconds", "cpu_seconds", "plan_seconds")
"""What two exports of the same rows legitimately differ in besides where their files are."""


def _comparable(manifest, root: str):
    """``manifest`` without its timers (``TIMERS``, at any depth), each dataset's ``source`` and
    ``files`` named relative to ``root``: the bucket or the folder holding the same files."""
    if isinstance(manifest, dict):
        return {
            key: value.removeprefix(root) if key == "source"
            else [f.removeprefix(root) for f in value] if key == "files"
            else _comparable(value, root)
            for key, value in manifest.items() if key not in TIMERS
        }  # fmt: skip
    if isinstance(manifest, list):
        return [_comparable(value, root) for value in manifest]
    return manifest


def _sorted_rows(table: pa.Table) -> list[str]:
    """Every row, all columns, as canonical JSON, sorted: the same for the same rows written in
    any order."""
    return sorted(json.dumps(row, sort_keys=True) for row in table.to_pylist())


def test_a_read_that_loses_its_server_fails_naming_dataset_uri_and_row(tmp_path, monkeypatch):
    """A server stopped mid-read: the read task retries, then fails with the dataset, the URI
    and the last row it emitted; it never ends quietly with the rows read so far."""
    from rayjobs.data import sources
    from rayjobs.data.sources import FileRead, read_files
    from rayjobs.errors import SourceError

    monkeypatch.setattr(sources, "RETRY_SECONDS", 0.01)
    # the AWS SDK's own retries of each request, with their back-off (seconds each), once here
    standard = pafs.AwsStandardS3RetryStrategy
    monkeypatch.setattr(pafs, "AwsStandardS3RetryStrategy", lambda max_attempts: standard(1))
    rows = [{"text": f"line {i} " + "y" * 200} for i in range(20_000)]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    with s3_server() as s3:
        s3.put("flaky/big.jsonl", data)
        for key, value in s3.env.items():
            monkeypatch.setenv(key, value)
        uri = "s3://flaky/big.jsonl"
        options = {"format": "jsonl", "dataset": "big", "text_split": "paragraph",
                   "chunk_bytes": 64 * 1024}  # fmt: skip
        tables = read_files([FileRead(uri)], options, {uri: len(data)})
        first = next(tables)  # the read has begun
    # the server is gone
    with pytest.raises(SourceError) as caught:
        for _ in tables:
            pass
    message = str(caught.value)
    assert message.startswith("dataset 'big': reading after row ") and uri in message
    assert first.num_rows > 0


def test_the_shipped_object_storage_config_loads_from_a_bucket_of_the_bundled_files(stores):
    """configs/alpaca_chat_s3.yaml, its data uploaded as its header says, to a bucket named as
    it names it."""
    s3, _ = stores
    s3.put("your-bucket/rayjobs/alpaca/alpaca_en_demo.json", ALPACA.read_bytes())
    s3.put("your-bucket/rayjobs/chat/hh.jsonl", HH_CHAT.read_bytes())
    config = load_config(ROOT / "configs" / "alpaca_chat_s3.yaml")
    assert [d.files for d in config.datasets] == [
        ("s3://your-bucket/rayjobs/alpaca/alpaca_en_demo.json",),
        ("s3://your-bucket/rayjobs/chat/hh.jsonl",),
    ]


def test_a_remote_source_that_matches_nothing_is_refused_naming_it(stores):
    with pytest.raises(ConfigError, match=rf"no file matches s3://{BUCKET}/nothing/\*\.jsonl"):
        config_from_dict(_raw(f"s3://{BUCKET}/nothing/*.jsonl"))


def test_inspect_limit_cuts_a_file_in_the_bucket_into_a_local_copy(stores, tmp_path):
    """``inspect --limit``: the first rows of each dataset, the file holding the limit cut into a
    local copy read from the bucket as a read task reads it (the gzipped shard, decompressed)."""
    from rayjobs.job.limit import limit_config

    config = _config(f"s3://{BUCKET}")
    limited = limit_config(config, 310, tmp_path).datasets[0]
    assert limited.files[:2] == config.datasets[0].files[:2]  # whole: 150 + 150 rows
    copy = limited.files[2]
    assert not copy.startswith("s3://") and copy.endswith("part-2.jsonl")
    assert len(Path(copy).read_bytes().splitlines()) == 10


def test_an_export_prefix_is_finished_by_its_manifest_and_leftovers_are_cleared(stores):
    """No rename on a store: a prefix of export-shaped entries without ``manifest.json`` is an
    interrupted export's, which readers refuse and the next export clears without
    --overwrite; a finished one (its manifest there) needs --overwrite, which deletes it."""
    from rayjobs.job.export import prepare_out
    from rayjobs.job.manifest import MANIFEST, require_finished

    s3, _ = stores
    fs = s3.filesystem()

    def listed(prefix):
        found = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True,
                                                   allow_not_found=True))  # fmt: skip
        return sorted(i.path.split(f"{prefix}/", 1)[1] for i in found if i.type.name == "File")

    left = ["_validation/part-0.parquet", "train/part-0.parquet", "train/part-1.parquet"]
    for key in left:
        s3.put(f"{BUCKET}/left/{key}", b"PAR1")
    assert listed("left") == left  # guard: the leftovers are there
    with pytest.raises(ConfigError, match=f"s3://{BUCKET}/left is not a finished export"):
        require_finished(f"s3://{BUCKET}/left")
    target = prepare_out(f"s3://{BUCKET}/left")
    assert target.writing == target.out == f"{BUCKET}/left" and listed("left") == []

    for key in [*left, MANIFEST]:
        s3.put(f"{BUCKET}/done/{key}", b"{}")
    require_finished(f"s3://{BUCKET}/done")
    with pytest.raises(ConfigError, match="is not empty; .* pass --overwrite"):
        prepare_out(f"s3://{BUCKET}/done")
    assert listed("done") == sorted([*left, MANIFEST])
    prepare_out(f"s3://{BUCKET}/done", overwrite=True)
    assert listed("done") == []
