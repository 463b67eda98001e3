"""Bad input, class by class (issue #11): every bad row has a policy outcome.

Each scenario is a real small file written to tmp_path, resolved by the real config code and read by
the read task's own code (``sources.read_tables``, in-process: ``conftest.file_tables``), then
tokenized by ``Tokenize`` with the real GPT-2 tokenizer and a fake ledger. Under ``on_bad_row:
skip`` the good rows come out tokenized (checked by their uids, which name file and row) and the bad
ones are counted by reason, exactly; under ``error`` the first bad row stops the read or the
tokenization with a message naming dataset, file, row and field or reason. One Ray test at the end
runs a file mixing several classes through the real read path and the Tokenize actor pool and checks
the counts reach the ledger once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import GPT2, file_tables
from rayjobs.config import config_from_dict
from rayjobs.data import templates, tokenize
from rayjobs.data.counts import TokenizeCounts
from rayjobs.data.formats import SKIP_REASONS, parse_file
from rayjobs.data.samples import sample_uid
from rayjobs.data.tokenize import Tokenize
from rayjobs.errors import DataError, SourceError

PARSE_REASONS = ("invalid_json", "invalid_utf8", "ragged_csv_row", "too_large", "too_deep")
"""Reasons found by the parser in the read task (the others by Tokenize)."""

# A chat template that raises on some rows, as real ones do through raise_exception.
RAISING_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if 'boom' in m['content'] %}"
    "{{ raise_exception('cannot render boom') }}{% endif %}"
    "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _jsonl(*lines: dict | str | bytes) -> bytes:
    """JSONL bytes: dicts dumped as UTF-8 (no escapes), str and bytes lines as they are."""
    encoded = [
        line
        if isinstance(line, bytes)
        else (line if isinstance(line, str) else json.dumps(line, ensure_ascii=False)).encode()
        for line in lines
    ]
    return b"\n".join(encoded) + b"\n"


def _parquet(columns: dict[str, pa.Array]) -> Callable[[Path], None]:
    return lambda path: pq.write_table(pa.table(columns), path)


def _turns(user: str, assistant: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": assistant},
        ]
    }


GOOD = {"instruction": "Say hi.", "input": "", "output": "Hi!"}
ADD = {"instruction": "Add.", "input": "2 and 3", "output": "5"}


@dataclass(frozen=True)
class Case:
    """A file, how its dataset is set up, and the outcome under each policy."""

    file: str
    content: bytes | Callable[[Path], None]
    good: list[int]
    """Row numbers that come out tokenized (under either policy when there is no bad row)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """skip: counts by reason."""
    error: tuple[int, list[str]] | None = None
    """error: the row named and texts the message must contain (None: no bad row)."""
    template: str = "alpaca"
    extra: dict = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)
    """Row → text its tokenized sample must contain (read exactly as written)."""


