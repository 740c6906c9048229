"""Regenerate responses with the verifier and capture its hidden states: ingest output -> generate/{version}/
(conversations.parquet, shards/*.safetensors, manifest.parquet, rejects.parquet, capture.json, summary.json).

    python ray_jobs/generate.py ray_jobs/configs/tiny_cpu.yaml [section.field=value ...]
    python ray_jobs/generate.py ray_jobs/configs/tiny_cpu.yaml generate.hidden_states_dtype=fp8 generate.mode=capture_only
    ray job submit --working-dir . -- python ray_jobs/generate.py ray_jobs/configs/llama3_8b.yaml run.name=demo

A resubmitted job resumes: samples already committed are skipped; a finished version is a no-op that says so.
"""

import argparse

from eagle3_ray import generate
from eagle3_ray.config import dump_config, load_config
from eagle3_ray.telemetry import log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML recipe, e.g. ray_jobs/configs/tiny_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    log("generate", "config", recipe=args.config, overrides=args.overrides)
    print(dump_config(cfg), flush=True)
    generate.run(cfg)


if __name__ == "__main__":
    main()
