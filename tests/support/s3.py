"""A real S3-protocol server on loopback for the object-storage tests: moto's server in this
process, with IAM authentication enforced (a wrong key is refused as a real store refuses it)."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow.fs as pafs


@dataclass(frozen=True)
class S3:
    endpoint: str
    """``http://127.0.0.1:<port>``"""
    access_key: str
    secret_key: str

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
        yield S3(endpoint, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before
        server.stop()
