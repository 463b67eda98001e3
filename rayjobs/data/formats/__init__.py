"""File formats: one file → (row numbers, records as JSON object strings), part by part. No Ray.

Importing this package registers every built-in format (one module each) in :data:`FORMATS`.
"""

from rayjobs.data.formats import csv_rows, json_list, jsonl, parquet, text  # noqa: F401 - registers
from rayjobs.data.formats.arrow import binary_columns, check_binary, table_records
from rayjobs.data.formats.limits import MAX_DEPTH, MAX_ROW_BYTES
from rayjobs.data.formats.registry import (
    BOM,
    CHUNK_BYTES,
    COMPRESSED_SUFFIXES,
    FORMATS,
    HF,
    HF_PLACE,
    SKIP_REASONS,
    BadRow,
    FileOptions,
    Format,
    Parsed,
    Readable,
    SourceError,
    apply_policy,
    bad_row_error,
    bad_row_order,
    bad_row_place,
    format_of,
    hf_label,
    parse_file,
    parse_rows,
    read_rows,
    register_format,
    without_compression,
)

__all__ = [
    "BOM",
    "CHUNK_BYTES",
    "COMPRESSED_SUFFIXES",
    "FORMATS",
    "HF",
    "HF_PLACE",
    "MAX_DEPTH",
    "MAX_ROW_BYTES",
    "SKIP_REASONS",
    "BadRow",
    "FileOptions",
    "Format",
    "Parsed",
    "Readable",
    "SourceError",
    "apply_policy",
    "bad_row_error",
    "bad_row_order",
    "bad_row_place",
    "binary_columns",
    "check_binary",
    "format_of",
    "hf_label",
    "parse_file",
    "parse_rows",
    "read_rows",
    "register_format",
    "table_records",
    "without_compression",
]
