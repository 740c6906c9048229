"""Train the EAGLE-3 drafter on the generate stage's hidden states with Ray Train: train/{version}/ (epoch
checkpoints, best/, vocab/, metrics.jsonl, tensorboard/) and train/LATEST.json. Prints a metrics line per epoch.

    python ray_jobs/train.py ray_jobs/configs/tiny_cpu.yaml [train.epochs=3 train.num_workers=2]
    ray job submit --working-dir . -- python ray_jobs/train.py ray_jobs/configs/llama3_8b.yaml run.name=demo

Resubmitting the same command resumes after the last checkpoint; a finished run is a no-op.
"""

import argparse

from eagle3_ray import train
from eagle3_ray.config import dump_config, load_config
from eagle3_ray.telemetry import log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML recipe, e.g. ray_jobs/configs/tiny_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    log("train", "config", recipe=args.config, overrides=args.overrides)
    print(dump_config(cfg), flush=True)
    summary = train.run(cfg)
    log("train", "done", version=summary["version"], best=summary["best"] and summary["best"]["path"])


if __name__ == "__main__":
    main()
