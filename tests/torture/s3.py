"""A moto S3 server on 127.0.0.1, for the conftest fixture and for scripts that run outside pytest.

moto's server mode is a real HTTP S3 endpoint (what s3fs itself tests with). It must listen on loopback only, and
``S3_UPLOAD_PART_MIN_SIZE`` must be set before moto is imported so that multipart logic runs on small parts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def moto_env() -> None:
    """Dummy credentials and no user AWS config, so nothing can reach a real account."""
    os.environ.setdefault("S3_UPLOAD_PART_MIN_SIZE", "1024")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ["BOTO_CONFIG"] = "/dev/null"
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_SESSION_TOKEN", None)


@contextlib.contextmanager
def moto_server(bucket: str | None = "ckpt-torture") -> Iterator[str]:
    """Start moto on 127.0.0.1 (random port), create ``bucket`` (unless None); yield the endpoint URL."""
    moto_env()
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    try:
        if bucket is not None:
            boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield url
    finally:
        server.stop()
