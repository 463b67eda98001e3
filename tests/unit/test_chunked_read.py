"""Bounded-memory reading: a file read in parts of a few bytes gives exactly what the whole file
gives (the read task's path, ``sources.read_tables``, against ``conftest.file_tables`` on the bytes,
one part): the same raw-row tables (rows, records, row numbers, ``_skip`` reasons, block by block)
under ``on_bad_row: skip``, the same error under ``error``. On the bundled real files and on small
bad files read at every chunk size up to their length, so that every byte boundary falls inside a
line, a multi-byte character, a CRLF, a BOM, a paragraph, a CSV quote or a JSON number. Without Ray:
the last test runs the datasource's own file opening (Parquet's random access included) in-process;
``test_sources`` reads through Ray, and ``python -m rayjobs.bench.read`` a 1 GiB file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from conftest import ALPACA, DATA, GPTEACHER, HH_CHAT, SHAKESPEARE, SHAREGPT, file_tables
from rayjobs.data.formats import BOM, csv_rows, parse_rows, read_rows
from rayjobs.data.sources import read_tables
from rayjobs.errors import SourceError


class CountingFile(io.BytesIO):
    """A file that counts the reads that returned bytes and the most bytes one returned."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.reads, self.largest = 0, 0

    def read(self, size=-1, /):
        data = super().read(size)
        self.reads += bool(data)
        self.largest = max(self.largest, len(data))
        return data


class CountingStream:
    """A file that counts its reads that returned bytes (everything else: the file's own)."""

    def __init__(self, file):
        self.file, self.reads = file, 0

    def read(self, size=-1, /):
        data = self.file.read(size)
        self.reads += bool(data)
        return data

    def __getattr__(self, name):
        return getattr(self.file, name)


def _outcome(tables) -> tuple:
    """("ok", [table as columns, ...]) or ("error", type, message)."""
    try:
        return ("ok", [table.to_pydict() for table in tables])
    except Exception as error:
        return ("error", type(error).__name__, str(error))


def _assert_same(data: bytes, fmt: str, chunk_bytes: int, **options) -> tuple:
    """Chunked and whole reading agree under both policies; the whole outcome under skip."""
    outcomes = {}
    for on_bad_row in ("skip", "error"):
        kw = dict(format=fmt, dataset="d", on_bad_row=on_bad_row, **options)
        whole = _outcome(file_tables(data, "f", **kw))
        file = CountingFile(data)
        parts = _outcome(read_tables(file, "f", chunk_bytes=chunk_bytes, **kw))
        assert parts == whole, (fmt, on_bad_row, chunk_bytes, data)
        outcomes[on_bad_row] = whole
    return outcomes["skip"]


def _every_chunk_size(data: bytes, fmt: str, up_to: int | None = None, **options) -> tuple:
    """:func:`_assert_same` at every chunk size from 1 byte to the whole file (or ``up_to``)."""
    for chunk_bytes in [*range(1, min(len(data), up_to or len(data)) + 1), len(data) + 1]:
        outcome = _assert_same(data, fmt, chunk_bytes, **options)
    return outcome


def _column(outcome: tuple, name: str) -> list:
    assert outcome[0] == "ok", outcome
    return [value for table in outcome[1] for value in table[name]]


# -- the bundled real files, 64 bytes at a time


@pytest.mark.parametrize(
    "path,fmt,options",
    [
        (ALPACA, "json", {}),
        (GPTEACHER, "json", {}),
        (SHAREGPT, "json", {}),
        (HH_CHAT, "jsonl", {}),
        (DATA / "dpo" / "hh_rlhf_harmless.dpo.jsonl", "jsonl", {}),
        (DATA / "text" / "c4_demo.jsonl", "jsonl", {}),
        (SHAKESPEARE, "text", {"text_split": "paragraph"}),
        (SHAKESPEARE, "text", {"text_split": "line"}),
        (SHAKESPEARE, "text", {"text_split": "file"}),
    ],
    ids=lambda value: getattr(value, "name", None) or str(value),
)
def test_real_files_read_64_bytes_at_a_time(path, fmt, options):
    data = path.read_bytes()
    file = CountingFile(data)
    parts = list(read_rows(file, str(path), format=fmt, dataset="d", chunk_bytes=64, **options))
    assert file.reads > 100, "guard: read in many chunks"
    if fmt != "json":  # (a JSON list's window grows to its longest record: next test)
        assert file.largest == 64
    if options.get("text_split") != "file":
        assert len(parts) > 10, "guard: rows handed on part by part"
    outcome = _assert_same(data, fmt, 64, **options)
    rows = _column(outcome, "_row")
    assert rows == sorted(rows) and set(_column(outcome, "_skip")) == {None}
    assert len(rows) == 1 if options.get("text_split") == "file" else len(rows) >= 60


