"""User errors through the real entry points and through Ray: one line `error: <message>`, exit status 2, no
traceback, nothing written into the run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from eagle3_ray.core import cli
from eagle3_ray.core.config import UserError, load_config
from tests.support import REPO
from tests.support.generate_output import point_generate_at, shared_generate_output

pytestmark = pytest.mark.e2e

GEN = {"num_samples": 40, "max_new_tokens": 40}  # the train tests' shared generate output


def test_ingest_on_an_empty_file_prints_one_line_and_exits_2(tmp_path, _isolated_env):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    runs = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "ray_jobs/ingest.py", "ray_jobs/configs/tiny_cpu.yaml", f"ingest.inputs=[{empty}]"]
        + [f"run.storage_path={runs}"],
        cwd=REPO,
        env={**os.environ, **_isolated_env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: ingest.inputs[0]: {empty} is empty (0 bytes)\n"
    assert not runs.exists()


def test_a_user_error_raised_in_a_ray_task_or_actor_is_found_behind_rays_wrapper(ray_session):
    # (Ray Data's map errors reach the driver as text only, so stages check their input in the driver first.)
    ray = ray_session

    @ray.remote
    def task():
        raise UserError("bad row in a task")

    @ray.remote
    class Engine:
        def load(self):
            raise UserError("model file will not load")

    with pytest.raises(Exception) as in_task:
        ray.get(task.remote())
    with pytest.raises(Exception) as in_actor:
        ray.get(Engine.remote().load.remote())
    assert str(cli.find_user_error(in_task.value)) == "bad row in a task"
    assert str(cli.find_user_error(in_actor.value)) == "model file will not load"


def _train_error_line(tmp_path, tmp_path_factory, tiny_llama, env, name: str, train_section: str) -> str:
    """`ray_jobs/train.py` on the shared generate output with `train: {<train_section>}`: asserts exit 2, one
    `error:` line, no traceback and no checkpoint; returns the line."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"run: {{storage_path: {tmp_path / 'runs'}, name: {name}}}\ntrain: {{{train_section}}}\n")
    point_generate_at(load_config(str(recipe), []), shared_generate_output(tmp_path_factory, tiny_llama, **GEN))
    proc = subprocess.run(
        [sys.executable, "ray_jobs/train.py", str(recipe)],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not list((tmp_path / "runs").rglob("checkpoint*"))
    return errors[0]


def test_a_split_that_leaves_a_worker_without_samples_ends_train_with_one_line_and_exit_2(
    tmp_path, tmp_path_factory, tiny_llama, _isolated_env
):
    """Found in the driver once the samples are known, before Ray Train starts: no traceback, no checkpoint."""
    error = _train_error_line(tmp_path, tmp_path_factory, tiny_llama, _isolated_env, "split", "num_workers: 64")
    assert re.fullmatch(
        r"error: train.val_fraction=0.1 leaves \d+ train and \d+ validation samples; each of 64 "
        r"workers needs one of each",
        error,
    ), error


def test_a_worker_group_no_node_can_hold_ends_train_with_one_line_naming_its_fields_and_exit_2(
    tmp_path, tmp_path_factory, tiny_llama, _isolated_env
):
    """A GPU asked of a Ray without one: Ray would wait forever; the stage says what it needs and which fields ask
    for it, before any worker starts."""
    section = "num_workers: 1, use_gpu: true"
    error = _train_error_line(tmp_path, tmp_path_factory, tiny_llama, _isolated_env, "gpu", section)
    assert re.fullmatch(
        r"error: train needs 1 x \{'CPU': 1.0, 'GPU': 1\} and this local Ray cannot hold it \(its resources: "
        r"\{'CPU': [\d.]+\}\); set by train.num_workers, train.cpus_per_worker, train.use_gpu",
        error,
    ), error
