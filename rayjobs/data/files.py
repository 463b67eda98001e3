"""Where files live: local paths and object-store URIs (S3, GCS, Azure, the Hugging Face Hub),
resolved to pyarrow filesystems, listed, sized and opened the way Ray Data's readers do. No Ray.

A source is a local path (relative to the config's folder) or a URI ``scheme://...``: ``s3://``,
``gs://`` (or ``gcs://``), ``abfs://``/``abfss://``/``az://`` and ``hf://`` (files of a Hub
repository). pyarrow's own filesystems serve S3, GCS and Azure; the Hub goes through
``huggingface_hub``'s fsspec filesystem wrapped in ``pyarrow.fs.PyFileSystem``. Credentials come
from each node's standard environment, never from the config: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, an instance role;
``GOOGLE_APPLICATION_CREDENTIALS``; ``AZURE_STORAGE_ACCOUNT_KEY`` or Azure's default chain;
``HF_TOKEN``. ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) points S3 at an S3-compatible
store, and a dataset's ``storage`` section (``StorageOptions``) may set the endpoint, the region
or anonymous access instead. The driver lists and sizes files (``resolve``); read tasks open their
own (``open_file``) on their node, with random access where the store supports ranged reads.
"""

from __future__ import annotations

import fnmatch
import io
import os
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

REMOTE_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "az", "hf")
"""URI schemes a source may use besides local paths."""

GLOB = re.compile(r"[*?\[]")

STREAM_BUFFER_BYTES = 1 << 20
"""Read-ahead buffer of a file opened as a stream."""


@dataclass(frozen=True)
class StorageOptions:
    """A dataset's ``storage`` settings: what its URIs' filesystem is built with (no secrets:
    credentials stay in the environment)."""

    endpoint_url: str | None = None
    """An S3-compatible endpoint (``http://minio:9000``) or a GCS emulator; default:
    ``AWS_ENDPOINT_URL`` for S3."""
    region: str | None = None
    """S3 region; default: ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else the bucket's."""
    anonymous: bool = False
    """Read public buckets without credentials."""


def scheme_of(source: str) -> str | None:
    """The URI scheme of ``source`` (``s3``...), or None for a local path (``file://`` too)."""
    if "://" not in source:
        return None
    scheme = source.split("://", 1)[0].lower()
    return None if scheme == "file" else scheme


def is_remote(source: str) -> bool:
    return scheme_of(source) is not None


def local_path(source: str) -> str:
    """A local source as a path (``file://`` stripped)."""
    return source[len("file://") :] if source.startswith("file://") else source


def shown(uri: str) -> str:
    """``uri`` as messages show it: never a password or token a user put into it."""
    parts = urlsplit(uri)
    if parts.password or parts.username:
        host = parts.hostname or ""
        return uri.replace(parts.netloc, host + (f":{parts.port}" if parts.port else ""), 1)
    return uri


class StorageError(OSError):
    """A source that cannot be listed or read, said for a person (access denied, no such bucket,
    no credentials, an unknown scheme), naming the URI and nothing secret."""


def filesystem(source: str, options: StorageOptions | None = None) -> tuple[pafs.FileSystem, str]:
    """The filesystem ``source`` lives on and its path there.

    Raises:
        StorageError: an unknown scheme, or a filesystem that cannot be made.
    """
    options = options or StorageOptions()
    scheme = scheme_of(source)
    if scheme is None:
        return pafs.LocalFileSystem(), os.path.abspath(local_path(source))
    if scheme not in REMOTE_SCHEMES:
        raise StorageError(
            f"{shown(source)}: unknown scheme {scheme!r}; a source is a local path or a URI of "
            f"{', '.join(s + '://' for s in REMOTE_SCHEMES)}"
        )
    rest = source.split("://", 1)[1]
    try:
        if scheme == "s3":
            return _s3(options), rest
        if scheme in ("gs", "gcs"):
            return _gcs(options), rest
        if scheme == "hf":
            return _hub(), rest
        return _azure(scheme, rest)
    except (ValueError, OSError, ImportError) as error:
        raise StorageError(f"{shown(source)}: cannot open its filesystem: {error}") from None


