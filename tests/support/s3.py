"""A real S3-compatible server on loopback for object-store run dirs: moto's standalone server (`moto_server`, from
the dev extra) started on a free port and stopped by its PID. pyarrow, Ray Train and Ray Data reach it through
`AWS_ENDPOINT_URL`, so `s3://` URIs in configs work unchanged.

    def test_x(s3_server): cfg = ... run.storage_path=f"s3://{s3_server.bucket}/runs" ... env=s3_server.env
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import free_ports


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    env: dict[str, str]
    process: subprocess.Popen


def start_s3(log_path: Path, bucket: str = "eagle3") -> S3Server:
    (port,) = free_ports(1)
    endpoint = f"http://127.0.0.1:{port}"
    log = open(log_path, "w")
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    request = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")  # S3 CreateBucket
    urllib.request.urlopen(request, timeout=10)
    return S3Server(endpoint=endpoint, bucket=bucket, env=env, process=process)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = start_s3(tmp_path_factory.mktemp("s3") / "moto.log")
    yield server
    server.process.terminate()
    server.process.wait(timeout=10)


@contextlib.contextmanager
def pointed_at(server: S3Server):
    """While inside, this process's environment points pyarrow (storage.*) at `server`, as a user's would at theirs."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in server.env.items():
            env.setenv(key, value)
        yield server


@pytest.fixture
def s3_env(s3_server) -> S3Server:
    """This test's environment pointed at the loopback server."""
    with pointed_at(s3_server):
        yield s3_server