CASES = {
    "jsonl_torn_lines": Case(
        "rows.jsonl",
        _jsonl(GOOD, '{"instruction": "Add.", "outp', ADD)
        + b'{"instruction": "Say hi.", "output": "H',  # a truncated last line, no newline
        good=[1, 3],
        skipped={"invalid_json": 2},
        error=(2, ["[invalid_json]", "line 2 is not valid JSON"]),
    ),
    "jsonl_invalid_utf8": Case(
        "rows.jsonl",
        _jsonl(GOOD, b'{"instruction": "Say hi.", "output": "caf\xe9"}', ADD),
        good=[1, 3],
        skipped={"invalid_utf8": 1},
        # line 1 is 56 bytes and a newline; the bad byte is at offset 41 of line 2: 57 + 41
        error=(2, ["[invalid_utf8]", "line 2 is not valid UTF-8 (byte 98 of the file)"]),
    ),
    "jsonl_escaped_lone_surrogate": Case(  # valid JSON, no UTF-8 text (the tokenizer crashed)
        "rows.jsonl",
        _jsonl(GOOD)
        + b'{"instruction": "Say hi.", "output": "bad \\ud800 x"}\n'
        + b'{"instruction": "Say hi.", "output": "\\ud83d\\ude00"}\n',
        good=[1, 3],
        skipped={"invalid_utf8": 1},
        error=(2, ["[invalid_utf8]", "line 2: field 'output': not valid UTF-8"]),
        texts={3: "\U0001f600"},
    ),
    "jsonl_u2028_u0085_and_crlf_inside_one_row_each": Case(
        "rows.jsonl",
        _jsonl(
            {"instruction": "Say hi.", "output": "one\u2028line"},
            {"instruction": "Say hi.", "output": "next\x85line"},
        ).replace(b"\n", b"\r\n", 1)
        + _jsonl(ADD),
        good=[1, 2, 3],
        texts={1: "one\u2028line", 2: "next\x85line", 3: "5"},
    ),
    "csv_ragged_rows": Case(
        "rows.csv",
        b"instruction,input,output\nSay hi.,,Hi!\nAdd.,2 and 3\nAdd.,2 and 3,5\nAdd.,2,3,5\n",
        good=[0, 2],
        skipped={"ragged_csv_row": 2},
        error=(1, ["[ragged_csv_row]", "2 fields where the header has 3: 'Add.,2 and 3'"]),
    ),
    "csv_cells_stay_text": Case(
        "rows.csv",
        b'instruction,input,output\n007,NA,null\n"Say\nhi.",,"NA"\n',
        good=[0, 1],
        texts={0: "007\n\n### Input:\nNA\n\n### Response:\nnull", 1: "Say\nhi."},
    ),
    "csv_invalid_utf8_cell": Case(
        "rows.csv",
        b"instruction,input,output\nSay hi.,,caf\xe9\nAdd.,2 and 3,5\n",
        good=[1],
        skipped={"invalid_utf8": 1},
        error=(0, ["[invalid_utf8]", "field 'output': not UTF-8"]),
    ),
    "parquet_binary_decoded_with_binary_utf8": Case(
        "rows.parquet",
        _parquet(
            {
                "instruction": pa.array(["Say hi.", "Say hi.", "Add."]),
                "output": pa.array([b"caf\xc3\xa9", b"caf\xe9", b"5"], type=pa.binary()),
            }
        ),
        good=[0, 2],
        skipped={"invalid_utf8": 1},
        error=(1, ["[invalid_utf8]", "field 'output': not valid UTF-8"]),
        extra={"binary": "utf8"},
        texts={0: "café", 2: "5"},
    ),
    "parquet_string_column_holding_invalid_utf8": Case(  # Arrow does not check writers' bytes
        "rows.parquet",
        _parquet(
            {
                "instruction": pa.array(["Say hi.", "Say hi.", "Add."]),
                "output": pa.array([b"caf\xc3\xa9", b"caf\xe9", b"5"]).view(pa.string()),
            }
        ),
        good=[0, 2],
        skipped={"invalid_utf8": 1},
        error=(1, ["[invalid_utf8]", "field 'output': not valid UTF-8"]),
        texts={0: "café", 2: "5"},
    ),
    "json_list_invalid_utf8_value": Case(
        "rows.json",
        b'[{"instruction": "Say hi.", "output": "caf\xe9"}, ' + json.dumps(ADD).encode() + b"]",
        good=[1],
        skipped={"invalid_utf8": 1},
        error=(0, ["[invalid_utf8]", "field 'output': not valid UTF-8"]),
    ),
    "text_lines_invalid_utf8_and_u0085": Case(
        "book.txt",
        b"first line\nsecond \xc2\x85 line\nbad \xff line\n\nlast\n",
        good=[1, 2, 5],
        skipped={"invalid_utf8": 1},
        error=(3, ["[invalid_utf8]", "line 3 is not valid UTF-8 (byte 30 of the file)"]),
        template="text",
        extra={"text_split": "line"},
        texts={2: "second \x85 line"},
    ),
    "chat_template_raises": Case(
        "chat.jsonl",
        _jsonl(_turns("Hi", "Hello"), _turns("Hi", "boom"), _turns("Bye", "Ciao")),
        good=[1, 3],
        skipped={"template_error": 1},
        error=(
            2,
            [
                "field 'messages': the chat template raised TemplateError: cannot render boom",
                "[template_error]",
            ],
        ),
        template="chat",
        texts={1: "assistant: Hello", 3: "assistant: Ciao"},
    ),
    "chat_template_raises_on_sharegpt": Case(  # named by the dataset's column, not 'messages'
        "chat.jsonl",
        _jsonl(
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]},
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "boom"}]},
        ),
        good=[1],
        skipped={"template_error": 1},
        error=(
            2,
            [
                "field 'conversations': the chat template raised TemplateError: cannot render boom",
                "[template_error]",
            ],
        ),
        template="chat",
        texts={1: "assistant: Yo"},
    ),
    "chat_turn_key_not_read": Case(  # Axolotl's per-turn training flag: not trained against it
        "chat.jsonl",
        _jsonl(
            _turns("Hi", "Hello"),
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Yo", "training": False},
                ]
            },
        ),  # fmt: skip
        good=[1],
        skipped={"unknown_turn_key": 1},
        error=(2, ["field 'messages[1]': turn key 'training' is not read", "[unknown_turn_key]"]),
        template="chat",
        texts={1: "assistant: Hello"},
    ),
    "jsonl_nested_too_deep": Case(  # a RecursionError in the head parse, even under skip
        "rows.jsonl",
        _jsonl(GOOD)
        + b'{"instruction": "x", "output": '
        + b"[" * 50_000
        + b"]" * 50_000
        + b"}\n"
        + _jsonl(ADD),
        good=[1, 3],
        skipped={"too_deep": 1},
        error=(2, ["line 2 is nested 50001 levels, over max_depth (100)", "[too_deep]"]),
    ),
    "jsonl_over_max_row_bytes": Case(
        "rows.jsonl",
        _jsonl(GOOD, {"instruction": "Say hi.", "output": "w " * 200}, ADD),
        good=[1, 3],
        skipped={"too_large": 1},
        error=(2, ["line 2 is 440 bytes, over max_row_bytes (300)", "[too_large]"]),
        extra={"max_row_bytes": 300},
    ),
    "chat_over_max_turns": Case(
        "chat.jsonl",
        _jsonl(_turns("Hi", "Hello"), {"messages": _turns("a", "b")["messages"] * 2}),
        good=[1],
        skipped={"too_many_turns": 1},
        error=(2, ["field 'messages': 4 turns, over max_turns (2)", "[too_many_turns]"]),
        template="chat",
        extra={"max_turns": 2},
        texts={1: "assistant: Hello"},
    ),
    "template_function_raises": Case(
        "rows.jsonl",
        _jsonl({"text": "a", "key": "b"}, {"text": "a"}),
        good=[1],
        skipped={"template_error": 1},
        error=(2, ["template 'needs_key' raised KeyError: 'key'", "[template_error]"]),
        template="needs_key",
    ),
    "empty_required_fields": Case(
        "rows.jsonl",
        _jsonl(
            {"instruction": "", "output": "Hi!"},
            {"instruction": "Say hi.", "output": " \n\t"},
            {"instruction": "Say hi.", "input": "", "output": "Hi!"},  # input is optional
            {"instruction": "Say hi.", "input": "  ", "output": "Hi!"},
        ),
        good=[3, 4],
        skipped={"empty_field": 2},
        error=(1, ["field 'instruction': empty ('')", "[empty_field]"]),
    ),
    "wrong_types": Case(
        "rows.jsonl",
        _jsonl({"instruction": "Say hi.", "output": 5}, "[1, 2]", GOOD),
        good=[3],
        skipped={"wrong_type": 2},
        error=(1, ["field 'output': expected text, got int", "[wrong_type]"]),
    ),
    "missing_fields": Case(
        "rows.jsonl",
        _jsonl(GOOD, {"instruction": "Say hi."}, {"instruction": "Say hi.", "output": None}),
        good=[1],
        skipped={"missing_field": 2},
        error=(2, ["field 'output': missing", "[missing_field]", "column_map"]),
    ),
}