def path_of(source: str) -> str:
    """``source``'s path on its filesystem (``filesystem`` without making the filesystem)."""
    scheme = scheme_of(source)
    if scheme is None:
        return os.path.abspath(local_path(source))
    rest = source.split("://", 1)[1]
    if scheme in ("abfs", "abfss", "az"):
        container, _, path = rest.partition("/")
        return f"{container.split('@', 1)[0]}/{path}".rstrip("/")
    return rest


def _endpoint(url: str | None) -> dict[str, str]:
    """``endpoint_override`` and ``scheme`` of pyarrow's S3/GCS filesystems from an endpoint URL."""
    if not url:
        return {}
    parts = urlsplit(url if "://" in url else f"https://{url}")
    return {"endpoint_override": parts.netloc + parts.path.rstrip("/"), "scheme": parts.scheme}


def _s3(options: StorageOptions) -> pafs.S3FileSystem:
    endpoint = options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
    region = options.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return pafs.S3FileSystem(
        anonymous=options.anonymous,
        region=region,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=5),
        **_endpoint(endpoint),
    )


def _gcs(options: StorageOptions) -> pafs.GcsFileSystem:
    endpoint = _endpoint(options.endpoint_url)
    return pafs.GcsFileSystem(
        anonymous=options.anonymous,
        **({"endpoint_override": endpoint["endpoint_override"], "scheme": endpoint["scheme"]}
           if endpoint else {}),
    )  # fmt: skip


def _azure(scheme: str, rest: str) -> tuple[pafs.FileSystem, str]:
    """``abfs[s]://container@account.dfs.core.windows.net/path``, or ``az://container/path``
    with the account from ``AZURE_STORAGE_ACCOUNT_NAME``."""
    container, _, path = rest.partition("/")
    account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    if "@" in container:
        container, host = container.split("@", 1)
        account = host.split(".", 1)[0]
    if not account:
        raise ValueError("no storage account: name it (container@account...) or set "
                         "AZURE_STORAGE_ACCOUNT_NAME")  # fmt: skip
    return pafs.AzureFileSystem(account_name=account), f"{container}/{path}".rstrip("/")


def _hub() -> pafs.FileSystem:
    from huggingface_hub import HfFileSystem

    return pafs.PyFileSystem(pafs.FSSpecHandler(HfFileSystem()))


def hub_snapshot(name: str, revision: str | None) -> str | None:
    """Offline (``HF_HUB_OFFLINE=1``): the folder of the Hugging Face Hub cache (``HF_HUB_CACHE``)
    that holds dataset ``name`` at ``revision`` (a branch, tag or commit; default ``main``) as
    ``huggingface_hub`` downloaded it, read then as a local Hub-layout folder (``datasets`` looks
    only in its own Arrow cache offline). None online, where the Hub is asked, or when that
    revision is not cached."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    if not constants.HF_HUB_OFFLINE:
        return None
    try:
        return snapshot_download(name, repo_type="dataset", revision=revision,
                                 local_files_only=True)  # fmt: skip
    except (LocalEntryNotFoundError, HFValidationError):
        return None


def saved_dataset(source: str) -> bool:
    """Whether ``source`` is a folder ``datasets``' ``save_to_disk`` wrote (a ``Dataset`` or a
    ``DatasetDict``), not a dataset repository laid out as on the Hub."""
    folder = Path(local_path(source))
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def uri_of(source: str, path: str) -> str:
    """The URI of ``path`` on ``source``'s filesystem (the form every later step reads)."""
    scheme = scheme_of(source)
    if scheme is None:
        return path
    if scheme in ("abfs", "abfss", "az"):
        container_part = source.split("://", 1)[1].split("/", 1)[0]
        _, _, inside = path.partition("/")
        return f"{scheme}://{container_part}/{inside}"
    return f"{scheme}://{path}"


DENIED = ("access denied", "accessdenied", "access_denied", "forbidden", "invalidaccesskeyid",
          "invalid_access_key_id", "signaturedoesnotmatch", "signature_does_not_match")  # fmt: skip
