"""cluster.yaml passes Ray's own autoscaler validation and keeps the promises docs/operations.md makes; the KubeRay
RayJob manifest uses only fields the RayJob CRD defines (a vendored, strict subset of it: tests/data/kuberay)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.support import REPO

pytestmark = pytest.mark.unit

CLUSTER = yaml.safe_load((REPO / "cluster.yaml").read_text())
RAYJOB = yaml.safe_load((REPO / "k8s/rayjob.yaml").read_text())
RAYJOB_SCHEMA = json.loads((REPO / "tests/data/kuberay/rayjob_v1_schema.json").read_text())


def _all_commands(cfg: dict) -> list[str]:
    keys = (
        "initialization_commands",
        "setup_commands",
        "head_setup_commands",
        "worker_setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    )
    return [c for k in keys for c in cfg.get(k, [])]


def test_cluster_yaml_passes_ray_autoscaler_validation():
    validate_config(prepare_config(copy.deepcopy(CLUSTER)))


def test_cluster_validation_rejects_fractional_resources_so_the_check_is_real():
    broken = copy.deepcopy(CLUSTER)
    broken["available_node_types"]["gpu_8x_h100"]["resources"]["GPU"] = 8.5
    with pytest.raises(Exception, match="not of type 'integer'"):
        validate_config(prepare_config(broken))


def test_repo_never_turns_ray_authentication_off():
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    paths = [REPO / name for name in listed if name != str(Path(__file__).relative_to(REPO))]
    offenders = [
        str(p)
        for p in paths
        if p.is_file() and re.search(r"RAY_AUTH_MODE\s*[=:]\s*['\"]?disabled", p.read_text(errors="ignore"))
    ]
    assert len(paths) > 10 and offenders == []


def test_every_node_starts_ray_with_token_auth_and_a_private_dashboard():
    head, workers = CLUSTER["head_start_ray_commands"], CLUSTER["worker_start_ray_commands"]
    starts = [c for c in head + workers if "ray start" in c]
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token" in c for c in starts)
    assert "--dashboard-host=127.0.0.1" in next(c for c in head if "ray start" in c)
    # The token reaches every node through file_mounts from the operator's machine, not from the repo.
    assert CLUSTER["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_head_schedules_no_work_and_every_worker_type_scales_from_zero():
    types = CLUSTER["available_node_types"]
    assert types[CLUSTER["head_node_type"]]["resources"] == {"CPU": 0}
    workers = {name: t for name, t in types.items() if name != CLUSTER["head_node_type"]}
    assert workers and all(t["min_workers"] == 0 for t in workers.values())


def test_cluster_has_eight_gpu_nodes_for_tp8_and_installs_the_gpu_build():
    types = CLUSTER["available_node_types"].values()
    eight = [t for t in types if t["resources"].get("GPU") == 8]
    assert {t["node_config"]["InstanceType"] for t in eight} >= {"p5.48xlarge", "p5en.48xlarge"}
    assert any("scripts/install.sh gpu" in c for c in CLUSTER["setup_commands"])
    assert CLUSTER["file_mounts"]["~/eagle3-ray"] == "."


def test_rayjob_manifest_uses_only_fields_the_kuberay_crd_defines():
    jsonschema.validate(RAYJOB, RAYJOB_SCHEMA)


def test_rayjob_schema_check_rejects_an_unknown_field():
    broken = copy.deepcopy(RAYJOB)
    broken["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["minWorkers"] = 0
    with pytest.raises(jsonschema.ValidationError, match="minWorkers"):
        jsonschema.validate(broken, RAYJOB_SCHEMA)


def test_rayjob_runs_the_pipeline_with_token_auth_s3_storage_and_scale_from_zero():
    spec = RAYJOB["spec"]
    assert spec["entrypoint"].startswith("python /home/ray/eagle3-ray/ray_jobs/pipeline.py ")
    assert re.search(r"run\.storage_path=s3://\S+", spec["entrypoint"])
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["authOptions"]["mode"] == "token" and cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert all(g["minReplicas"] == 0 for g in groups.values())
    gpu8 = groups["gpu-8x"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert gpu8 == "8"
