"""Run the whole pipeline (or some stages of it) in one driver.

    python ray_jobs/pipeline.py ray_jobs/configs/tiny_cpu.yaml [section.field=value ...] [--stages ingest,generate]
    ray job submit --working-dir . -- python ray_jobs/pipeline.py ray_jobs/configs/tiny_cpu.yaml run.name=demo

Resubmitting with the same run.storage_path and run.name resumes; the first log line says so.
"""

from eagle3_ray import pipeline
from eagle3_ray.core import cli


def _stages(parser) -> None:
    parser.add_argument("--stages", default=",".join(pipeline.STAGES), help="comma-separated subset, run in order")


if __name__ == "__main__":
    cfg, args = cli.load(__doc__, "pipeline", _stages)
    pipeline.run(cfg, pipeline.parse_stages(args.stages))
