"""Evaluate the exported drafter in vLLM against plain decoding on held-out prompts, and gate deployment:
evaluate/{version}/ (results.json, report.md, acceptance_per_position.png, throughput_vs_concurrency.png).

    python ray_jobs/evaluate.py ray_jobs/configs/tiny_cpu.yaml [evaluate.min_speedup=1.2 evaluate.report_only=false]
    ray job submit --working-dir . -- python ray_jobs/evaluate.py ray_jobs/configs/llama3_8b.yaml run.name=demo

Exits 1 when the drafter misses the gate (unless evaluate.report_only), so a job pipeline stops here. Re-running a
finished evaluation with other thresholds re-applies the gate without starting an engine.
"""

import sys

from eagle3_ray.core import cli
from eagle3_ray.evaluate import stage as evaluate


def _run(cfg, _args) -> int:
    try:
        evaluate.run(cfg)
    except evaluate.DeployGateError as e:  # the gate's summary, and a non-zero exit that stops a job pipeline
        print(e, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(__doc__, "evaluate", _run))
