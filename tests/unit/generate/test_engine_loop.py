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


WATCHED_EXIT = """
import atexit, subprocess, threading, time
import psutil
from eagle3_ray.generate.engine import _exit_when_engine_dies

engine = subprocess.Popen(["sleep", "60"])
retiring = threading.Event()
args = ([psutil.Process(engine.pid)], lambda error: print("on_death", error, flush=True), retiring, 0.05)
threading.Thread(target=_exit_when_engine_dies, args=args, daemon=True).start()

def stop_engine_first():  # as a library's own atexit handler may, before the actor's close()
    engine.kill()
    engine.wait()
    time.sleep(0.5)  # the watch polls every 0.05 s meanwhile

atexit.register(stop_engine_first)
if {kill_while_running}:
    engine.kill()
    time.sleep(0.5)
print("main done", flush=True)
"""


@pytest.mark.parametrize("kill_while_running", [False, True])
def test_an_engine_stopped_while_the_process_exits_is_no_death_but_one_stopped_while_it_runs_is(kill_while_running):
    import subprocess

    code = WATCHED_EXIT.format(kill_while_running=kill_while_running)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if kill_while_running:  # the actor reports the death and exits 1, so that Ray restarts it
        assert done.returncode == 1 and "engine_dead" in done.stdout and "on_death" in done.stdout, done
        assert "main done" not in done.stdout
    else:
        assert done.returncode == 0 and "main done" in done.stdout, done
        assert "engine_dead" not in done.stdout and "on_death" not in done.stdout, done.stdout
