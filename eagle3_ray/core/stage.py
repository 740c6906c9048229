"""The one skeleton every stage runs in: the version its config determines, skip it when finished, resume it when
not, finish it with summary + provenance + `_SUCCESS` + LATEST.

    def version(cfg): return storage.version_hash(versioned(cfg.generate), ..., stage.version(cfg, "ingest"))
    def run(cfg): return stage.run(cfg, "generate", version(cfg), lambda out: _body(cfg, out))

A version hashes the config fields that change a stage's output (config.versioned) and the version of the stage it
reads, so a config determines its data all the way down: a downstream stage reads `stage.input_dir(cfg, "generate")`,
the output of the generate version *its own config* determines, never "whatever ran last". `{stage}/LATEST.json` is a
pointer for people and separately submitted tools; every run re-points it, also one that skips a finished version.

A version directory without `_SUCCESS` is unfinished: the body runs again on it and resumes from what it finds there
(committed units, Ray Train's checkpoints), so a killed or resubmitted job picks up where it stopped.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from eagle3_ray.core import storage
from eagle3_ray.core.config import Config
from eagle3_ray.core.telemetry import log

STAGES = ("ingest", "generate", "train", "export", "evaluate")
# The module of each stage, with its `version(cfg)` and `run(cfg)`.
STAGE_MODULES = {
    "ingest": "eagle3_ray.ingest.stage",
    "generate": "eagle3_ray.generate.stage",
    "train": "eagle3_ray.train.stage",
    "export": "eagle3_ray.train.export",
    "evaluate": "eagle3_ray.evaluate.stage",
}


def version(cfg: Config, name: str) -> str:
    """The version of stage `name` that `cfg` determines (each stage module's own `version(cfg)`)."""
    return importlib.import_module(STAGE_MODULES[name]).version(cfg)


def output_dir(cfg: Config, name: str) -> str:
    return storage.stage_dir(cfg.run.run_dir, name, version(cfg, name))


def input_dir(cfg: Config, name: str) -> str:
    """The finished output of stage `name` for this config; a clear error when that version has not finished."""
    out = output_dir(cfg, name)
    if storage.is_complete(out):
        return out
    latest = storage.join(cfg.run.run_dir, name, "LATEST.json")
    other = storage.read_json(latest)["version"] if storage.exists(latest) else None
    hint = f" ({name}/LATEST.json names version {other}, made by another config)" if other else ""
    raise FileNotFoundError(
        f"no finished '{name}' output for this config: {out} has no {storage.SUCCESS_MARKER}"
        f"{hint}; run the {name} stage with the same config first"
    )


def run(
    cfg: Config,
    name: str,
    version: str,
    body: Callable[[str], dict[str, Any]],
    *,
    inputs: dict[str, str] | None = None,
    input_fingerprint: str | None = None,
) -> dict[str, Any]:
    """Run `body(out_dir) -> summary` unless `version` is finished; then write summary.json, provenance.json,
    `_SUCCESS` and LATEST.json. Returns the summary (`skipped: True` when the version was already finished)."""
    run_dir = cfg.run.run_dir
    out = storage.stage_dir(run_dir, name, version)
    if storage.is_complete(out):
        summary = storage.read_json(storage.join(out, "summary.json"))
        storage.set_latest(run_dir, name, version, summary)
        log(name, "already_done", version=version, path=out)
        return {**summary, "skipped": True}
    log(name, "start", version=version, path=out, resuming=storage.exists(out))
    summary = {"version": version, "path": out, **body(out)}
    storage.write_json_atomic(storage.join(out, "summary.json"), summary)
    storage.write_json_atomic(
        storage.join(out, "provenance.json"),
        storage.provenance(cfg.to_dict(), input_fingerprint=input_fingerprint, inputs=inputs or {}),
    )
    storage.mark_complete(out, {"version": version})
    storage.set_latest(run_dir, name, version, summary)
    log(name, "done", **{k: v for k, v in summary.items() if isinstance(v, (int, float, str)) and k != "stage"})
    return summary
