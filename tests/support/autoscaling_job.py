"""A job for the autoscaling test bed (tests/support/autoscaling.py): `--rounds` rounds of `--tasks` Ray tasks, each
holding `--cpus` CPUs for `--task-s` seconds, so that worker nodes must start for it. Prints the node ids the tasks
ran on as its last line: `NODES <json list>`.

    ray job submit --address http://127.0.0.1:<dashboard port> -- python tests/support/autoscaling_job.py --rounds 2
"""

import argparse
import json
import time

import ray


@ray.remote
def hold(task_s: float) -> str:
    time.sleep(task_s)
    return ray.get_runtime_context().get_node_id()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tasks", type=int, default=2, help="tasks per round, run together")
    parser.add_argument("--cpus", type=float, default=1)
    parser.add_argument("--task-s", type=float, default=1.0)
    args = parser.parse_args()
    ray.init()
    nodes = []
    for _ in range(args.rounds):
        nodes += ray.get([hold.options(num_cpus=args.cpus).remote(args.task_s) for _ in range(args.tasks)])
    print("NODES", json.dumps(nodes), flush=True)


if __name__ == "__main__":
    main()
