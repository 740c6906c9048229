"""Recovery on a real run: kill a generate engine mid-stage, then check what the run made of it.

    python bench/gpu/recovery.py kill-engine RUN_DIR [--after-units 2]   # beside a running pipeline
    python bench/gpu/recovery.py check RUN_DIR --out recovery.json        # after it finished

`kill-engine` waits until the generate stage under RUN_DIR (`{run.storage_path}/{run.name}`) has an engine that
reported ready and `--after-units` committed units, then SIGKILLs that engine's EngineCore process, as a crashed GPU
process would end, and prints what it killed and when. A training worker is killed by the train stage's own hook
(`EAGLE3_RAY_TEST_KILL_WORKER_AT=epoch,step` in the driver's environment, train/worker.py).

`check` reads the finished run: every generated sample exactly once in the manifest, every shard referenced and
none left over, no temporary file, the engine incarnations and failed attempts the kill caused, the train stage's
`resumed` and fault records, and its validation metrics by epoch.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import sys
import time

import psutil
import pyarrow.parquet as pq

from eagle3_ray.core import storage


def _generate_dirs(run_dir: str) -> list[str]:
    return sorted(d for d in glob.glob(os.path.join(run_dir, "generate", "*")) if os.path.isdir(d))


def _committed_units(out: str) -> int:
    return sum(len(glob.glob(os.path.join(out, sub, "*.parquet"))) for sub in ("parts", "generated"))


def _engine_core(info_path: str) -> int | None:
    for pid in storage.read_json(info_path)["engine_pids"]:
        try:
            proc = psutil.Process(pid)
            if "EngineCore" in proc.name() + " ".join(proc.cmdline()):
                return pid
        except psutil.NoSuchProcess:
            continue
    return None


def kill_engine(run_dir: str, after_units: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for out in _generate_dirs(run_dir):
            infos = sorted(glob.glob(os.path.join(out, "engines", "*.json")))
            if infos and _committed_units(out) >= after_units:
                pid = _engine_core(infos[0])
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = {"killed_pid": pid, "engine": infos[0], "at": time.time(), "units": _committed_units(out)}
                    print("KILLED", json.dumps(killed), flush=True)
                    return killed
        time.sleep(0.5)
    raise SystemExit(f"no generate engine under {run_dir} committed {after_units} units in {timeout_s:.0f} s")


def check(run_dir: str) -> dict:
    gen = storage.latest(run_dir, "generate")
    out = storage.stage_dir(run_dir, "generate", gen["version"])
    summary = storage.read_json(os.path.join(out, "summary.json"))
    manifest = pq.read_table(os.path.join(out, "manifest.parquet"), columns=["id", "shard"]).to_pylist()
    ids = [r["id"] for r in manifest]
    shard_files = set(os.listdir(os.path.join(out, "shards")))
    engines = [storage.read_json(p) for p in glob.glob(os.path.join(out, "engines", "*.json"))]
    attempts = [storage.read_json(p) for p in glob.glob(os.path.join(out, "attempts", "*.json"))]
    result = {
        "generate": {
            "rows_in": summary.get("rows_in"),
            "rows_ok": summary.get("rows_ok"),
            "rows_rejected": summary.get("rows_rejected"),
            "manifest_rows": len(ids),
            "duplicate_ids": len(ids) - len(set(ids)),
            "orphan_shards": sorted(shard_files - {r["shard"] for r in manifest}),
            "missing_shards": sorted({r["shard"] for r in manifest} - shard_files),
            "tmp_files": [p for p in glob.glob(os.path.join(out, "**", "*"), recursive=True) if ".tmp-" in p],
            "engine_incarnations": {k: sum(e["kind"] == k for e in engines) for k in {e["kind"] for e in engines}},
            "failed_attempts": [{"unit": os.path.basename(a.get("unit", "")), **a} for a in attempts],
        }
    }
    train = storage.latest(run_dir, "train")
    train_dir = storage.stage_dir(run_dir, "train", train["version"])
    records = [json.loads(line) for line in open(os.path.join(train_dir, "metrics.jsonl"))]
    result["train"] = {
        "fault_injected": open(os.path.join(train_dir, "_fault_injected")).read().strip()
        if os.path.exists(os.path.join(train_dir, "_fault_injected"))
        else None,
        "resumed": [r for r in records if r.get("kind") == "resumed"],
        "validation": [r for r in records if r.get("kind") == "validation"],
    }
    g = result["generate"]
    g["exactly_once"] = (
        g["duplicate_ids"] == 0
        and g["manifest_rows"] == g["rows_ok"]
        and g["rows_ok"] + g["rows_rejected"] == g["rows_in"]
        and not g["orphan_shards"]
        and not g["missing_shards"]
        and not g["tmp_files"]
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["kill-engine", "check"])
    parser.add_argument("run_dir")
    parser.add_argument("--after-units", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.what == "kill-engine":
        result = kill_engine(args.run_dir, args.after_units, args.timeout_s)
    else:
        result = check(args.run_dir)
    text = json.dumps(result, indent=2, default=str)
    print(text[:6000])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if args.what == "kill-engine" or result["generate"]["exactly_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
