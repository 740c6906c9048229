"""A real `ray start --head` for job tests: free ports, its temp dir inside the test's, token auth on, and a
REST/CLI client that always sends the token. Stopped by its own PIDs, never by `ray stop` (which would kill every
Ray process on this shared machine).

Test modules load it with `pytest_plugins = ["helpers_ray_head"]`, so the `ray_head` fixture is one per session.
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

from eagle3_ray.core import storage
from tests.support import REPO
from tests.support.processes import free_ports, kill_processes
from tests.support.s3 import pointed_at

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

    def metrics_text(self) -> str:
        """The head node's Prometheus text (custom metrics arrive with a `ray_` prefix)."""
        url = f"http://127.0.0.1:{self.ports['metrics-export-port']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()


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


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """One real Ray head for the job and metrics tests (8 logical CPUs, token auth on)."""
    head = start_head(tmp_path_factory.mktemp("head"))
    yield head
    stop_head(head)


def metric_samples(text: str, prefix: str = "ray_eagle3_") -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample whose name starts with `prefix` in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefix)
    ]


@dataclass
class FinishedJob:
    """A job that ran to SUCCEEDED: its REST record, logs, run dir and every custom metric scraped while it ran."""

    info: dict
    logs: str
    run_dir: Path | str | None
    metrics: list[tuple[str, dict[str, str], float]]
    elapsed_s: float
    stopped_logs: str = ""


def run_job(
    head: RayHead,
    submission_id: str,
    entrypoint: list[str],
    run_dir: Path | None,
    *,
    timeout_s: float = 900,
    env_vars: dict[str, str] | None = None,
) -> FinishedJob:
    """Submit, poll GET /api/jobs/{id} until SUCCEEDED, scraping the head's metrics endpoint at every poll
    (metrics of short-lived workers vanish once they exit, so a scrape after the job could miss them)."""
    start = time.monotonic()
    scraped: list[tuple[str, dict[str, str], float]] = []
    head.submit(submission_id, *entrypoint, env_vars=env_vars)
    info = head.wait(
        submission_id,
        {"SUCCEEDED"},
        timeout_s=timeout_s,
        every_s=2.0,
        on_poll=lambda _: scraped.extend(metric_samples(head.metrics_text())),
    )
    return FinishedJob(
        info=info, logs=head.logs(submission_id), run_dir=run_dir, metrics=scraped, elapsed_s=time.monotonic() - start
    )


RECIPE = "ray_jobs/configs/tiny_kimi_cpu.yaml"
# The seeds' model family (a tiny Kimi-K2.5-shaped verifier: MLA + MoE under a multimodal wrapper,
# tests/e2e/test_mla_pipeline.py reads this run too), kept small: short responses, one train worker (all batches on
# it) for 6 short epochs at a higher learning rate so that the drafter learns something, a short evaluation at c=1.
LEAN = [
    "ingest.max_rows=12",
    "generate.max_tokens=24",
    "generate.max_batch_tokens=256",
    "train.num_workers=1",
    "train.epochs=6",
    "train.total_seq_len=256",
    "train.lr=0.001",
    "train.warmup_steps=2",
    "train.log_every_steps=1",
    "evaluate.num_prompts=4",
    "evaluate.max_tokens=24",
    "evaluate.concurrency=[1]",
    "evaluate.baseline_again=false",
    "evaluate.contract_prompts=4",
]


def pipeline_entrypoint(storage_path: Path | str, name: str, *extra: str) -> list[str]:
    # The venv's interpreter, not `python`: the entrypoint shell's PATH is the head's, not ours.
    return [
        sys.executable,
        "ray_jobs/pipeline.py",
        RECIPE,
        f"run.storage_path={storage_path}",
        f"run.name={name}",
        *LEAN,
        *extra,
    ]


# The stop must land while generate still has units to come: about one sample per unit, two in flight, 24 samples.
STOPPABLE = [
    "ingest.max_rows=24",
    "generate.max_tokens=32",
    "generate.max_batch_tokens=120",
    "generate.units_in_flight=2",
]


@pytest.fixture(scope="session")
def pipeline_job(ray_head, s3_server) -> FinishedJob:
    """The whole tiny Kimi pipeline as users run it, once per session (the job, metrics, object-store and MLA tests
    read the same run): its run dir on the loopback S3 server (every stage reads and writes it through pyarrow's
    filesystems, Ray Train's checkpoints go there too), submitted, stopped through the Jobs REST API (what
    `ray job stop` calls) the moment generate's first unit commits, then resubmitted under the same run name, which
    resumes it. Returns the resubmitted job, `stopped_logs` holding the first one's log. Read the run in a test
    through `s3_env`."""
    storage_path = f"s3://{s3_server.bucket}/runs"
    run_dir = f"{storage_path}/full"
    entrypoint = pipeline_entrypoint(storage_path, "full", *STOPPABLE)
    with pointed_at(s3_server):
        ray_head.submit("eagle3-full-stopped", *entrypoint, env_vars=s3_server.env)
        deadline = time.monotonic() + 600
        generate = f"{run_dir}/generate"
        while not any(storage.list_files(f"{generate}/{v}/parts", ".parquet") for v in storage.list_dirs(generate)):
            assert time.monotonic() < deadline, ray_head.logs("eagle3-full-stopped")[-4000:]
            status = ray_head.job("eagle3-full-stopped")["status"]
            assert status in ("PENDING", "RUNNING"), ray_head.logs("eagle3-full-stopped")[-4000:]
            time.sleep(0.1)
        assert ray_head.post("/api/jobs/eagle3-full-stopped/stop")["stopped"]
        assert ray_head.wait("eagle3-full-stopped", {"STOPPED"}, timeout_s=120)["status"] == "STOPPED"
        assert not storage.exists(f"{run_dir}/generate/LATEST.json"), "the job finished before it was stopped"
    job = run_job(ray_head, "eagle3-full", entrypoint, run_dir, env_vars=s3_server.env)
    job.stopped_logs = ray_head.logs("eagle3-full-stopped")
    return job
