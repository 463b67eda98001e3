"""Copy a wheel without some of its files, as a valid wheel: the files left out and their lines in
``*.dist-info/RECORD`` go; every other entry is copied as it was (same name, bytes, timestamps and
compression), and the RECORD's hashes of the copy are checked before it is kept.

    python tests/gpu/strip_wheel.py IN.whl OUT_DIR ray/jars/ray_dist.jar

Used by ``make_wheelhouse.sh`` to carry Ray to the GPU machine without its Java jar (Java
workers only; a Python job never reads it), which alone is over a third of the wheel. Needs only
the standard library.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import sys
import zipfile
from pathlib import Path


def record_name(names: list[str]) -> str:
    (record,) = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    return record


def strip(wheel: Path, out_dir: Path, drop: set[str]) -> Path:
    """Write ``out_dir/<wheel's name>`` without the entries in ``drop``; returns its path."""
    out = out_dir / wheel.name
    if out.resolve() == wheel.resolve():
        raise ValueError(f"{out} would overwrite its input")
    with zipfile.ZipFile(wheel) as source:
        names = source.namelist()
        missing = drop - set(names)
        if missing:
            raise ValueError(f"{wheel.name} holds no {', '.join(sorted(missing))}")
        record = record_name(names)
        lines = source.read(record).decode().splitlines(keepends=True)
        kept_lines = [line for line in lines if line.split(",", 1)[0] not in drop]
        if len(lines) - len(kept_lines) != len(drop):
            raise ValueError(f"{record} does not list each of {sorted(drop)} once")
        tmp = out.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w") as target:
            for info in source.infolist():
                if info.filename in drop:
                    continue
                data = "".join(kept_lines).encode() if info.filename == record else None
                with source.open(info) as member:
                    target.writestr(info, data if data is not None else member.read())
    check(tmp)
    tmp.replace(out)
    return out


def check(wheel: Path) -> None:
    """Every file of ``wheel`` is in its RECORD with the right sha256 and size, and every RECORD
    line is a file of the wheel (what ``wheel unpack`` and installers verify)."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if not n.endswith("/")]
        record = record_name(names)
        rows = {row[0]: row for row in csv.reader(io.StringIO(z.read(record).decode())) if row}
        if set(rows) != set(names):
            extra, absent = set(rows) - set(names), set(names) - set(rows)
            raise ValueError(f"RECORD lists {sorted(extra)[:3]}, misses {sorted(absent)[:3]}")
        for name in names:
            if name == record:
                continue
            _, digest, size = rows[name]
            data = z.read(name)
            want = (
                "sha256="
                + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            )
            if digest != want or int(size) != len(data):
                raise ValueError(f"{name}: RECORD says {digest} {size}, the file is {want}")


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    wheel, out_dir, *drop = argv
    out = strip(Path(wheel), Path(out_dir), set(drop))
    before, after = Path(wheel).stat().st_size, out.stat().st_size
    print(f"{out}: {after / 2**20:.1f} MiB (was {before / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