def test_json_list_windows_stay_bounded():
    """A JSON list read 64 bytes at a time never holds much more than its longest record."""
    data = ALPACA.read_bytes()
    file = CountingFile(data)
    records = [r for part in read_rows(file, "f", format="json", dataset="d", chunk_bytes=64)
               for r in part.records]  # fmt: skip
    longest = max(len(r.encode()) for r in records)
    assert file.reads > 100 and file.largest <= 2 * longest
    assert [json.loads(r) for r in records] == json.loads(data)


@pytest.fixture
def alpaca_table() -> pa.Table:
    return pa.Table.from_pylist(json.loads(ALPACA.read_text()))


def test_real_rows_as_parquet_read_in_small_batches(tmp_path, alpaca_table):
    path = tmp_path / "alpaca.parquet"
    pq.write_table(alpaca_table, path, row_group_size=100)
    data = path.read_bytes()
    parts = list(read_rows(io.BytesIO(data), "f", format="parquet", dataset="d", chunk_bytes=4096))
    assert len(parts) > 10, "guard: read in many record batches"
    outcome = _assert_same(data, "parquet", 4096)
    assert _column(outcome, "_row") == list(range(alpaca_table.num_rows))
    # a stream that cannot seek (a compressed file) is read whole, with the same rows
    gzipped = pa.BufferOutputStream()
    with pa.CompressedOutputStream(gzipped, "gzip") as out:
        out.write(data)
    stream = pa.CompressedInputStream(pa.BufferReader(gzipped.getvalue()), "gzip")
    assert not stream.seekable()
    assert _outcome(read_tables(stream, "f", format="parquet", dataset="d")) == outcome


def test_csv_blocks_are_those_whole_file_reading_used():
    """``pyarrow.csv.read_csv``'s default block: the longest CSV row accepted is unchanged."""
    assert pacsv.ReadOptions().block_size == csv_rows.CSV_BLOCK_BYTES


def test_real_rows_as_csv_read_in_small_blocks(tmp_path, alpaca_table, monkeypatch):
    """pyarrow's CSV reader needs a row to fit in about a block (as whole-file reading did, with
    the same block): blocks of 8 KiB, over rows of up to 3 KiB."""
    path = tmp_path / "alpaca.csv"
    pacsv.write_csv(alpaca_table, path)
    data = path.read_bytes()
    whole = _outcome(file_tables(data, "f", format="csv", dataset="d"))
    monkeypatch.setattr(csv_rows, "CSV_BLOCK_BYTES", 8192)
    assert _assert_same(data, "csv", 64) == whole
    assert _column(whole, "_row") == list(range(alpaca_table.num_rows))
    parts = list(read_rows(CountingFile(data), "f", format="csv", dataset="d", chunk_bytes=64))
    assert len(parts) > 10, "guard: read in many blocks"


# -- small bad files, at every chunk size

GOOD = {"instruction": "Say hi.", "output": "caf\u00e9 \U0001f600"}


def _jsonl(*lines: dict | bytes) -> bytes:
    return b"\n".join(
        line if isinstance(line, bytes) else json.dumps(line, ensure_ascii=False).encode()
        for line in lines
    )


def test_jsonl_bad_lines_at_every_boundary():
    data = (
        BOM
        + _jsonl(
            GOOD,
            b'{"instruction": "caf\xe9"}',  # invalid UTF-8: the message gives its byte in the file
            b'{"instruction": "torn',  # invalid JSON
            b"",
            b"   ",
            {"output": "one\u2028line\x85"},  # U+2028 and U+0085 inside a line: one row
            GOOD,
        ).replace(b"\n", b"\r\n", 2)
        + b'\n{"last": "no newline"}'
    )
    outcome = _every_chunk_size(data, "jsonl")
    assert _column(outcome, "_row") == [1, 2, 3, 6, 7, 8]
    assert _column(outcome, "_skip") == [None, "invalid_utf8", "invalid_json", None, None, None]
    offset = data.index(b"\xe9")
    assert (
        _column(outcome, "_record")[1] == f"line 2 is not valid UTF-8 (byte {offset} of the file)"
    )
    assert json.loads(_column(outcome, "_record")[3]) == {"output": "one\u2028line\x85"}
    with pytest.raises(SourceError, match=rf"row 2: line 2 is not valid UTF-8 \(byte {offset} "):
        list(read_tables(io.BytesIO(data), "f", format="jsonl", dataset="d", chunk_bytes=5))


