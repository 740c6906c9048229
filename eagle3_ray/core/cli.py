"""The shared front of the `ray_jobs/` entry points: a recipe path plus `section.field=value` overrides, the same
under `python` and under `ray job submit`; the resolved config is logged and printed before the stage starts."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from eagle3_ray.core.config import Config, dump_config, load_config
from eagle3_ray.core.telemetry import log


def load(
    doc: str,
    stage: str,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[Config, argparse.Namespace]:
    """Parse the command line of a stage's script (`doc` is its help text) and return (config, arguments)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML recipe, e.g. ray_jobs/configs/tiny_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_intermixed_args()
    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, OSError) as e:  # a bad recipe or override: its message, no traceback (exit 2, like argparse)
        parser.error(str(e))
    log(stage, "config", recipe=args.config, overrides=args.overrides)
    print(dump_config(cfg), flush=True)
    return cfg, args