def test_every_reason_has_a_scenario():
    covered = {reason for case in CASES.values() for reason in case.skipped}
    assert covered == set(SKIP_REASONS)


@pytest.fixture(scope="module")
def gpt2_tokenizers():
    """Loaded tokenizers by chat template, shared by the module's tests."""
    return {}


@pytest.fixture
def tokenizer_config(monkeypatch, gpt2_tokenizers):
    """Tokenize gets a loaded GPT-2 tokenizer (with the config's chat template) from a cache."""
    real = tokenize.Tokenizer

    def cached(config):
        if config.chat_template not in gpt2_tokenizers:
            gpt2_tokenizers[config.chat_template] = real(config)
        return gpt2_tokenizers[config.chat_template]

    monkeypatch.setattr(tokenize, "Tokenizer", cached)


@pytest.fixture(autouse=True)
def needs_key_template():
    """A registered template that raises KeyError on rows without ``key``."""

    @templates.register_template("needs_key")
    def needs_key(row, column_map, render_chat=None):
        return [templates.Segment(row["text"] + row["key"], True)]

    yield
    del templates.TEMPLATES["needs_key"]


def _config(tmp_path: Path, source, template: str = "alpaca", **extra):
    chat_template = RAISING_CHAT_TEMPLATE if template == "chat" else None
    return config_from_dict(
        {
            "datasets": [{"name": "d", "source": source, "template": template, **extra}],
            "tokenizer": {"path": str(GPT2), "chat_template": chat_template},
            "ray": {"tokenize_concurrency": 1},
        },
        base_dir=tmp_path,
    )