@pytest.mark.parametrize("text_split", ["paragraph", "line", "file"])
def test_text_paragraphs_bad_bytes_and_crlf_at_every_boundary(text_split):
    data = (
        BOM + b"first line\r\nsecond \xc3\xa9 line\r\n\r\n"
        b"a paragraph\nof three\nlines\n  \n"
        b"bad \xff line\nin a paragraph\n\n\n"
        b"x\xe2\x80\xa8y\nlast, no newline"
    )
    outcome = _every_chunk_size(data, "text", text_split=text_split)
    rows, skips = _column(outcome, "_row"), _column(outcome, "_skip")
    if text_split == "paragraph":
        assert rows == [1, 4, 8, 12] and skips == [None, None, "invalid_utf8", None]
        assert json.loads(_column(outcome, "_record")[1])["text"] == "a paragraph\nof three\nlines"
        offset = data.index(b"\xff")
        assert (
            _column(outcome, "_record")[2]
            == f"line 8 is not valid UTF-8 (byte {offset} of the file)"
        )
    elif text_split == "line":
        assert rows == [1, 2, 4, 5, 6, 8, 9, 12, 13] and skips.count("invalid_utf8") == 1
    else:
        assert rows == [1] and skips == ["invalid_utf8"]


def test_text_file_without_bad_bytes_is_one_record():
    data = BOM + b"one\r\n\r\ntwo \xe2\x80\xa8\n"
    outcome = _every_chunk_size(data, "text", text_split="file")
    assert json.loads(_column(outcome, "_record")[0])["text"] == "one\r\n\r\ntwo \u2028\n"


def _json_loads_error(data: bytes) -> str:
    """Where ``json.loads`` on the whole text puts the error: the independent reference."""
    try:
        json.loads(data.removeprefix(BOM).decode("utf-8", "surrogateescape"))
    except json.JSONDecodeError as error:
        return f"line {error.lineno}, column {error.colno}: {error.msg}"
    raise AssertionError("valid JSON")


def test_json_list_records_numbers_and_bad_bytes_at_every_boundary():
    data = (
        BOM + b'[ {"instruction": "caf\xc3\xa9", "n": 1.5e+3},\r\n'
        b' {"instruction": "caf\xe9"}, 12345 ,-0.25E-2,\n'
        b'  "x\xe2\x80\xa8y", [1, 2], true, null, {"nested": {"a": [1e5]}}\n]  \n'
    )
    outcome = _every_chunk_size(data, "json")
    assert _column(outcome, "_row") == list(range(9))
    assert _column(outcome, "_skip")[1] == "invalid_utf8"
    assert _column(outcome, "_record")[1] == "field 'instruction': not valid UTF-8"
    records = _column(outcome, "_record")
    assert [json.loads(r) for i, r in enumerate(records) if i != 1] == [
        {"instruction": "caf\u00e9", "n": 1500.0},
        12345,
        -0.0025,
        "x\u2028y",
        [1, 2],
        True,
        None,
        {"nested": {"a": [100000.0]}},
    ]


@pytest.mark.parametrize(
    "data",
    [
        b'[{"a": 1},\n {"b": 2},\n {"c": 3}',  # torn at the end
        b'[{"a": 1},\n {"b": 2}\n {"c": 3}]',  # a missing comma
        b'[{"a": 1},\n {"b": 2},\n]',  # a trailing comma
        b'[{"a": 1}, {"b": 12x}]',  # a number cut short
        b"[1, 2] [3]",  # extra data after the list
        b'{"a": 1}\n{"b": 2}\n',  # JSONL saved as .json
        b"\xef\xbb\xbf\xef\xbb\xbf[]",  # two byte order marks
        b"[\n  ",
    ],
)
def test_json_syntax_errors_are_where_json_loads_puts_them(data):
    whole = _every_chunk_size(data, "json")
    assert whole[0] == "error" and whole[1] == "SourceError"
    assert f"not valid JSON at {_json_loads_error(data)}" in whole[2]
    assert ("set format: jsonl" in whole[2]) == ("Extra data" in whole[2])


def test_json_object_and_non_list_values():
    assert _column(_every_chunk_size(b' {"a": "\xc3\xa9"} ', "json"), "_row") == [0]
    assert _every_chunk_size(b'"text"', "json")[2].endswith("must hold a list of records")
    assert _column(_every_chunk_size(b"[]", "json"), "_row") == []


