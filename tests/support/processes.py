"""Ports for the servers a test starts, and stopping the processes it started (never `ray stop`: it would take every
Ray on the machine with it)."""

from __future__ import annotations

import socket

import psutil


def free_ports(count: int) -> list[int]:
    """Distinct ports nobody listens on now (kept open together so they differ)."""
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def kill_processes(procs: list[psutil.Process], timeout_s: float) -> None:
    """SIGKILL each process (one that has ended already is no error) and wait up to timeout_s for them to go."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)