def _setup(tmp_path: Path, case: Case, on_bad_row: str):
    path = tmp_path / case.file
    if callable(case.content):
        case.content(path)
    else:
        path.write_bytes(case.content)
    return _config(tmp_path, case.file, case.template, on_bad_row=on_bad_row, **case.extra)


def _read(spec) -> pa.Table:
    """What the read tasks emit for every file of the dataset (in-process)."""
    return pa.concat_tables(
        table
        for path in spec.files
        for table in file_tables(
            Path(path).read_bytes(),
            path,
            format=spec.format,
            dataset=spec.name,
            text_split=spec.text_split,
            binary=spec.binary,
            on_bad_row=spec.on_bad_row,
            max_row_bytes=spec.max_row_bytes,
            max_depth=spec.max_depth,
        )
    )


def _tokenize(config, ledger=None) -> pa.Table:
    [spec] = config.datasets
    stage = Tokenize(
        config.datasets, config.tokenizer, seq_len=4096, overflow="drop", ledger=ledger
    )
    return stage(_read(spec))


def _uid(file: int, row: int) -> int:
    """The uid of a one-piece sample from file ``file`` of dataset "d", row ``row``."""
    return sample_uid("\0".join(["d", str(file), str(row), "0"]))


def _assert_good_rows(table: pa.Table, case: Case, config) -> None:
    by_uid = dict(zip(table.column("uid").to_pylist(), table.column("input_ids").to_pylist()))
    assert sorted(by_uid) == sorted(_uid(0, row) for row in case.good)
    backend = tokenize.Tokenizer(config.tokenizer).backend
    for row, text in case.texts.items():
        assert text in backend.decode(by_uid[_uid(0, row)])


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_skip_counts_bad_rows_by_reason_and_tokenizes_every_good_row(
    tmp_path, tokenizer_config, fake_ledger, case
):
    config = _setup(tmp_path, case, "skip")
    table = _tokenize(config, fake_ledger)
    _assert_good_rows(table, case, config)
    [report] = fake_ledger.calls  # one report for the batch: (counts by dataset, ...)
    counts = report[0]["d"]
    assert counts.skipped_by_reason == case.skipped
    assert counts.skipped_rows == sum(case.skipped.values())
    assert counts.samples == len(case.good)
    path = config.datasets[0].files[0]
    assert len(counts.skipped_examples) == counts.skipped_rows
    for example in counts.skipped_examples:
        assert example.startswith(f"dataset 'd', file {path}, row ")
        assert example.endswith(tuple(f"[{reason}]" for reason in case.skipped))


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_error_names_dataset_file_row_and_reason(tmp_path, tokenizer_config, case):
    config = _setup(tmp_path, case, "error")
    if case.error is None:  # nothing bad: the same rows as under skip
        _assert_good_rows(_tokenize(config), case, config)
        return
    row, parts = case.error
    with pytest.raises((SourceError, DataError)) as caught:
        _tokenize(config)
    [reason] = case.skipped
    assert type(caught.value) is (SourceError if reason in PARSE_REASONS else DataError)
    message = str(caught.value)
    path = config.datasets[0].files[0]
    for part in (f"dataset 'd', file {path}, row {row}: ", *parts, "on_bad_row: skip"):
        assert part in message
    assert "\n" not in message  # the CLI shows the first line of a wrapped error


