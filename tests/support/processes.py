"""Stopping processes a test started (never `ray stop`: it would take every Ray on the machine with it)."""

from __future__ import annotations

import psutil


def kill_processes(procs: list[psutil.Process], timeout_s: float) -> None:
    """SIGKILL each process (one that has ended already is no error) and wait up to timeout_s for them to go."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)
