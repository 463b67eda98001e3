"""A real S3-protocol server on loopback for the object-storage tests: moto's server in this
process, with IAM authentication enforced (a wrong key is refused as a real store refuses it);
and a filesystem wrapper (``counted``) that counts the bytes a process reads through it."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs


@dataclass(frozen=True)
class S3:
    endpoint: str
    """``http://127.0.0.1:<port>``"""
    access_key: str
    secret_key: str
    stop: Any = field(default=None, compare=False, repr=False)
    """Stops the server (the store going down); it stays down."""

    @property
    def env(self) -> dict[str, str]:
        """The standard environment that points S3 clients at this server with its credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def filesystem(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            endpoint_override=self.endpoint.removeprefix("http://"),
            scheme="http",
            region="us-east-1",
            allow_bucket_creation=True,
        )

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` to ``bucket/key`` (the bucket made if need be)."""
        fs = self.filesystem()
        fs.create_dir(key.split("/", 1)[0])
        with fs.open_output_stream(key, compression=None) as out:
            out.write(data)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def s3_server() -> Iterator[S3]:
    """A moto S3 server on 127.0.0.1 with one IAM user allowed everything; from its first S3
    request on, every request must be signed with that user's key."""
    import boto3
    from moto import settings
    from moto.core.responses import ActionAuthenticatorMixin
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    before = settings.INITIAL_NO_AUTH_ACTION_COUNT
    user = f"rayjobs-{port}"  # moto's accounts are the process's: one user per server
    settings.INITIAL_NO_AUTH_ACTION_COUNT = float("inf")  # the user is made unsigned
    try:
        iam = boto3.client(
            "iam", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap",
        )  # fmt: skip
        iam.create_user(UserName=user)
        policy = iam.create_policy(
            PolicyName=f"everything-{port}",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
                }
            ),
        )
        iam.attach_user_policy(UserName=user, PolicyArn=policy["Policy"]["Arn"])
        key = iam.create_access_key(UserName=user)["AccessKey"]
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from here on, every request is checked
        ActionAuthenticatorMixin.request_count = 0
        yield S3(endpoint, key["AccessKeyId"], key["SecretAccessKey"], server.stop)
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before
        server.stop()


class Reads:
    """What this process read through ``counted`` filesystems: by path, the bytes read from each
    time it was opened, in order."""

    def __init__(self):
        self.opened: dict[str, list[int]] = {}

    def open(self, path: str) -> int:
        """Note an opening of ``path``; its number among them."""
        self.opened.setdefault(path, []).append(0)
        return len(self.opened[path]) - 1

    def add(self, path: str, opening: int, count: int) -> None:
        self.opened[path][opening] += count


class _CountedFile:
    """A file opened for reading whose every read, ranged ones included (pyarrow's ``read_at``
    of a Python file is a seek and a read), is counted."""

    def __init__(self, file: pa.NativeFile, path: str, reads: Reads):
        self.file, self.path, self.reads = file, path, reads
        self.opening = reads.open(path)

    def read(self, size: int = -1) -> bytes:
        data = self.file.read() if size is None or size < 0 else self.file.read(size)
        self.reads.add(self.path, self.opening, len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def size(self) -> int:
        return self.file.size()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self.file.seekable()

    @property
    def closed(self) -> bool:
        return self.file.closed

    def close(self) -> None:
        self.file.close()


class _Counting(pafs.FileSystemHandler):
    """``fs`` as is, except that what is read from the files it opens is counted in ``reads``."""

    def __init__(self, fs: pafs.FileSystem, reads: Reads):
        self.fs, self.reads = fs, reads

    def __eq__(self, other) -> bool:
        return isinstance(other, _Counting) and self.fs.equals(other.fs)

    def __ne__(self, other) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return f"counting+{self.fs.type_name}"

    def normalize_path(self, path):
        return self.fs.normalize_path(path)

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        self.fs.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path):
        self.fs.delete_file(path)

    def move(self, src, dest):
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path):
        file = self.fs.open_input_stream(path, compression=None)
        return pa.PythonFile(_CountedFile(file, path, self.reads), mode="r")

    def open_input_file(self, path):
        file = self.fs.open_input_file(path)
        return pa.PythonFile(_CountedFile(file, path, self.reads), mode="r")

    def open_output_stream(self, path, metadata):
        return self.fs.open_output_stream(path, compression=None, metadata=metadata)

    def open_append_stream(self, path, metadata):
        return self.fs.open_append_stream(path, compression=None, metadata=metadata)


def counted(fs: pafs.FileSystem, reads: Reads) -> pafs.FileSystem:
    """``fs``, every byte read through it noted in ``reads`` by path."""
    return pafs.PyFileSystem(_Counting(fs, reads))