@pytest.mark.parametrize("encoding", ["plain", "dictionary"])  # dictionary: a pandas categorical
@pytest.mark.parametrize("on_bad_row", ["error", "skip"])
def test_parquet_binary_column_is_refused_by_default(
    tmp_path, tokenizer_config, on_bad_row, encoding
):
    """Never trained as the text ``b'Hi!'`` (a dictionary-encoded column once was)."""
    path = tmp_path / "rows.parquet"
    output = pa.array([b"Hi!"])
    output = output.dictionary_encode() if encoding == "dictionary" else output
    _parquet({"instruction": pa.array(["Say hi."]), "output": output})(path)
    config = _config(tmp_path, path.name, on_bad_row=on_bad_row)
    with pytest.raises(SourceError) as caught:
        _tokenize(config)
    message = str(caught.value)
    for part in (f"dataset 'd', file {path}:", "column(s) ['output'] hold binary", "binary: utf8"):
        assert part in message


def test_binary_inside_dictionaries_maps_and_lists_is_decoded_with_binary_utf8(tmp_path):
    path = tmp_path / "rows.parquet"
    columns = {
        "text": pa.array([b"caf\xc3\xa9"]).dictionary_encode(),
        "meta": pa.array([[("k", b"v")]], type=pa.map_(pa.string(), pa.binary())),
        "tags": pa.array([[b"a", b"b"]]),
    }
    _parquet(columns)(path)
    data = path.read_bytes()
    _, records = parse_file(data, str(path), format="parquet", dataset="d", binary="utf8")
    assert [json.loads(r) for r in records] == [
        {"text": "café", "meta": [["k", "v"]], "tags": ["a", "b"]}
    ]
    with pytest.raises(SourceError, match=r"column\(s\) \['text', 'meta', 'tags'\] hold binary"):
        parse_file(data, str(path), format="parquet", dataset="d")


def test_csv_cells_are_kept_as_written(tmp_path):
    """No type or null guessing: the records are the cells' text."""
    path = tmp_path / "rows.csv"
    path.write_bytes(CASES["csv_cells_stay_text"].content)
    rows, records = parse_file(path.read_bytes(), str(path), format="csv", dataset="d")
    assert rows == [0, 1]
    assert [json.loads(r) for r in records] == [
        {"instruction": "007", "input": "NA", "output": "null"},
        {"instruction": "Say\nhi.", "input": "", "output": "NA"},
    ]


