"""Regenerate responses with the verifier and capture its hidden states: ingest output -> generate/{version}/
(conversations.parquet, shards/*.safetensors, manifest.parquet, rejects.parquet, capture.json, summary.json).

    python ray_jobs/generate.py ray_jobs/configs/tiny_cpu.yaml [section.field=value ...]
    python ray_jobs/generate.py ray_jobs/configs/tiny_cpu.yaml generate.hidden_states_dtype=fp8 generate.mode=two_pass
    ray job submit --working-dir . -- python ray_jobs/generate.py ray_jobs/configs/llama3_8b.yaml run.name=demo

A resubmitted job resumes: samples already committed are skipped; a finished version is a no-op that says so.
"""

import sys

from eagle3_ray.core import cli
from eagle3_ray.generate import stage as generate

if __name__ == "__main__":
    sys.exit(cli.main(__doc__, "generate", lambda cfg, _: generate.run(cfg)))
