"""Where a machine's cores went while a measurement ran (generate_bench.py --cpu-shares): the CPU time of this process
and its descendants (the engine's processes; in a stage row also Ray's GCS, raylet, workers and actors, which a local
`ray.init` starts under the driver), sampled every second on a thread of its own, as average cores per process name
over a window.

A process counts from the window's first sample, or from its start when it started later; one that ended inside the
window is not counted. The sampler's own reads (a few ms a second) count to this process.
"""

from __future__ import annotations

import os
import re
import threading
import time

import psutil


def process_name(cmdline: list[str], name: str) -> str:
    """A name that stays the same while a process lives: a Ray worker's title without the method it runs now
    (`ray::MapWorker(MapBatches(EngineActor))`, `ray::_StatsActor`), vLLM's titles (`VLLM::Worker`), a Python process
    by its script or `-m` module, anything else by its executable."""
    words = " ".join(cmdline).split()
    if not words:
        return name
    if words[0].startswith("ray::"):
        return re.sub(r"\.[A-Za-z_]\w*$", "", words[0])
    if words[0].startswith("VLLM::"):
        return words[0]
    exe = os.path.basename(words[0])
    if exe.startswith("python"):
        args = iter(words[1:])
        for arg in args:
            if arg == "-c":
                return "python -c"
            if arg == "-m":
                return f"python -m {next(args, '')}"
            if not arg.startswith("-"):
                return os.path.basename(arg)
    return exe


class CpuSampler:
    """Samples this process tree's CPU time every `interval_s` until the process ends (a daemon thread)."""

    def __init__(self, interval_s: float = 1.0):
        self.snapshots: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._root = psutil.Process()
        threading.Thread(target=self._run, args=(interval_s,), daemon=True, name="cpu-shares").start()

    def _run(self, interval_s: float) -> None:
        while True:
            self.snapshots.append(self.snapshot())
            time.sleep(interval_s)

    def snapshot(self) -> tuple[float, dict[int, tuple[str, float]]]:
        now = {}
        for proc in [self._root, *self._root.children(recursive=True)]:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    now[proc.pid] = (process_name(proc.cmdline(), proc.name()), times.user + times.system)
            except psutil.Error:  # ended between the listing and the read
                continue
        return time.time(), now

    def cores(self, start: float, end: float, top: int = 12) -> dict[str, float]:
        return cores(self.snapshots, start, end, top)


def cores(
    snapshots: list[tuple[float, dict[int, tuple[str, float]]]], start: float, end: float, top: int = 12
) -> dict[str, float]:
    """Average cores per process name between the first and the last sample inside [start, end], the busiest
    `top` names, with `total` (every process of the tree) and `window_s`; {} without two samples there."""
    inside = [s for s in snapshots if start <= s[0] <= end]
    if len(inside) < 2:
        return {}
    (t0, first), (t1, last) = inside[0], inside[-1]
    seconds = t1 - t0
    used: dict[str, float] = {}
    for pid, (name, cpu) in last.items():
        used[name] = used.get(name, 0.0) + cpu - first.get(pid, (name, 0.0))[1]
    ranked = sorted(used.items(), key=lambda kv: -kv[1])[:top]
    return {
        "window_s": round(seconds, 2),
        "total": round(sum(used.values()) / seconds, 3),
        **{name: round(cpu / seconds, 3) for name, cpu in ranked if cpu > 0},
    }
