"""Export a trained drafter for vLLM: the train output -> export/{version}/speculators/ (speculators-format config
with the verifier and captured aux layer ids, bf16 safetensors, no optimizer state, no frozen verifier weights).
The capture/serving contract is checked before and after writing.

    python ray_jobs/export.py ray_jobs/configs/tiny_cpu.yaml [export.checkpoint=best|last|epoch=N]
    ray job submit --working-dir . -- python ray_jobs/export.py ray_jobs/configs/llama3_8b.yaml run.name=demo

A finished version is a no-op that says so.
"""

import sys

from eagle3_ray.core import cli
from eagle3_ray.train import export

if __name__ == "__main__":
    sys.exit(cli.main(__doc__, "export", lambda cfg, _: export.run(cfg)))
