"""The shared entry point: a UserError ends the script with one line `error: <message>` and exit status 2, also
when Ray re-raised it from a task; any other exception is a bug and keeps its traceback."""

from __future__ import annotations

import sys

import pytest

from eagle3_ray.core import cli
from eagle3_ray.core.config import UserError

pytestmark = pytest.mark.unit


@pytest.fixture()
def argv(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["stage.py", "ray_jobs/configs/tiny_cpu.yaml", f"run.storage_path={tmp_path}"])


def _raise(error: BaseException):
    def run(cfg, args):
        raise error

    return run


def test_a_user_error_prints_one_line_and_exits_2(argv, capsys):
    assert cli.main("doc", "ingest", _raise(UserError("ingest.inputs[0]: x.jsonl is empty (0 bytes)"))) == 2
    assert capsys.readouterr().err == "error: ingest.inputs[0]: x.jsonl is empty (0 bytes)\n"


def test_a_bug_keeps_its_traceback(argv):
    with pytest.raises(KeyError):
        cli.main("doc", "ingest", _raise(KeyError("a bug")))


def test_the_exit_status_is_what_run_returns_and_0_for_a_summary(argv):
    assert cli.main("doc", "evaluate", lambda cfg, args: 1) == 1
    assert cli.main("doc", "ingest", lambda cfg, args: {"rows_ok": 3}) == 0


def test_a_user_error_chained_behind_a_wrapper_is_found():
    # Ray Data raises its UserCodeException `from` the task's exception; a bug in between is still a bug.
    try:
        try:
            raise UserError("the real message")
        except UserError as e:
            raise RuntimeError("wrapped by the executor") from e
    except RuntimeError as wrapped:
        assert str(cli.find_user_error(wrapped)) == "the real message"
    assert cli.find_user_error(RuntimeError("no user error")) is None
