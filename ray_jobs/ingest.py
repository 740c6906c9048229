"""Ingest prompts: JSONL / Parquet / `datasets` inputs -> ingest/{version}/conversations.parquet + rejects.parquet.

    python ray_jobs/ingest.py ray_jobs/configs/tiny_cpu.yaml [section.field=value ...]
    python ray_jobs/ingest.py ray_jobs/configs/llama3_8b.yaml 'ingest.inputs=[s3://bucket/chats/]' ingest.strict=true
    ray job submit --working-dir . -- python ray_jobs/ingest.py ray_jobs/configs/tiny_cpu.yaml run.name=demo

Re-running with the same inputs and config is a no-op that says so.
"""

import sys

from eagle3_ray.core import cli
from eagle3_ray.ingest import stage as ingest

if __name__ == "__main__":
    sys.exit(cli.main(__doc__, "ingest", lambda cfg, _: ingest.run(cfg)))