"""What stores say (lowercased) when the credentials are wrong or do not allow the read."""

NO_BUCKET = ("nosuchbucket", "no_such_bucket", "bucket does not exist")


def explain(error: BaseException, source: str) -> str:
    """What went wrong reading ``source``, for a person: access denied, a missing bucket or key,
    no credentials, or the filesystem's own words (with the URI, never a secret)."""
    text = str(error)
    lowered = text.lower()
    where = shown(source)
    if any(word in lowered for word in DENIED):
        return (
            f"{where}: access denied (wrong or missing credentials: check AWS_ACCESS_KEY_ID / "
            f"AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS or the node's role)"
        )
    if any(word in lowered for word in NO_BUCKET):
        return f"{where}: no such bucket"
    if any(k in lowered for k in ("unable to locate credentials", "no credentials",
                                  "credentials not found")):  # fmt: skip
        return f"{where}: no credentials found in the environment"
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return f"{where}: {first}"


@dataclass(frozen=True)
class Found:
    """A file a source names: its URI (or local path) and size in bytes."""

    uri: str
    size: int


def resolve(source: str, accept, options: StorageOptions | None = None) -> list[Found]:
    """The files ``source`` names, sorted: itself (a file), every file under it whose name
    ``accept`` takes (a folder or prefix), or the files matching it (a glob; ``**`` crosses
    folders). Empty when nothing matches.

    Raises:
        StorageError: the source cannot be listed (access denied, no such bucket, ...).
    """
    fs, path = filesystem(source, options)
    try:
        if GLOB.search(path):
            return _glob(fs, source, path)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound and is_remote(source):
            _check_bucket(fs, source, path)
        if info.type == pafs.FileType.File:
            return [Found(uri_of(source, info.path), int(info.size or 0))]
        if info.type == pafs.FileType.Directory or (is_remote(source) and path.endswith("/")):
            listed = fs.get_file_info(pafs.FileSelector(path.rstrip("/"), recursive=True,
                                                        allow_not_found=True))  # fmt: skip
            return sorted(
                (Found(uri_of(source, i.path), int(i.size or 0)) for i in listed
                 if i.type == pafs.FileType.File and accept(i.base_name)),
                key=lambda f: f.uri,
            )  # fmt: skip
        return []
    except StorageError:
        raise
    except (OSError, ValueError) as error:
        raise StorageError(explain(error, source)) from None


def _check_bucket(fs: pafs.FileSystem, source: str, path: str) -> None:
    """A key that is not found may be in a bucket that does not exist: say which."""
    bucket = path.split("/", 1)[0]
    if bucket and fs.get_file_info(bucket).type == pafs.FileType.NotFound:
        raise StorageError(f"{shown(source)}: no such bucket ({bucket})")


def _glob(fs: pafs.FileSystem, source: str, pattern: str) -> list[Found]:
    """Files matching ``pattern``: everything under its longest wildcard-free folder, matched
    part by part (``*`` stays within a folder, ``**`` spans any)."""
    parts = pattern.split("/")
    fixed = next(i for i, part in enumerate(parts) if GLOB.search(part))
    base = "/".join(parts[:fixed]) or ("/" if pattern.startswith("/") else "")
    listed = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    regex = re.compile(_glob_regex(pattern))
    return sorted(
        (Found(uri_of(source, i.path), int(i.size or 0)) for i in listed
         if i.type == pafs.FileType.File and regex.fullmatch(i.path)),
        key=lambda f: f.uri,
    )  # fmt: skip


def _glob_regex(pattern: str) -> str:
    """A glob as a regex over '/'-separated paths: ``**/`` any folders (none too), ``**`` and
    ``*`` as ``glob`` takes them."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            piece = re.match(r"[^*]+|\*", pattern[i:]).group(0)
            out += "[^/]*" if piece == "*" else fnmatch.translate(piece)[4:-3]
            i += len(piece)
    return out


def sizes(uris: Iterable[str], options: StorageOptions | None = None) -> dict[str, int]:
    """Each file's bytes, asked of its filesystem, one call per filesystem (a dataset cut by
    ``inspect --limit`` mixes its store's files with local copies)."""
    by_scheme: dict[str | None, list[str]] = {}
    for uri in dict.fromkeys(uris):
        by_scheme.setdefault(scheme_of(uri), []).append(uri)
    found = {}
    for group in by_scheme.values():
        fs, _ = filesystem(group[0], options)
        try:
            infos = fs.get_file_info([path_of(u) for u in group])
        except (OSError, ValueError) as error:
            raise StorageError(explain(error, group[0])) from None
        found.update({uri: int(info.size or 0) for uri, info in zip(group, infos, strict=True)})
    return found