def test_json_syntax_error_wins_over_an_earlier_bad_record_under_error():
    """As when the file was parsed whole, a file that is not valid JSON is reported as such."""
    data = b'[{"a": "\xe9"}, ' + b'{"b": "padding"}, ' * 20 + b'{"c": 1'
    for chunk_bytes in (7, 64, 1 << 20):
        with pytest.raises(SourceError, match="not valid JSON at line 1"):
            list(read_rows(io.BytesIO(data), "f", format="json", dataset="d",
                           chunk_bytes=chunk_bytes))  # fmt: skip


CSV = (
    b'instruction,input,output\r\n007,NA,null\r\n"Say\r\nhi, \xc3\xa9",,"NA"\n'
    b"Add.,2 and 3\nAdd.,2 and 3,caf\xe9\n\n"
    b'"quoted ""x""",,"multi\nline\nvalue"\nAdd.,2,3,5\nlast,row,here'
)


@pytest.mark.parametrize("block", [32, 1 << 20])
def test_csv_ragged_quoted_and_bad_cells_at_every_boundary(monkeypatch, block):
    """pyarrow reads blocks of ``CSV_BLOCK_BYTES`` (rows straddle them); the chunk size cuts the
    header, which Python's csv reads (so every cut of it, then a few more)."""
    monkeypatch.setattr(csv_rows, "CSV_BLOCK_BYTES", block)
    for data in (CSV, BOM + CSV):
        outcome = _every_chunk_size(data, "csv", up_to=40)
        assert _column(outcome, "_row") == [0, 1, 2, 3, 4, 5, 6]
        assert _column(outcome, "_skip") == [
            None, None, "ragged_csv_row", "invalid_utf8", None, "ragged_csv_row", None
        ]  # fmt: skip
        records = _column(outcome, "_record")
        assert json.loads(records[1]) == {
            "instruction": "Say\r\nhi, \u00e9",
            "input": "",
            "output": "NA",
        }
        assert records[2] == "2 fields where the header has 3: 'Add.,2 and 3'"
        assert json.loads(records[4])["output"] == "multi\nline\nvalue"


@pytest.mark.parametrize(
    "data,records",
    [
        (b"", []),
        (BOM, []),
        (b"\n", []),
        (b"\n\r\n", []),
        (b"a,b,c\n", []),
        (b"a,b,c", []),  # a header and no newline: no rows, as with one
        (b"\n\na,b\n1,2\n", [{"a": "1", "b": "2"}]),  # blank lines before the header
        (b'"a\nq",b\n1,2\n3,4', [{"a\nq": "1", "b": "2"}, {"a\nq": "3", "b": "4"}]),
        (b"a,a\n1,2\n", "the header row repeats a column name: ['a', 'a']"),
        (b"a,\xffb\n1,2\n", "the header row is not valid UTF-8"),
    ],
)
def test_csv_headers_at_every_boundary(data, records):
    """The header is found however the file is cut, and the rows after it are read from where it
    ends: after blank lines, and after a quoted name that spans lines (which once became a row)."""
    outcome = _every_chunk_size(data, "csv")
    if isinstance(records, str):
        assert outcome[0] == "error" and records in outcome[2], outcome
    else:
        assert [json.loads(r) for r in _column(outcome, "_record")] == records
        assert _column(outcome, "_row") == list(range(len(records)))


@pytest.mark.parametrize("data", [b"", b" \n\t", BOM, BOM + b"\n", b"[]", b" [ ] \n"])
def test_an_empty_json_file_has_no_rows(data):
    """What the config calls empty (a dataset of only such files is refused there) reads as no
    rows, not as a JSON syntax error that failed the run."""
    assert _every_chunk_size(data, "json") == ("ok", [])


def test_a_csv_row_longer_than_a_block_fails_the_file_saying_so(monkeypatch):
    monkeypatch.setattr(csv_rows, "CSV_BLOCK_BYTES", 1024)
    data = b"a,b\n1,2\n3,4\n5," + b"x" * 3000 + b"\n7,8\n"
    outcome = _assert_same(data, "csv", 64)
    assert outcome[0] == "error", outcome
    message = "a CSV row (row 2 or a later one) is longer than the CSV reader's block (1,024 bytes"
    assert message in outcome[2]


