"""The packed-row contract: column names, dtypes, ignore index, row layout and row assembly.

Pure numpy, no torch and no Ray: the data side (``tokenize``, ``pack``, ``epochs``) writes rows
with it on CPU nodes, the train side (``collate``, ``masks``, ``model``) and ``export`` read them.

A packed row is exactly ``seq_len`` tokens. Its columns (:data:`PACKED_COLUMNS`, int32
``[seq_len]`` each):

- ``input_ids``: the documents' tokens in pack order, then ``pad_id`` up to ``seq_len``;
- ``labels``: the documents' labels, already shifted inside each document at tokenize time
  (``labels[t]`` is the target of ``input_ids[t]``; the last position of every document is
  :data:`IGNORE_INDEX`), and :data:`IGNORE_INDEX` on padding; so no position is ever trained to
  predict the next document;
- ``position_ids``: 0, 1, ... restarting at every document start (padding included);
- ``document_ids``: 0..k-1 for the row's k documents in order; padding, when there is any, is one
  more document with id k, so every query attends at least to itself (no all-masked rows).

plus :data:`STAT_COLUMNS` (int32 scalars): ``num_tokens`` (non-pad tokens) and ``num_documents``.
Everything else a model needs (the dense mask, the BlockMask) is derived from ``document_ids``
in ``rayjobs.train.masks``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

IGNORE_INDEX = -100
"""Label of positions that carry no loss (prompt tokens, each document's last token, padding)."""

PACKED_COLUMNS = ("input_ids", "labels", "position_ids", "document_ids")
"""The per-token columns of a packed row, each int32 ``[seq_len]``."""

STAT_COLUMNS = ("num_tokens", "num_documents")
"""The per-row scalar columns, int32."""

DTYPE = np.int32
"""dtype of every column (token ids, labels, positions, document ids and counts)."""


def index_dtype(size: int) -> type:
    """int32 when every index below ``size`` fits (half the memory traffic), else int64."""
    return np.int32 if size < 2**31 else np.int64


def ranges(starts: np.ndarray, lengths: np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """``concat(arange(s, s + n) for s, n in zip(starts, lengths))``, vectorized.

    Builds one array in place (ones, a jump at each range start, a cumulative sum): row-size
    arrays are large and fresh memory costs a page fault per 4 KiB, so temporaries matter.

    >>> ranges(np.array([5, 0, 9]), np.array([2, 0, 3])).tolist()
    [5, 6, 9, 10, 11]
    """
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    nonempty = lengths > 0
    starts, lengths = starts[nonempty], lengths[nonempty]
    out = np.ones(int(lengths.sum()), dtype=dtype)
    if len(out):
        first = np.cumsum(lengths) - lengths
        out[0] = starts[0]
        out[first[1:]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
        np.cumsum(out, out=out)
    return out


def row_segments(
    lengths: np.ndarray, documents_per_row: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The segments of packed rows, row after row: each row's documents, then its padding.

    Args:
        lengths: token count of every document, row after row, in pack order.
        documents_per_row: how many of ``lengths`` belong to each row.
        seq_len: length of every row.

    Returns:
        ``(segment_lengths, segment_ids, segment_documents)`` in layout order, int64: the length
        of each segment, its id inside the row (documents 0..k-1, padding k) and the index into
        ``lengths`` of its document (-1 for padding). The lengths add up to rows × seq_len.

    Raises:
        ValueError: if a length is not positive or a row's lengths add up to more than ``seq_len``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    documents_per_row = np.asarray(documents_per_row, dtype=np.int64)
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}.")
    bad = np.flatnonzero(lengths <= 0)
    if bad.size:
        raise ValueError(
            f"Every document length must be positive; document {int(bad[0])} has length "
            f"{int(lengths[bad[0]])} ({bad.size} such); drop empty documents before packing."
        )
    num_rows = len(documents_per_row)
    row_of_document = np.repeat(np.arange(num_rows), documents_per_row)
    row_tokens = np.bincount(row_of_document, weights=lengths, minlength=num_rows).astype(np.int64)
    if (row_tokens > seq_len).any():
        row = int(np.flatnonzero(row_tokens > seq_len)[0])
        mine = lengths[row_of_document == row]
        raise ValueError(
            f"Row {row} holds documents of lengths {mine.tolist()}, {int(row_tokens[row])} tokens, "
            f"more than seq_len={seq_len}; the packer must not put them in one row."
        )
    padded = np.flatnonzero(row_tokens < seq_len)
    first_document = np.cumsum(documents_per_row) - documents_per_row
    order = np.argsort(np.concatenate([row_of_document, padded]), kind="stable")
    segment_lengths = np.concatenate([lengths, seq_len - row_tokens[padded]])[order]
    segment_ids = np.concatenate(
        [np.arange(len(lengths)) - first_document[row_of_document], documents_per_row[padded]]
    )[order]
    segment_documents = np.concatenate(
        [np.arange(len(lengths)), np.full(len(padded), -1, dtype=np.int64)]
    )[order]
    return segment_lengths, segment_ids, segment_documents


def layout_rows(
    lengths: np.ndarray, documents_per_row: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """``document_ids`` and ``position_ids`` of packed rows, from their documents' lengths.

    Args:
        lengths: token count of every document, row after row, in pack order.
        documents_per_row: how many of ``lengths`` belong to each row.
        seq_len: length of every row.

    Returns:
        ``(document_ids, position_ids)``, int32 ``[num_rows, seq_len]``, as the module note says.

    >>> document_ids, position_ids = layout_rows(np.array([3, 2, 4]), np.array([2, 1]), seq_len=6)
    >>> document_ids.tolist()
    [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]
    >>> position_ids.tolist()
    [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    """
    segment_lengths, segment_ids, _ = row_segments(lengths, documents_per_row, seq_len)
    shape = (len(documents_per_row), seq_len)
    document_ids = np.repeat(segment_ids.astype(DTYPE), segment_lengths)
    position_ids = ranges(np.zeros_like(segment_lengths), segment_lengths, DTYPE)
    return document_ids.reshape(shape), position_ids.reshape(shape)


def assemble(
    tokens: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    starts: np.ndarray,
    document_lengths: np.ndarray,
    documents_per_row: np.ndarray,
    seq_len: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """Packed rows from documents stored anywhere in some token arrays, with no loop over samples.

    Every token is gathered once, straight into its row: the index of each output slot comes from
    the row segments (a slot at position p of a document reads ``start + p``; a padding slot reads
    a run of ``seq_len`` pad values appended after the tokens). One index array serves
    ``input_ids`` and ``labels``, and no other temporary of the row size is made.

    Args:
        tokens: arrays whose concatenation holds every document's token ids, in any order.
        labels: arrays of the same sizes, holding the labels (already shifted per document).
        starts: offset of each document in the concatenation, row after row, in pack order.
        document_lengths: token count of each document, in the same order.
        documents_per_row: how many documents each row holds.
        seq_len: length of every row.
        pad_id: token id that fills the tail of a row.

    Returns:
        :data:`PACKED_COLUMNS` as int32 ``[num_rows, seq_len]`` and :data:`STAT_COLUMNS` as int32
        ``[num_rows]``.

    Raises:
        ValueError: if labels and tokens differ in size, a document reaches outside the tokens,
            a length is not positive or a row would exceed ``seq_len``.

    >>> rows = assemble([np.array([5, 6, 7, 8, 9])], [np.array([6, 7, -100, 9, -100])],
    ...                 starts=np.array([3, 0]), document_lengths=np.array([2, 3]),
    ...                 documents_per_row=np.array([2]), seq_len=6, pad_id=0)
    >>> rows["input_ids"].tolist(), rows["labels"].tolist()
    ([[8, 9, 5, 6, 7, 0]], [[9, -100, 6, 7, -100, -100]])
    >>> rows["document_ids"].tolist(), rows["position_ids"].tolist()
    ([[0, 0, 1, 1, 1, 2]], [[0, 1, 0, 1, 2, 0]])
    """
    tokens = np.concatenate([*tokens, np.full(seq_len, pad_id, dtype=DTYPE)])
    labels = np.concatenate([*labels, np.full(seq_len, IGNORE_INDEX, dtype=DTYPE)])
    num_values = len(tokens) - seq_len
    starts = np.asarray(starts, dtype=np.int64)
    document_lengths = np.asarray(document_lengths, dtype=np.int64)
    if len(labels) != len(tokens):
        raise ValueError(
            f"Got {num_values} tokens but {len(labels) - seq_len} labels; give one label per token."
        )
    if len(starts) != len(document_lengths):
        raise ValueError(f"Got {len(starts)} starts for {len(document_lengths)} documents.")
    outside = (starts < 0) | (starts + document_lengths > num_values)
    if outside.any():
        document = int(np.flatnonzero(outside)[0])
        raise ValueError(
            f"Document {document} (start {starts[document]}, {document_lengths[document]} "
            f"tokens) reaches outside the {num_values} tokens given."
        )
    segment_lengths, segment_ids, segment_documents = row_segments(
        document_lengths, documents_per_row, seq_len
    )
    num_rows = len(documents_per_row)
    position_ids = ranges(np.zeros_like(segment_lengths), segment_lengths, DTYPE)
    segment_sources = np.append(starts, num_values)[segment_documents]  # -1 (padding): pad run
    sources = ranges(segment_sources, segment_lengths, index_dtype(len(tokens)))
    row_of_document = np.repeat(np.arange(num_rows), documents_per_row)
    num_tokens = np.bincount(row_of_document, weights=document_lengths, minlength=num_rows)
    shape = (num_rows, seq_len)
    return {
        "input_ids": tokens[sources].astype(DTYPE, copy=False).reshape(shape),
        "labels": labels[sources].astype(DTYPE, copy=False).reshape(shape),
        "position_ids": position_ids.reshape(shape),
        "document_ids": np.repeat(segment_ids.astype(DTYPE), segment_lengths).reshape(shape),
        "num_tokens": num_tokens.astype(DTYPE),
        "num_documents": np.asarray(documents_per_row, dtype=DTYPE),
    }


LABEL_CONVENTIONS = ("hf", "shifted")
"""How an export's ``labels`` are laid out (``rayjobs export --labels``). ``shifted``: as rows
are everywhere in rayjobs (module note), ``labels[t]`` the target of position ``t``. ``hf``: as
Hugging Face models, TRL, Axolotl and torchtune read them, unshifted: ``labels[t] = input_ids[t]``
where token ``t`` is trained, -100 on prompts, padding and each document's first token, so the
model's own shift (logits ``t - 1`` against ``labels[t]``) never crosses a document. The two hold
the same information: each is the other moved by one position inside every document."""

LABELS_METADATA = b"rayjobs.labels"
"""The Parquet schema metadata key under which an export states its ``LABEL_CONVENTIONS``."""


def _same_document(document_ids: np.ndarray) -> np.ndarray:
    """[..., seq_len - 1]: whether positions ``t`` and ``t + 1`` are in one document."""
    return document_ids[..., 1:] == document_ids[..., :-1]


def hf_labels(labels: np.ndarray, document_ids: np.ndarray) -> np.ndarray:
    """Shifted ``labels`` of packed rows [..., seq_len] → the ``hf`` convention.

    >>> hf_labels(np.array([[6, -100, 9, -100, -100]]), np.array([[0, 0, 1, 1, 2]])).tolist()
    [[-100, 6, -100, 9, -100]]
    """
    out = np.full_like(labels, IGNORE_INDEX)
    out[..., 1:] = np.where(_same_document(document_ids), labels[..., :-1], IGNORE_INDEX)
    return out


def shifted_labels(labels: np.ndarray, document_ids: np.ndarray) -> np.ndarray:
    """``hf`` labels of packed rows [..., seq_len] → shifted ones (the inverse of
    ``hf_labels``).

    >>> shifted_labels(np.array([[-100, 6, -100, 9, -100]]), np.array([[0, 0, 1, 1, 2]])).tolist()
    [[6, -100, 9, -100, -100]]
    """
    out = np.full_like(labels, IGNORE_INDEX)
    out[..., :-1] = np.where(_same_document(document_ids), labels[..., 1:], IGNORE_INDEX)
    return out


def export_convention(manifest: dict | None, metadata: dict | None, where: str) -> str:
    """The ``LABEL_CONVENTIONS`` entry of an exported Parquet file, from its schema ``metadata``
    and its export's ``manifest`` (either may be None): they must agree where both say. A
    manifest without ``labels`` is of an export made before the convention was stated, when
    every export was ``shifted``.

    Raises:
        ValueError: naming ``where``, when they disagree, name no known convention, or there is
            neither (a reader that guessed would train on the wrong targets).
    """
    stated = (metadata or {}).get(LABELS_METADATA)
    in_file = stated.decode() if isinstance(stated, bytes) else stated
    in_manifest = None if manifest is None else manifest.get("labels", "shifted")
    if in_file is not None and in_manifest is not None and in_file != in_manifest:
        raise ValueError(
            f"{where}: its labels are {in_file!r} but the manifest says {in_manifest!r}; "
            "export again into a new folder"
        )
    found = in_file or in_manifest
    if found is None:
        raise ValueError(
            f"{where}: no _manifest.json and no {LABELS_METADATA.decode()} metadata say how its "
            "labels are laid out (hf or shifted); read an export made by rayjobs export"
        )
    if found not in LABEL_CONVENTIONS:
        raise ValueError(
            f"{where}: labels convention {found!r} is none of {', '.join(LABEL_CONVENTIONS)}"
        )
    return found