def compression_of(path: str) -> str | None:
    """The codec a file's extension names (``gzip`` for ``.gz``, …), as Ray Data infers it."""
    try:
        return pa.Codec.detect(path).name
    except (TypeError, ValueError):  # no codec's extension
        return None


class _Whole(io.RawIOBase):
    """A raw file that must give ``size`` bytes: one that ends before is an error (``OSError``),
    so a store that drops a connection without one cannot cut a file short unseen."""

    def __init__(self, raw: pa.NativeFile, size: int, uri: str):
        super().__init__()
        self.raw, self.size, self.uri, self.at = raw, size, uri, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.raw.read(len(buffer))
        if not data and self.at < self.size:
            raise OSError(
                f"the stream ended after {self.at:,} of {self.size:,} bytes (connection lost)"
            )
        buffer[: len(data)] = data
        self.at += len(data)
        return len(data)

    def close(self) -> None:
        self.raw.close()
        super().close()


def open_file(
    uri: str,
    random_access: bool,
    options: StorageOptions | None = None,
    size: int | None = None,
    read_ahead: bool = True,
) -> tuple[pa.NativeFile, pa.NativeFile]:
    """``uri`` opened as a read task reads it: (the file as read, the raw file under it). The raw
    file is opened for random access (ranged reads on an object store); with ``random_access``
    (an uncompressed Parquet file: its footer is at its end) it is the file read, else it is read
    as a stream, decompressed by its extension (``.gz``, ``.bz2``, ``.zst``), through a read-ahead
    buffer unless ``read_ahead`` is off; with its listed ``size``, a stream that ends before it is
    an error. The raw file's ``tell()`` counts the bytes fetched, compressed or not: without read-
    ahead, the bytes read (what the driver's head parse sizes a dataset by).

    Raises:
        StorageError: the file cannot be opened (said as ``explain`` says it).
    """
    fs, path = filesystem(uri, options)
    codec = compression_of(path)
    try:
        raw = fs.open_input_file(path)
    except OSError as error:
        raise StorageError(explain(error, uri)) from None
    if random_access and codec is None:
        return raw, raw
    source = raw if size is None else pa.PythonFile(_Whole(raw, size, uri), mode="r")
    stream = pa.BufferedInputStream(source, STREAM_BUFFER_BYTES) if read_ahead else source
    return (pa.CompressedInputStream(stream, codec) if codec else stream), raw


def _split(path: str) -> tuple[str, str]:
    """(``scheme://`` or "", the rest) of a URI or a local path (made absolute)."""
    scheme = scheme_of(path)
    if scheme is None:
        return "", os.path.abspath(local_path(path))
    return f"{scheme}://", path.split("://", 1)[1]


def common_root(paths: Iterable[str]) -> str | None:
    """The deepest folder (or prefix) all ``paths`` lie under, None for none: what a file's
    place in its dataset is named from (``place``)."""
    split = [_split(p) for p in paths]
    if not split or len({scheme for scheme, _ in split}) != 1:
        return None
    scheme = split[0][0]
    return scheme + posixpath.commonpath([posixpath.dirname(rest) for _, rest in split])


def place(path: str, root: str | None) -> str:
    """``path`` named relative to ``root`` (``common_root``): the same for the same data wherever
    its folder or bucket lies."""
    if root is None:
        return path
    scheme, rest = _split(path)
    root_scheme, root_rest = _split(root) if "://" in root else ("", root)
    if scheme != root_scheme:
        return path
    return posixpath.relpath(rest, root_rest)
