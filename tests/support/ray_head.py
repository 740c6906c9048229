"""A real `ray start --head` for job tests: free ports, its temp dir inside the test's, token auth on, and a
REST/CLI client that always sends the token. Stopped by its own PIDs, never by `ray stop` (which would kill every
Ray process on this shared machine). The autoscaling bed (tests/support/autoscaling.py) starts its head with it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.support import REPO
from tests.support.processes import free_ports, kill_processes

VENV_BIN = Path(sys.executable).parent
PORT_FLAGS = (
    "port",
    "dashboard-port",
    "metrics-export-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "ray-client-server-port",
    "node-manager-port",
    "object-manager-port",
)


@dataclass
class RayHead:
    """A running head: its ports, its token, and the environment every client of it needs."""

    temp_dir: Path
    ports: dict[str, int]
    token: str
    env: dict[str, str]
    process: subprocess.Popen

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.ports['dashboard-port']}"

    def get(self, route: str, *, token: str | None = None) -> dict | list:
        """GET a dashboard REST route with the bearer token (pass token="" to send none)."""
        token = self.token if token is None else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(self.address + route, headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def post(self, route: str) -> dict | list:
        """POST a dashboard REST route (empty body) with the bearer token."""
        request = urllib.request.Request(
            self.address + route, data=b"", method="POST", headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def status_code(self, route: str, *, token: str) -> int:
        try:
            self.get(route, token=token)
            return 200
        except urllib.error.HTTPError as e:
            return e.code

    def ray_cli(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        """Run `ray <args>` against this head with the token in the environment; fails loudly on error."""
        out = subprocess.run(
            [str(VENV_BIN / "ray"), *args], env=self.env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO
        )
        assert out.returncode == 0, f"ray {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
        return out

    def submit(self, submission_id: str, *entrypoint: str, env_vars: dict[str, str] | None = None) -> str:
        """`ray job submit --no-wait` with the repo as working dir (its .gitignore keeps .venv and runs/ out)."""
        runtime_env = {"env_vars": env_vars or {}, "excludes": [".git", "bench", "*.egg-info"]}
        self.ray_cli(
            "job",
            "submit",
            "--address",
            self.address,
            "--submission-id",
            submission_id,
            "--working-dir",
            str(REPO),
            "--runtime-env-json",
            json.dumps(runtime_env),
            "--no-wait",
            "--",
            *entrypoint,
        )
        return submission_id

    def job(self, submission_id: str) -> dict:
        return self.get(f"/api/jobs/{submission_id}")

    def logs(self, submission_id: str) -> str:
        return self.get(f"/api/jobs/{submission_id}/logs")["logs"]

    def wait(
        self, submission_id: str, statuses: set[str], *, timeout_s: float, every_s: float = 1.0, on_poll=None
    ) -> dict:
        """Poll GET /api/jobs/{id} until its status is in `statuses`; fail with the job's logs on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(submission_id)
            if on_poll is not None:
                on_poll(info)
            if info["status"] in statuses:
                return info
            if info["status"] in {"FAILED", "STOPPED", "SUCCEEDED"}:
                pytest.fail(
                    f"job {submission_id} ended {info['status']} ({info.get('message')}):\n"
                    f"{self.logs(submission_id)[-6000:]}"
                )
            time.sleep(every_s)
        pytest.fail(f"job {submission_id} not {statuses} after {timeout_s}s:\n{self.logs(submission_id)[-6000:]}")


def _head_env(temp_dir: Path, token_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # jobs run vLLM's engine core in a process of its own, as users do
    env.update(
        {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token_path),
            "RAY_USAGE_STATS_ENABLED": "0",
            # Report custom metrics every second instead of every 10 s, so short stages show up in a scrape.
            "RAY_metrics_report_interval_ms": "1000",
            "PATH": f"{VENV_BIN}:{env.get('PATH', '')}",
            "HOME": str(temp_dir / "home"),
            # what jobs keep in the temp dir (the tiny verifier of a run dir on S3) stays inside the test's
            "TMPDIR": str(temp_dir / "tmp"),
        }
    )
    return env


def start_head(
    temp_dir: Path,
    *,
    num_cpus: int = 8,
    timeout_s: float = 90,
    ports: dict[str, int] | None = None,
    extra_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
) -> RayHead:
    """`ray start --head --block` in a process group of its own, ready when the jobs API answers. `ports` (one per
    PORT_FLAGS entry, free ones if None), `extra_args` and `extra_env` are for heads that need more, such as the
    autoscaling test bed (tests/support/autoscaling.py)."""
    temp_dir.mkdir(parents=True, exist_ok=True)
    (temp_dir / "home").mkdir(exist_ok=True)
    (temp_dir / "tmp").mkdir(exist_ok=True)
    token = secrets.token_hex(32)
    token_path = temp_dir / "auth_token"
    token_path.write_text(token)
    token_path.chmod(0o600)
    ports = ports or dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    env = {**_head_env(temp_dir, token_path), **(extra_env or {})}
    cmd = [
        str(VENV_BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--dashboard-host=127.0.0.1",
        f"--num-cpus={num_cpus}",
        f"--temp-dir={temp_dir / 'ray'}",
        "--disable-usage-stats",
        *[f"--{flag}={port}" for flag, port in ports.items()],
        *extra_args,
    ]
    log = open(temp_dir / "ray_start.log", "w")
    process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    head = RayHead(temp_dir=temp_dir, ports=ports, token=token, env=env, process=process)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"ray start exited:\n{(temp_dir / 'ray_start.log').read_text()}"
        try:
            head.get("/api/jobs/")
            return head
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(1)
    stop_head(head)
    raise TimeoutError(f"Ray head not up after {timeout_s}s:\n{(temp_dir / 'ray_start.log').read_text()}")


def _own_processes(head: RayHead) -> list[psutil.Process]:
    """Processes of this head: the `ray start` group plus anything whose command line names its temp dir
    (gcs_server, raylet, dashboard, workers, job drivers whose storage is inside the test dir)."""
    mark = str(head.temp_dir)
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and any(mark in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def stop_head(head: RayHead) -> None:
    """SIGTERM the `ray start --block` group (it shuts its children down), then kill any straggler by PID (after
    5 s: its own shutdown sat out a 30 s wait at the end of every suite)."""
    try:
        os.killpg(head.process.pid, signal.SIGTERM)
        head.process.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    kill_processes(_own_processes(head), timeout_s=10)
