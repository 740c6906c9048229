"""The shared front of the `ray_jobs/` entry points: a recipe path plus `section.field=value` overrides, the same
under `python` and under `ray job submit`; the resolved config is logged and printed before the stage starts.

    if __name__ == "__main__":
        sys.exit(cli.main(__doc__, "ingest", lambda cfg, args: ingest.run(cfg)))

A bad recipe, override or input ends the script with one line `error: <message>` and exit status 2 (like
argparse), with no traceback: config errors when loading, `UserError` while the stage runs (also when raised inside
a Ray task or actor). Ray Data re-raises a map's exception as text only, so stages check their inputs in the
driver before Ray Data runs. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from eagle3_ray.core.config import Config, UserError, dump_config, load_config
from eagle3_ray.core.telemetry import log

USER_ERROR_EXIT = 2


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


def main(
    doc: str,
    stage: str,
    run: Callable[[Config, argparse.Namespace], Any],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """Load the config (`load`), call `run(cfg, args)` and return the exit status for `sys.exit`: what `run`
    returns when that is an int (a stage's summary or None: 0), or 2 after printing `error: <message>` for a
    UserError."""
    cfg, args = load(doc, stage, add_arguments)
    try:
        status = run(cfg, args)
        return status if isinstance(status, int) else 0
    except Exception as e:
        user_error = find_user_error(e)
        if user_error is None:
            raise
        print(f"error: {user_error}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT


def find_user_error(error: BaseException) -> UserError | None:
    """The UserError behind `error`: itself, or what it was raised `from`, or the cause Ray attached when it
    re-raised a task's or actor's exception in the driver (RayTaskError.cause)."""
    seen: set[int] = set()
    current: Any = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        cause = getattr(current, "cause", None)
        if isinstance(current, UserError) and not isinstance(cause, BaseException):
            return current
        current = cause if isinstance(cause, BaseException) else current.__cause__
    return None
