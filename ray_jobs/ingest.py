"""Ingest prompts: JSONL / Parquet / `datasets` inputs -> ingest/{version}/conversations.parquet + rejects.parquet.

    python ray_jobs/ingest.py ray_jobs/configs/tiny_cpu.yaml [section.field=value ...]
    python ray_jobs/ingest.py ray_jobs/configs/llama3_8b.yaml 'ingest.inputs=[s3://bucket/chats/]' ingest.strict=true
    ray job submit --working-dir . -- python ray_jobs/ingest.py ray_jobs/configs/tiny_cpu.yaml run.name=demo

Re-running with the same inputs and config is a no-op that says so.
"""

import argparse

from eagle3_ray import ingest
from eagle3_ray.config import dump_config, load_config
from eagle3_ray.telemetry import log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML recipe, e.g. ray_jobs/configs/tiny_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    log("ingest", "config", recipe=args.config, overrides=args.overrides)
    print(dump_config(cfg), flush=True)
    ingest.run(cfg)


if __name__ == "__main__":
    main()
