"""Train the EAGLE-3 drafter on the generate stage's hidden states with Ray Train: train/{version}/ (epoch
checkpoints, best/, vocab/, metrics.jsonl, tensorboard/). Prints metrics lines every few steps and per epoch.

    python ray_jobs/train.py ray_jobs/configs/tiny_cpu.yaml [train.epochs=3 train.num_workers=2]
    ray job submit --working-dir . -- python ray_jobs/train.py ray_jobs/configs/llama3_8b.yaml run.name=demo

Resubmitting the same command resumes after the last checkpoint; a finished run is a no-op.
"""

import sys

from eagle3_ray.core import cli
from eagle3_ray.core.telemetry import log
from eagle3_ray.train import stage as train


def _run(cfg, _args) -> None:
    summary = train.run(cfg)
    log("train", "done", version=summary["version"], best=summary["best"] and summary["best"]["path"])


if __name__ == "__main__":
    sys.exit(cli.main(__doc__, "train", _run))