def test_parquet_binary_values_in_batches_of_one_row(tmp_path):
    path = tmp_path / "rows.parquet"
    columns = {
        "instruction": pa.array(["Say hi."] * 3 + ["Add."] * 3),
        "output": pa.array([b"caf\xc3\xa9", b"caf\xe9", b"5"] * 2, type=pa.binary()),
    }
    pq.write_table(pa.table(columns), path, row_group_size=4)
    data = path.read_bytes()
    outcome = _assert_same(data, "parquet", 1, binary="utf8")
    assert _column(outcome, "_row") == list(range(6))
    assert _column(outcome, "_skip") == [None, "invalid_utf8", None] * 2
    refused = _assert_same(data, "parquet", 1)
    assert refused[0] == "error" and "column(s) ['output'] hold binary" in refused[2]


def test_tables_are_blocks_of_the_whole_file(tmp_path):
    """Parts are regrouped into the whole file's blocks (1024 rows), not a short one per part."""
    data = b"".join(json.dumps({"i": i}).encode() + b"\n" for i in range(2500))
    tables = list(read_tables(io.BytesIO(data), "f", format="jsonl", dataset="d", chunk_bytes=100))
    assert [t.num_rows for t in tables] == [1024, 1024, 452]
    assert _outcome(tables) == _outcome(file_tables(data, "f", format="jsonl", dataset="d"))


@pytest.mark.parametrize("fmt", ["parquet", "parquet.gz", "csv", "jsonl", "json", "jsonl.gz"])
def test_a_read_task_opens_and_streams_each_format(tmp_path, alpaca_table, monkeypatch, fmt):
    """What a read task runs, in-process: ``sources.open_row_file`` (Parquet for random access,
    the others as streams, a ``.gz`` one decompressed: a ``.parquet.gz`` then read whole) then
    ``read_tables`` in parts of 256 bytes (CSV: blocks of 8 KiB): the rows the whole file gives;
    ``read_files`` (the task's body) gives them too. ``test_sources`` reads through Ray."""
    from rayjobs.data.sources import FileRead, open_row_file, read_files

    path = str(tmp_path / f"a.{fmt}")
    if fmt.startswith("parquet"):
        with pa.output_stream(path, compression="detect") as out:  # gzip for .gz
            pq.write_table(alpaca_table, out, row_group_size=64)
    elif fmt == "csv":
        pacsv.write_csv(alpaca_table, path)
    elif fmt.startswith("jsonl"):
        data = _jsonl(*alpaca_table.to_pylist()) + b"\n{torn"
        with pa.output_stream(path, compression="detect") as out:  # gzip for .gz
            out.write(data)
    else:
        Path(path).write_bytes(ALPACA.read_bytes())
    base = fmt.removesuffix(".gz")
    monkeypatch.setattr(csv_rows, "CSV_BLOCK_BYTES", 8192)
    options = {"format": base, "dataset": "d", "on_bad_row": "skip", "chunk_bytes": 256}
    with open_row_file(path, base) as file:
        assert file.seekable() == (fmt == "parquet")
        counted = file if fmt.startswith("parquet") else CountingStream(file)
        got = _outcome(read_tables(counted, path, **options))
    assert fmt.startswith("parquet") or counted.reads > 20, "guard: read in many parts"
    with pa.input_stream(path, compression="detect") as raw:
        whole = file_tables(raw.read(), path, format=base, dataset="d", on_bad_row="skip")
        whole = _outcome(whole)
    assert got == whole
    assert _outcome(read_files([FileRead(path)], {**options, "text_split": "paragraph"})) == whole
    assert len(_column(got, "_row")) == alpaca_table.num_rows + fmt.startswith("jsonl")


# -- guards a mutation run found missing


def test_crlf_line_ends_are_not_part_of_a_text_record():
    """A text file with Windows line ends: the ``\\r`` is dropped, never trained on."""
    data = b"first line\r\nsecond line\r\n\r\nnext paragraph\r\n"
    parsed = parse_rows(data, "notes.txt", format="text", dataset="d")
    assert parsed.rows == [1, 4]
    assert parsed.records == ['{"text": "first line\\nsecond line"}', '{"text": "next paragraph"}']
    lines = parse_rows(data, "notes.txt", format="text", dataset="d", text_split="line")
    assert lines.records == [
        '{"text": "first line"}',
        '{"text": "second line"}',
        '{"text": "next paragraph"}',
    ]


def test_crlf_line_ends_are_not_part_of_a_jsonl_record():
    parsed = parse_rows(b'{"a": 1}\r\n{"b": 2}\r\n', "rows.jsonl", format="jsonl", dataset="d")
    assert (parsed.rows, parsed.records) == ([1, 2], ['{"a": 1}', '{"b": 2}'])