def test_parse_file_gives_the_good_rows_and_applies_the_policy(tmp_path):
    """The records-only helper (driver estimates, benches): good rows under skip, the first bad
    row's error under error."""
    data = CASES["jsonl_torn_lines"].content
    rows, records = parse_file(data, "x.jsonl", format="jsonl", dataset="d", on_bad_row="skip")
    assert rows == [1, 3] and [json.loads(r) for r in records] == [GOOD, ADD]
    with pytest.raises(SourceError, match=r"row 2: .*\[invalid_json\]"):
        parse_file(data, "x.jsonl", format="jsonl", dataset="d")


def test_read_tables_carry_bad_rows_in_row_order(tmp_path):
    """Under skip a read task emits bad rows as rows with their reason (and what is wrong as
    ``_record``), in file order with the good ones."""
    data = CASES["csv_ragged_rows"].content
    [table] = file_tables(data, "x.csv", format="csv", dataset="d", on_bad_row="skip")
    assert table.column("_row").to_pylist() == [0, 1, 2, 3]
    assert table.column("_skip").to_pylist() == [None, "ragged_csv_row", None, "ragged_csv_row"]
    assert table.column("_record").to_pylist()[3] == "4 fields where the header has 3: 'Add.,2,3,5'"


def test_a_file_listed_under_several_spellings_is_read_once(tmp_path, tokenizer_config):
    """Relative and absolute paths, a path through ``..``, a glob and a symlinked folder reach the
    same file: it is read once, under its first spelling."""
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "rows.jsonl").write_bytes(_jsonl(GOOD, ADD))
    (tmp_path / "link").symlink_to(tmp_path / "data")
    sources = [
        "data/rows.jsonl",
        str(tmp_path / "data" / "sub" / ".." / "rows.jsonl"),
        "data/*.jsonl",
        "link/rows.jsonl",
    ]
    config = _config(tmp_path, sources, on_bad_row="skip")
    assert config.datasets[0].files == (str(tmp_path.resolve() / "data" / "rows.jsonl"),)
    table = _tokenize(config)
    assert sorted(table.column("uid").to_pylist()) == sorted([_uid(0, 1), _uid(0, 2)])


def test_skip_counts_reach_the_ledger_once_through_ray(ray_local, tmp_path):
    """One file mixing several bad classes, listed twice, through the real read path
    (``read_dataset``, a read task) and the Tokenize actor pool (``stream.tokenized``): the good
    rows come out once and the counts by reason reach the run's ledger exactly once."""
    from rayjobs.data.sources import read_dataset
    from rayjobs.data.stream import tokenized
    from rayjobs.job.ledger import Ledger

    path = tmp_path / "mixed.jsonl"
    path.write_bytes(
        _jsonl(
            GOOD,  # 1
            '{"instruction": "Add.", "outp',  # 2 invalid_json
            b'{"instruction": "Say hi.", "output": "caf\xe9"}',  # 3 invalid_utf8
            {"instruction": "Say hi.", "output": "one\u2028line"},  # 4 good
            {"instruction": "Say hi."},  # 5 missing_field
            {"instruction": "Say hi.", "output": 5},  # 6 wrong_type
            {"instruction": " ", "output": "Hi!"},  # 7 empty_field
            ADD,  # 8
        )
    )
    config = _config(tmp_path, [path.name, str(path)], on_bad_row="skip")
    ledger = Ledger.remote("test")
    rows = tokenized(read_dataset(config.datasets[0]), config, ledger).take_all()
    assert sorted(r["uid"] for r in rows) == sorted(_uid(0, row) for row in (1, 4, 8))
    counts = TokenizeCounts(**ray_local.get(ledger.snapshot.remote())["tokenize"]["d"])
    assert counts.skipped_by_reason == {
        "invalid_json": 1,
        "invalid_utf8": 1,
        "missing_field": 1,
        "wrong_type": 1,
        "empty_field": 1,
    }
    assert (counts.samples, counts.skipped_rows, len(counts.skipped_examples)) == (3, 5, 5)
