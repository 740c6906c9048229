"""The engine actor's teardown: once its process is ending, an error raised in a thread or a finaliser of vLLM's
teardown is one `teardown_error` line on stdout, not a traceback on stderr."""

from __future__ import annotations

import gc
import sys
import threading

import pytest

from eagle3_ray.generate.engine_loop import quiet_teardown_errors

pytestmark = pytest.mark.unit


def test_after_teardown_starts_a_thread_error_and_a_finaliser_error_are_one_line_each(monkeypatch, capsys):
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    quiet_teardown_errors("retired")

    def fail() -> None:
        raise ConnectionResetError("socket closed under the output handler")

    thread = threading.Thread(target=fail, name="MPClientEngineMonitor")
    thread.start()
    thread.join()

    class Closing:
        def __del__(self) -> None:
            raise RuntimeError("engine already shut down")

    Closing()
    gc.collect()
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if "teardown_error" in line]
    assert len(lines) == 2, out
    assert "reason=retired" in lines[0] and "thread MPClientEngineMonitor" in lines[0]
    assert "ConnectionResetError: socket closed under the output handler" in lines[0]
    assert "RuntimeError: engine already shut down" in lines[1]
    assert "Traceback" not in err and "Traceback" not in out
