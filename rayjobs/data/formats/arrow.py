"""Arrow tables as records (Parquet files and Hugging Face datasets), binary columns refused or
decoded as strict UTF-8 (``binary: utf8``): ``str(b"...")`` would train on the text ``b'...'``."""

from __future__ import annotations

import json
from typing import Any

from rayjobs.data.formats.registry import Parsed


def binary_columns(schema) -> list[str]:
    """Columns of an Arrow schema that hold bytes (at any depth: a list of binary counts)."""
    return [f.name for f in schema if _holds_binary(f.type)]


def _holds_binary(arrow_type) -> bool:
    import pyarrow as pa

    checks = ("is_binary", "is_large_binary", "is_fixed_size_binary", "is_binary_view")
    if any(getattr(pa.types, check, lambda _: False)(arrow_type) for check in checks):
        return True
    if pa.types.is_dictionary(arrow_type):  # e.g. a pandas categorical of bytes
        return _holds_binary(arrow_type.value_type)
    return any(_holds_binary(arrow_type.field(i).type) for i in range(arrow_type.num_fields))


def check_binary(schema, binary: str) -> list[str]:
    """The binary columns of an Arrow schema, to be decoded as UTF-8 (``binary: utf8``).

    Raises:
        ValueError: a binary column under ``binary: error``.
    """
    decode = binary_columns(schema)
    if decode and binary != "utf8":
        raise ValueError(
            f"column(s) {decode} hold binary (bytes) values, not text; set the dataset's "
            f"binary: utf8 to decode them as UTF-8 text, or store them as string columns"
        )
    return decode


def table_records(table, rows: list[int], binary: str) -> Parsed:
    """An Arrow table's rows as records (Parquet files and Hugging Face datasets); ``rows`` are
    their row numbers. Binary columns are refused, or decoded as UTF-8 with ``binary: utf8`` (see
    module note); other non-JSON values (timestamps, decimals) become their ``str``. A string
    column holding bytes that are not UTF-8 (Arrow does not check what writers put there) is
    decoded row by row too, so those rows are ``invalid_utf8`` bad rows, not a failed file.

    Raises:
        ValueError: a binary column under ``binary: error``.
    """
    import pyarrow as pa

    decode = check_binary(table.schema, binary)
    try:
        records = table.to_pylist()
    except UnicodeDecodeError:  # a string column holding bytes that are not UTF-8 (a bad writer)
        table = table.cast(pa.schema([f.with_type(_as_binary(f.type)) for f in table.schema]))
        decode = binary_columns(table.schema)  # decoded row by row: a bad row is skippable
        records = table.to_pylist()
    parsed = Parsed()
    for row, record in zip(rows, records, strict=True):
        try:
            for name in decode:
                record[name] = _decoded(record[name])
        except UnicodeDecodeError as error:
            parsed.add_bad(row, "invalid_utf8", f"field {name!r}: not valid UTF-8 ({error.reason})")
            continue
        parsed.rows.append(row)
        parsed.records.append(json.dumps(record, ensure_ascii=False, default=_json_str))
    return parsed


def _as_binary(arrow_type):
    """``arrow_type`` with its strings, at any depth, as binary (the same bytes, not checked)."""
    import pyarrow as pa

    if pa.types.is_string(arrow_type):
        return pa.binary()
    if pa.types.is_large_string(arrow_type):
        return pa.large_binary()
    if pa.types.is_map(arrow_type):
        return pa.map_(_as_binary(arrow_type.key_type), _as_binary(arrow_type.item_type))
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        field = arrow_type.value_field
        kind = pa.list_ if pa.types.is_list(arrow_type) else pa.large_list
        return kind(field.with_type(_as_binary(field.type)))
    if pa.types.is_struct(arrow_type):
        return pa.struct([field.with_type(_as_binary(field.type)) for field in arrow_type])
    if pa.types.is_dictionary(arrow_type):
        return pa.dictionary(arrow_type.index_type, _as_binary(arrow_type.value_type))
    return arrow_type


def _json_str(value: Any) -> str:
    """A value JSON has no type for, as text (a timestamp, a decimal); bytes are never made text
    (``str`` would give ``"b'...'"``): a binary column that :func:`binary_columns` missed fails
    loudly."""
    if isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"a binary value {bytes(value)[:20]!r} in a column not known to be binary")
    return str(value)


def _decoded(value: Any) -> Any:
    """``value`` with every bytes inside it decoded as strict UTF-8."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, dict):
        return {key: _decoded(item) for key, item in value.items()}
    if isinstance(value, list | tuple):  # a map's entries come as (key, value) tuples
        return [_decoded(item) for item in value]
    return value
