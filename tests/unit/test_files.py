"""Where files live (``rayjobs.data.files``) and how a read task survives its store: globs and
prefixes matched as ``glob`` matches them, a file's place in its dataset the same on disk and in a
bucket, errors said for a person without secrets, and a read that a dropped connection interrupts
retried without a row twice, or failed with dataset, URI and row, never cut short."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pytest

from rayjobs.data import files, sources
from rayjobs.data.files import common_root, place
from rayjobs.data.sources import FileRead, read_files
from rayjobs.errors import SourceError

GLOBS = {
    # pattern: (matches, does not match)
    "data/*.jsonl": (["data/a.jsonl"], ["data/x/a.jsonl", "data/a.json", "other/a.jsonl"]),
    "data/**/*.jsonl": (["data/a.jsonl", "data/x/y/a.jsonl"], ["data/a.jsonl.gz", "d/a.jsonl"]),
    "data/shard-0?.parquet": (["data/shard-01.parquet"], ["data/shard-1.parquet"]),
    "data/[ab].csv": (["data/a.csv", "data/b.csv"], ["data/c.csv"]),
    "**/train-*": (["train-1", "x/y/train-2.gz"], ["x/test-1"]),
}


@pytest.mark.parametrize("pattern", GLOBS)
def test_a_glob_matches_as_glob_does_across_folders_only_with_two_stars(pattern):
    import re

    regex = re.compile(files._glob_regex(pattern))
    matches, others = GLOBS[pattern]
    assert [bool(regex.fullmatch(p)) for p in matches] == [True] * len(matches)
    assert [bool(regex.fullmatch(p)) for p in others] == [False] * len(others)


PLACES = [
    # files, a file, its place
    (["s3://bucket/d/a.jsonl", "s3://bucket/d/x/b.jsonl"], "s3://bucket/d/x/b.jsonl", "x/b.jsonl"),
    (["/data/d/a.jsonl", "/data/d/x/b.jsonl"], "/data/d/x/b.jsonl", "x/b.jsonl"),
    (["gs://b/one.parquet"], "gs://b/one.parquet", "one.parquet"),
]


@pytest.mark.parametrize("paths, path, expected", PLACES)
def test_a_files_place_in_its_dataset_is_the_same_in_a_bucket_and_on_disk(paths, path, expected):
    """What sample uids and subsamples hash: the same data gets the same wherever it lies."""
    assert place(path, common_root(paths)) == expected


def test_messages_never_show_a_secret_put_into_a_uri():
    assert files.shown("s3://key:secret@bucket/x.jsonl") == "s3://bucket/x.jsonl"
    assert files.shown("s3://bucket/x.jsonl") == "s3://bucket/x.jsonl"


EXPLAINED = {
    "AWS Error ACCESS_DENIED during HeadObject operation: No response body.": "access denied",
    "AWS Error INVALID_ACCESS_KEY_ID during ListObjectsV2 operation": "access denied",
    "AWS Error NO_SUCH_BUCKET during ListObjectsV2 operation": "no such bucket",
    "curlCode: 7, Couldn't connect to server": "curlCode: 7, Couldn't connect to server",
}


@pytest.mark.parametrize("raised, said", EXPLAINED.items())
def test_store_errors_are_said_for_a_person_with_the_uri(raised, said):
    message = files.explain(OSError(raised), "s3://bucket/x.jsonl")
    assert message.startswith("s3://bucket/x.jsonl: " + said)


def test_an_unknown_scheme_is_refused_naming_the_schemes_there_are():
    with pytest.raises(files.StorageError, match=r"ftp://h/x.jsonl: unknown scheme 'ftp'; .*s3://"):
        files.filesystem("ftp://h/x.jsonl")


# ---- a read task against a store that drops its connection ------------------------------------

ROWS = [{"text": f"row {i} " + "x" * 40} for i in range(5000)]
DATA = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
OPTIONS = {"format": "jsonl", "dataset": "d", "text_split": "paragraph", "chunk_bytes": 1024}


class _Dropping(io.RawIOBase):
    """A file whose stream fails (``error``) or just ends (``error`` None) after ``cut`` bytes."""

    def __init__(self, data: bytes, cut: int, error: str | None):
        super().__init__()
        self.data, self.cut, self.error, self.at = data, cut, error, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        size = len(self.data) if size is None or size < 0 else size
        if self.at >= self.cut:
            if self.error:
                raise OSError(self.error)
            return b""
        piece = self.data[self.at : min(self.at + size, self.cut)]
        self.at += len(piece)
        return piece

    def tell(self) -> int:
        return self.at


def _opener(failures: list[tuple[int, str | None]]):
    """``sources.open_file`` for the read task: the first opens drop as ``failures`` says, the
    rest serve the whole file."""
    opened = []

    def open_file(uri, random_access, options=None, size=None):
        cut, error = failures[len(opened)] if len(opened) < len(failures) else (len(DATA), None)
        opened.append(uri)
        raw = pa.PythonFile(_Dropping(DATA, cut, error), mode="r")
        return pa.PythonFile(files._Whole(raw, size, uri), mode="r"), raw

    return open_file, opened


def _rows(tables) -> list[int]:
    return [row for table in tables for row in table.column("_row").to_pylist()]


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr(sources, "RETRY_SECONDS", 0.0)


def test_a_dropped_connection_is_retried_and_no_row_comes_twice(monkeypatch):
    dropped = "AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56"
    open_file, opened = _opener([(100_000, dropped), (200_000, dropped)])
    monkeypatch.setattr(sources, "open_file", open_file)
    rows = _rows(read_files([FileRead("s3://b/x.jsonl")], OPTIONS, {"s3://b/x.jsonl": len(DATA)}))
    assert len(opened) == 3  # guard: two drops, mid-file, then a whole read
    assert rows == list(range(1, len(ROWS) + 1))  # every line once, in order


def test_a_stream_cut_short_without_an_error_is_caught_not_trained_on(monkeypatch):
    """A store can end a stream early without an error: the bytes read are held against the
    listed size, retried, and in the end the read fails naming dataset, file and row."""
    open_file, opened = _opener([(100_000, None)] * sources.READ_ATTEMPTS)
    monkeypatch.setattr(sources, "open_file", open_file)
    with pytest.raises(SourceError) as caught:
        list(read_files([FileRead("s3://b/x.jsonl")], OPTIONS, {"s3://b/x.jsonl": len(DATA)}))
    assert len(opened) == sources.READ_ATTEMPTS
    # rows leave a read task in blocks of 1024 (sources._BLOCK_ROWS): the last one before the cut
    emitted = DATA[:100_000].count(b"\n") // 1024 * 1024
    assert emitted >= 1024, "guard: rows were emitted before the stream ended"
    assert str(caught.value) == (
        f"dataset 'd': reading after row {emitted} failed: s3://b/x.jsonl: the stream ended "
        f"after 100,000 of {len(DATA):,} bytes (connection lost)"
    )


def test_access_denied_is_not_retried(monkeypatch):
    open_file, opened = _opener([(0, "AWS Error ACCESS_DENIED during GetObject operation")])
    monkeypatch.setattr(sources, "open_file", open_file)
    with pytest.raises(SourceError, match=r"dataset 'd': reading failed: s3://b/x.jsonl: access"):
        list(read_files([FileRead("s3://b/x.jsonl")], OPTIONS, {"s3://b/x.jsonl": len(DATA)}))
    assert len(opened) == 1
