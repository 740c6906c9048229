"""The autoscaling bed's jobs run in the background while the rest of the suite runs: the pipeline job
(tests/support/pipeline_job.py), its training again uninterrupted, then the online job (tests/support/online_job.py),
one after another in a thread that starts with the session's first test, on the session's bed and S3 server. Most of
a job's time is waiting (nodes starting, a lost node declared dead, an engine loading), which the other tests fill.

Only the jobs some selected test needs run (`pytest tests/unit` starts no bed). Fixtures `pipeline_job`,
`uninterrupted_train` and `online_job` wait for their job's result (its failure is raised in each test that reads
it); `bed_idle` waits for every job and for the bed to scale back to no worker node, for the tests that look at the
bed itself or submit a job of their own.

The S3 server's environment (endpoint, test credentials; `pointed_at`) is set for the whole session while the jobs
run: the thread reads the runs through the same storage layer as the tests, and a per-thread environment does not
exist.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.online_job import submit_online_job
from tests.support.pipeline_job import submit_pipeline_job, train_uninterrupted
from tests.support.s3 import pointed_at

JOBS = ("pipeline_job", "uninterrupted_train", "online_job")  # the order they run in
WAIT_S = 3600.0  # a job's wall time in the background, contention included, stays far below


class BedJobs:
    """The thread and what it produced: `result(name)` blocks until that job is done (or failed)."""

    def __init__(self, cluster, s3_server, wanted: set[str]):
        self.cluster, self.s3_server = cluster, s3_server
        self.wanted = [name for name in JOBS if name in wanted]
        self.results: dict[str, Any] = {}
        self.errors: dict[str, BaseException] = {}
        self.done = {name: threading.Event() for name in self.wanted}
        self.seconds: dict[str, float] = {}
        self.thread = threading.Thread(target=self._run, name="bed-jobs", daemon=True)

    def _steps(self) -> dict[str, Callable[[], Any]]:
        cluster, s3 = self.cluster, self.s3_server
        return {
            "pipeline_job": lambda: submit_pipeline_job(cluster, s3),
            "uninterrupted_train": lambda: train_uninterrupted(cluster, s3, self.result("pipeline_job")),
            "online_job": lambda: submit_online_job(cluster, s3),
        }

    def _run(self) -> None:
        steps = self._steps()
        for name in self.wanted:
            start = time.monotonic()
            try:
                self.results[name] = steps[name]()
            except BaseException as e:  # noqa: BLE001 - raised again in every test that reads this job
                self.errors[name] = e
            finally:
                self.seconds[name] = time.monotonic() - start
                self.done[name].set()

    def result(self, name: str) -> Any:
        if name not in self.wanted:
            raise RuntimeError(f"{name} was not started: no test collected at session start asked for it")
        assert self.done[name].wait(WAIT_S), f"{name} still running after {WAIT_S:.0f} s"
        if name in self.errors:
            raise RuntimeError(f"the bed's {name} failed in the background") from self.errors[name]
        return self.results[name]

    def join(self) -> None:
        self.thread.join(WAIT_S)


def pytest_collection_finish(session):
    """Which of the bed's jobs the selected tests read (directly or through another fixture)."""
    names = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    wanted = names & set(JOBS)
    if names & {"bed_idle", "uninterrupted_train"}:
        wanted.add("pipeline_job")
    session.config._eagle3_bed_jobs = wanted


@pytest.fixture(scope="session", autouse=True)
def _bed_jobs(request):
    """Starts the wanted jobs with the session's first test; at the end, waits for the thread before the bed and the
    S3 server stop."""
    wanted = getattr(request.config, "_eagle3_bed_jobs", set())
    if not wanted:
        yield None
        return
    cluster = request.getfixturevalue("autoscaling_cluster")
    s3_server = request.getfixturevalue("s3_server")
    with pointed_at(s3_server):
        jobs = BedJobs(cluster, s3_server, wanted)
        jobs.thread.start()
        yield jobs
        jobs.join()
    print(f"bed jobs in the background (s): { {k: round(v) for k, v in jobs.seconds.items()} }")


@pytest.fixture(scope="session")
def pipeline_job(_bed_jobs):
    """The session's pipeline job on the bed (tests/support/pipeline_job.py submit_pipeline_job)."""
    return _bed_jobs.result("pipeline_job")


@pytest.fixture(scope="session")
def uninterrupted_train(_bed_jobs) -> list[dict]:
    """The pipeline job's training again, uninterrupted (pipeline_job.py train_uninterrupted): its metrics.jsonl."""
    return _bed_jobs.result("uninterrupted_train")


@pytest.fixture(scope="session")
def online_job(_bed_jobs):
    """The online job that loses its engine's node (tests/support/online_job.py submit_online_job)."""
    return _bed_jobs.result("online_job")


@pytest.fixture(scope="session")
def bed_idle(_bed_jobs, autoscaling_cluster):
    """Every background job done and no worker node left: for tests that look at the bed or submit a job of their
    own after the session's jobs."""
    for name in _bed_jobs.wanted:
        _bed_jobs.done[name].wait(WAIT_S)
    autoscaling_cluster.wait_for_workers(0, timeout_s=180)
    return autoscaling_cluster
