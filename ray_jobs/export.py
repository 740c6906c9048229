"""Export a trained drafter for vLLM: train/LATEST.json -> export/{version}/speculators/ (speculators-format config
with the verifier and captured aux layer ids, bf16 safetensors, no optimizer state, no frozen verifier weights).
The capture/serving contract is checked before and after writing.

    python ray_jobs/export.py ray_jobs/configs/tiny_cpu.yaml [export.checkpoint=best|last|epoch=N]
    ray job submit --working-dir . -- python ray_jobs/export.py ray_jobs/configs/llama3_8b.yaml run.name=demo

A finished version is a no-op that says so.
"""

import argparse

from eagle3_ray import export
from eagle3_ray.config import dump_config, load_config
from eagle3_ray.telemetry import log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML recipe, e.g. ray_jobs/configs/tiny_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    log("export", "config", recipe=args.config, overrides=args.overrides)
    print(dump_config(cfg), flush=True)
    export.run(cfg)


if __name__ == "__main__":
    main()
