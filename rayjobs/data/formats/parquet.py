"""Parquet files, read in record batches of about ``chunk_bytes`` (random access: the footer is at
the end of the file; a stream that cannot seek is read whole)."""

from __future__ import annotations

from collections.abc import Iterator

from rayjobs.data.formats.arrow import check_binary, table_records
from rayjobs.data.formats.registry import FileOptions, Parsed, Readable, register_format

PARQUET_BATCH_ROWS = 16384
"""Most rows of a Parquet record batch (batches are otherwise sized to :data:`CHUNK_BYTES`)."""


@register_format("parquet", (".parquet",), late_file_errors=True)
def _parquet(file: Readable, options: FileOptions, chunk_bytes: int) -> Iterator[Parsed]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not file.seekable():  # Parquet's footer is at the end of the file
        file = pa.BufferReader(file.read())
    parquet = pq.ParquetFile(file)
    check_binary(parquet.schema_arrow, options.binary)
    meta = parquet.metadata
    size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    # rows of about chunk_bytes, by the row groups' sizes; encoded sizes (a dictionary-encoded
    # column is small) can be far below decoded ones, hence the cap
    batch_rows = min(max(1, chunk_bytes * meta.num_rows // max(1, size)), PARQUET_BATCH_ROWS)
    start = 0
    # a row group at a time: pyarrow pre-buffers (fetches at once) the row groups it is given,
    # all of the file if given them all; one at a time, a part's memory (and the driver's head
    # parse) is one row group's, one ranged read on an object store
    for group in range(meta.num_row_groups):
        batches = parquet.iter_batches(batch_size=batch_rows, row_groups=[group],
                                       use_threads=False)  # fmt: skip
        for batch in batches:
            rows = list(range(start, start + batch.num_rows))
            start += batch.num_rows
            yield table_records(pa.Table.from_batches([batch]), rows, options.binary)
