"""The whole pipeline in one driver: ingest -> generate -> train -> export -> evaluate, each stage's `run(cfg)`.

    python ray_jobs/pipeline.py ray_jobs/configs/tiny_cpu.yaml run.name=demo
    python ray_jobs/pipeline.py recipe.yaml --stages ingest,generate      # a subset, in pipeline order

Every stage skips work that is already finished and resumes work that is not, so running the pipeline again with
the same `run.storage_path` and `run.name` (a resubmitted job) picks up where the last one stopped; the first log
line says whether it resumed.

On GPU clusters run generation and training as separate jobs when `generate.tensor_parallel_size > 1`: Ray Data
keeps an engine's placement group reserved until its driver exits (ray#64035), so training in the same driver can
wait forever for those GPUs.
"""

from __future__ import annotations

import importlib
from typing import Any

from eagle3_ray.core import stage, storage
from eagle3_ray.core.config import Config, UserError
from eagle3_ray.core.raycluster import ensure_ray
from eagle3_ray.core.stage import STAGES
from eagle3_ray.core.telemetry import RateMeter, log, metrics


def parse_stages(text: str) -> list[str]:
    """`ingest,generate` -> ["ingest", "generate"], checked and put in pipeline order."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in STAGES]
    if unknown or not names:
        raise UserError(f"--stages: unknown stage(s) {unknown or names!r}; choose from {','.join(STAGES)}")
    return [name for name in STAGES if name in names]


def _announce(cfg: Config, stages: list[str]) -> None:
    """Say in one line whether this run starts fresh or resumes earlier work of this config under the same run dir
    (a stage whose upstream has not run yet has no version to look at and counts as not started)."""
    run_dir = cfg.run.run_dir
    finished, started = [], []
    for name in stages:
        try:
            out = stage.output_dir(cfg, name)
        except (FileNotFoundError, ValueError):
            break
        if storage.is_complete(out):
            finished.append(name)
        elif storage.exists(out):
            started.append(name)
    if finished or started:
        log("pipeline", "resumed", run_dir=run_dir, finished=finished, unfinished=started, stages=stages)
    else:
        log("pipeline", "start", run_dir=run_dir, stages=stages)


def _run_stage(cfg: Config, name: str) -> dict[str, Any]:
    # Imported here: each stage pulls in its own heavy dependencies (vLLM, torch, speculators) only when it runs.
    module = importlib.import_module(stage.STAGE_MODULES[name])
    tags = {"stage": name, "run": cfg.run.name}
    metrics.gauge("pipeline_stage_running", "1 while the stage runs in the pipeline driver").set(1, tags=tags)
    meter = RateMeter()
    log("pipeline", "stage_start", name=name)
    try:
        summary = module.run(cfg) or {}
    finally:
        metrics.gauge("pipeline_stage_running").set(0, tags=tags)
    metrics.gauge("pipeline_stage_seconds", "wall time of the stage's last run").set(meter.elapsed_s, tags=tags)
    metrics.counter("pipeline_stages_done", "stages finished by the pipeline driver").inc(1, tags=tags)
    log("pipeline", "stage_done", name=name, elapsed_s=meter.elapsed_s)
    return summary


def run(cfg: Config, stages: list[str] | tuple[str, ...] = STAGES) -> dict[str, dict[str, Any]]:
    """Run `stages` in order in this driver; returns each stage's summary. A failing stage stops the pipeline.
    A `train.init_from` drafter that cannot start this run's training is refused first, before Ray starts and
    anything is generated."""
    stages = list(stages)
    if set(stages) & {"ingest", "generate", "train"}:
        from eagle3_ray.train import init_from

        init_from.check_before_compute(cfg)
    ensure_ray(cfg.run)
    if cfg.train.source == "online" and "generate" in stages:
        # online training runs the engines itself, inside the train stage (eagle3_ray/train/online.py)
        stages.remove("generate")
    _announce(cfg, stages)
    meter = RateMeter()
    summaries = {name: _run_stage(cfg, name) for name in stages}
    log("pipeline", "done", run_dir=cfg.run.run_dir, stages=stages, elapsed_s=meter.elapsed_s)
    return summaries
