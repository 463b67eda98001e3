"""A ``.json`` file: one JSON list (or one object), parsed element by element.

``json.loads``' own scanner runs over a sliding window of the decoded text, so records and errors
(message, line, column) are those of ``json.loads`` on the whole file, in bounded memory. The file
is one JSON value: invalid JSON fails the file under either ``on_bad_row`` policy.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import Any

from rayjobs.data.formats.registry import BOM, FileOptions, Parsed, Readable, register_format


@register_format("json", (".json",), late_file_errors=True)
def _json(file: Readable, options: FileOptions, chunk_bytes: int) -> Iterator[Parsed]:
    """A JSON list element by element: ``json.loads``' own steps (the C scanner for each value, the
    array and whitespace rules of ``json.decoder``) over a window of the decoded text, so records
    and errors (message, line, column) are those of ``json.loads`` on the whole file. A value is
    taken once the characters the scanner may look at after it are in the window (a number could
    go on); a value that fails is tried again with more text, until the file has ended (the
    failure may be the window's edge). A list's own errors (a missing or trailing comma) are put
    into words by ``json.loads`` itself, on the few characters at fault. Undecodable bytes become
    lone surrogates, so the file still parses and the records holding them can be skipped one by
    one (bytes outside strings make the JSON invalid)."""
    text = _JsonText(file, chunk_bytes)
    scan = json.JSONDecoder().scan_once
    parsed, row, state, single = Parsed(), 0, "start", ()
    while True:
        buf, at, more = text.buf, text.at, False
        if state == "start":
            if not buf and not text.ended:
                more = True
            elif text.base == 0 and at == 0 and buf.startswith("\ufeff"):
                raise text.error("Unexpected UTF-8 BOM (decode using utf-8-sig)", 0)
            else:
                text.at = at = _WS(buf, at).end()
                if at == len(buf) and not text.ended:
                    more = True
                elif at == len(buf):  # empty, or whitespace only: no rows (config calls it empty)
                    break
                elif buf.startswith("[", at):
                    text.at, state = at + 1, "first"
                else:
                    state = "single"
        elif state == "first":  # after "["
            text.at = at = _WS(buf, at).end()
            if at == len(buf) and not text.ended:
                more = True
            elif buf.startswith("]", at):
                text.at, state = at + 1, "trailing"
            else:
                state = "element"
        elif state == "comma":  # at a "," after an element
            after = _WS(buf, at + 1).end()
            if after == len(buf) and not text.ended:
                more = True
            elif buf.startswith("]", after):  # a trailing comma
                raise text.list_error(at, after + 1)
            else:
                text.at, state = after, "element"
        elif state in ("element", "single"):
            scanned = text.scan(scan, at)
            if scanned is None:
                more = True
            elif state == "single":
                single, text.at, state = (scanned[0],), scanned[1], "trailing"
            else:
                value, end = scanned
                after = _WS(buf, end).end()
                if after == len(buf) and not text.ended:
                    more = True
                elif buf.startswith(("]", ","), after):
                    _json_record(parsed, row, value)
                    row += 1
                    if buf[after] == "]":
                        text.at, state = after + 1, "trailing"
                    else:
                        text.at, state = after, "comma"
                else:
                    raise text.list_error(end, after + 1)
        elif state == "trailing":
            text.at = at = _WS(buf, at).end()
            if at < len(buf):
                raise text.error("Extra data", at)
            if text.ended:
                break
            more = True
        if more:
            if parsed.rows or parsed.bad:
                yield parsed
                parsed = Parsed()
            text.more()
    if single:
        [records] = single
        if isinstance(records, dict):
            records = [records]
        if not isinstance(records, list):
            raise ValueError("a .json file must hold a list of records")
        for row, record in enumerate(records):
            _json_record(parsed, row, record)
    yield parsed


_WS = re.compile(r"[ \t\n\r]*").match
"""Whitespace as ``json.decoder`` skips it."""


class _JsonText:
    """The window of a JSON file's decoded text that :func:`_json` parses: ``buf`` from character
    ``base`` of the file; ``at``, where parsing stands in it (what is before is done)."""

    def __init__(self, file: Readable, chunk_bytes: int):
        self.file, self.chunk_bytes = file, chunk_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.buf, self.at, self.base, self.ended = "", 0, 0, False
        self.lines, self.line_start = 0, -1  # newlines before base; the last one's position
        self.started = False  # a leading byte order mark looked for

    def more(self) -> None:
        """Drop what is done, and decode more of the file (at least as much as is held, so that a
        long value is not scanned once per chunk)."""
        done = self.buf[: self.at]
        if (newlines := done.count("\n")) > 0:
            self.lines += newlines
            self.line_start = self.base + done.rindex("\n")
        self.base += self.at
        self.buf, self.at = self.buf[self.at :], 0
        data = self.file.read(max(self.chunk_bytes, len(self.buf)))
        self.ended = not data
        if not self.started:
            while len(data) < len(BOM) and (piece := self.file.read(self.chunk_bytes)):
                data += piece
            data, self.started = data.removeprefix(BOM), True
        self.buf += self.decoder.decode(data, final=self.ended)

    def scan(self, scan, at: int) -> tuple[Any, int] | None:
        """The value at ``at`` and where it ends, or None: more text is needed to tell."""
        try:
            value, end = scan(self.buf, at)
        except StopIteration as stop:
            if not self.ended:
                return None
            raise self.error("Expecting value", stop.value) from None
        except json.JSONDecodeError as error:
            if not self.ended:
                return None
            raise self.error(error.msg, error.pos) from None
        except RecursionError:
            raise self.error("a value nested deeper than Python's JSON parser goes", at) from None
        if not self.ended and (
            end == len(self.buf) or (type(value) in (int, float) and end + 3 > len(self.buf))
        ):
            return None  # "1e" at the window's edge may go on ("1e+5": the scanner looks 3 ahead)
        return value, end

    def list_error(self, start: int, stop: int) -> ValueError:
        """The error of a list whose element ends at ``start`` and whose text goes on, wrongly, to
        ``stop``: what ``json.loads`` says of it (its wording differs between Python versions)."""
        try:
            json.loads("[0" + self.buf[start:stop])
        except json.JSONDecodeError as error:
            return self.error(error.msg, start + error.pos - 2)
        raise AssertionError(f"valid JSON list text: {self.buf[start:stop]!r}")

    def error(self, message: str, at: int) -> ValueError:
        """The file's error for ``json.loads``' ``message`` at ``at`` in the window."""
        newline = self.buf.rfind("\n", 0, at)
        line = self.lines + self.buf.count("\n", 0, at) + 1
        column = at - newline if newline >= 0 else self.base + at - self.line_start
        hint = " (one object per line? set format: jsonl)" if message == "Extra data" else ""
        return ValueError(
            f"not valid JSON at line {line}, column {column}: {message}{hint}; "
            f"a .json file is parsed whole, so on_bad_row cannot skip part of it"
        )


def _json_record(parsed: Parsed, row: int, record: Any) -> None:
    dumped = _utf8_json(record)
    if dumped is None:
        parsed.add_bad(row, "invalid_utf8", f"{_undecodable(record)}not valid UTF-8")
        return
    parsed.rows.append(row)
    parsed.records.append(dumped)


def _utf8_json(record: Any) -> str | None:
    """A parsed JSON value as JSON text, or None when its text is not all UTF-8 (a lone surrogate
    such as ``"\\ud800"``, which JSON can escape but no UTF-8 text holds)."""
    dumped = json.dumps(record, ensure_ascii=False)
    try:
        dumped.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return dumped


def _undecodable(record: Any) -> str:
    """``"field 'x': "`` for the first top-level field of a record that holds undecodable text."""
    if isinstance(record, dict):
        for key, value in record.items():
            if _utf8_json({key: value}) is None:
                return f"field {key!r}: "
    return ""
