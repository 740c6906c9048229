"""The autoscaling test bed's config (tests/support/autoscaling.py) is cluster.yaml scaled down: Ray's autoscaler
accepts it, and it keeps every node type with its GPUs and custom resources, each type starting from zero."""

from __future__ import annotations

import pytest
import yaml
from ray.autoscaler._private.util import validate_config

from tests.support import REPO
from tests.support.autoscaling import loopback_provider, node_types_from_cluster_yaml

pytestmark = pytest.mark.unit


def test_the_scaled_config_passes_ray_validation_and_keeps_every_node_type_of_cluster_yaml():
    source = yaml.safe_load((REPO / "cluster.yaml").read_text())
    config = node_types_from_cluster_yaml(REPO / "cluster.yaml", cpus_per_node=2, max_workers_per_type=2)
    config["provider"] = loopback_provider("127.0.0.1:6379", config["head_node_type"])
    validate_config(config)

    assert config["head_node_type"] == source["head_node_type"]
    assert set(config["available_node_types"]) == set(source["available_node_types"])
    for name, spec in source["available_node_types"].items():
        scaled = config["available_node_types"][name]
        if name == source["head_node_type"]:
            assert scaled["resources"] == {"CPU": 0}
            continue
        resources = dict(scaled["resources"])
        assert resources.pop("CPU") == min(spec["resources"]["CPU"], 2)
        assert resources.pop("object_store_memory") > 0
        assert resources == {k: v for k, v in spec["resources"].items() if k != "CPU"}
        assert (scaled["min_workers"], scaled["max_workers"]) == (0, min(spec["max_workers"], 2))
    assert config["max_workers"] <= source["max_workers"]
    assert config["idle_timeout_minutes"] < source["idle_timeout_minutes"]
