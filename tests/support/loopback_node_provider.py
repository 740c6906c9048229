"""Ray's fake multi-node provider with every worker node on 127.0.0.1, joined to the GCS address of its provider
config. The autoscaler of a test head loads it through `provider: {type: external, module:
tests.support.loopback_node_provider.LoopbackNodeProvider, gcs_address: 127.0.0.1:<port>, head_node_type: <the
config's>}`; the repo root must be on the PYTHONPATH of `ray start` for the head's monitor process to import it
(tests/support/autoscaling.py does both).

Ray's own FakeMultiNodeProvider starts worker nodes on the address the monitor process would reach the internet from
and a GCS on port 6379; this one pins both. Each node is a `ray._private.node.Node` inside the monitor process (its
raylet and agents are the monitor's children); node ids count up from `fff...f00001`.
"""

from __future__ import annotations

import copy
import json
import os

import ray
import ray._private.ray_constants as ray_constants
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.tags import (
    NODE_KIND_WORKER,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

NODE_IP = "127.0.0.1"


class LoopbackNodeProvider(FakeMultiNodeProvider):
    """FakeMultiNodeProvider whose worker nodes listen on 127.0.0.1 and join `provider.gcs_address`."""

    def __init__(self, provider_config: dict, cluster_name: str):
        super().__init__(provider_config, cluster_name)
        if not self._gcs_address or "head_node_type" not in provider_config:
            raise ValueError("provider needs gcs_address (the head's 127.0.0.1:<port>) and head_node_type")
        # The parent tags the head as `ray.head.default`; under any other name the autoscaler would take the head for
        # a missing node of the config's head type and launch one.
        self._nodes[self._head_node_id]["tags"][TAG_RAY_USER_NODE_TYPE] = provider_config["head_node_type"]

    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        resources = copy.deepcopy(resources)  # popped below; the autoscaler keeps its own copy
        with self.lock:
            node_type = tags[TAG_RAY_USER_NODE_TYPE]
            node_id = self._next_hex_node_id()
            params = ray._private.parameter.RayParams(
                node_ip_address=NODE_IP,
                gcs_address=self._gcs_address,
                redis_address=self._gcs_address,
                min_worker_port=0,
                max_worker_port=0,
                dashboard_port=None,
                dashboard_agent_listen_port=0,
                num_cpus=resources.pop("CPU", 0),
                num_gpus=resources.pop("GPU", 0),
                object_store_memory=resources.pop("object_store_memory", None),
                resources=resources,
                labels=labels,
                # Every node of the bed shares the head's session logs dir, whose log monitor already streams each
                # worker's log to its driver: a monitor per worker node would stream every line once per node.
                include_log_monitor=False,
                # A node's runtime env agent unpacks a job's working_dir afresh (rmtree, then unzip) when the job first
                # needs it there; in a directory shared with the other nodes that pulls the current directory from
                # under their running workers (`os.getcwd()` then fails, as in vLLM's engine start). Each machine of
                # a real cluster has its own.
                runtime_env_dir_name=f"runtime_resources_{node_id}",
                env_vars={
                    "RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id,
                    "RAY_CLOUD_INSTANCE_ID": node_id,
                    "RAY_NODE_TYPE_NAME": node_type,
                    ray_constants.RESOURCES_ENVIRONMENT_VARIABLE: json.dumps(resources),
                    ray_constants.LABELS_ENVIRONMENT_VARIABLE: json.dumps(labels),
                },
            )
            # Ray labels a node `ray.io/node-group: <type>` from this variable of the process that builds it (`ray up`
            # sets it for each worker's `ray start`); here that process is the monitor, hence the brief override.
            previous = os.environ.get("RAY_NODE_TYPE_NAME")
            os.environ["RAY_NODE_TYPE_NAME"] = node_type
            try:
                node = ray._private.node.Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
            finally:
                if previous is None:
                    os.environ.pop("RAY_NODE_TYPE_NAME")
                else:
                    os.environ["RAY_NODE_TYPE_NAME"] = previous
            self._nodes[node_id] = {
                "tags": {
                    TAG_RAY_NODE_KIND: NODE_KIND_WORKER,
                    TAG_RAY_USER_NODE_TYPE: node_type,
                    TAG_RAY_NODE_NAME: node_id,
                    **tags,
                    # Up to date once created (its raylet runs; there is nothing to install): the launcher's tags say
                    # `uninitialized`, and with node updaters disabled the autoscaler never replaces a node in that
                    # state when it stops heartbeating, so a killed node would block its replacement forever.
                    TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE,
                },
                "node": node,
            }
