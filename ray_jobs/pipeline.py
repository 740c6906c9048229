"""Run the whole pipeline (or some stages of it) in one driver.

    python ray_jobs/pipeline.py ray_jobs/configs/smollm2_quick_cpu.yaml [section.field=value ...] [--stages ingest,...]
    ray job submit --working-dir . -- python ray_jobs/pipeline.py ray_jobs/configs/smollm2_quick_cpu.yaml run.name=demo

The main job on a CPU is smollm2_quick_cpu.yaml (a real model, SmolLM2-135M-Instruct); tiny_cpu.yaml is the test bed,
a random verifier built in code that no drafter can speed up. Resubmitting with the same run.storage_path and run.name
resumes; the first log line says so. The job ends with the evaluation's verdict in words.
"""

import sys

from eagle3_ray import pipeline
from eagle3_ray.core import cli


def _stages(parser) -> None:
    parser.add_argument("--stages", default=",".join(pipeline.STAGES), help="comma-separated subset, run in order")


def _run(cfg, args) -> int:
    from eagle3_ray.evaluate.stage import DeployGateError  # imports torch: not before the config is checked

    try:
        pipeline.run(cfg, pipeline.parse_stages(args.stages))
    except DeployGateError as e:  # the evaluate stage's gate: its summary and exit 1, as ray_jobs/evaluate.py
        print(e, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(__doc__, "pipeline", _run, _stages))
