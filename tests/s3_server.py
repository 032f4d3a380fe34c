"""An S3-compatible server on 127.0.0.1 for the object-store tests: moto in server mode, in a thread
of the test process. pyarrow (and so Ray Train) reaches it through AWS_ENDPOINT_URL, which child
processes (a Ray cluster started afterwards) inherit."""

from __future__ import annotations

import contextlib
import os

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_server(bucket: str):
    """Yield the endpoint URL of a fresh server holding an empty `bucket`; env restored on exit."""
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is in the test extra")
    boto3 = pytest.importorskip("boto3")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in (*CREDENTIALS, "AWS_ENDPOINT_URL")}
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
