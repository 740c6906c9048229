"""Run the whole pipeline (or some stages of it) in one driver.

    python ray_jobs/pipeline.py ray_jobs/configs/tiny_cpu.yaml [section.field=value ...] [--stages ingest,generate]
    ray job submit --working-dir . -- python ray_jobs/pipeline.py ray_jobs/configs/tiny_cpu.yaml run.name=demo

Resubmitting with the same run.storage_path and run.name resumes; the first log line says so.
"""

import argparse

from eagle3_ray import pipeline
from eagle3_ray.config import dump_config, load_config
from eagle3_ray.telemetry import log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML recipe, e.g. ray_jobs/configs/tiny_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    parser.add_argument("--stages", default=",".join(pipeline.STAGES), help="comma-separated subset, run in order")
    args = parser.parse_intermixed_args()
    cfg = load_config(args.config, args.overrides)
    log("pipeline", "config", recipe=args.config, overrides=args.overrides)
    print(dump_config(cfg), flush=True)
    pipeline.run(cfg, pipeline.parse_stages(args.stages))


if __name__ == "__main__":
    main()
