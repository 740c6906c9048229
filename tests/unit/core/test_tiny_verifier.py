"""The tiny verifiers built in code: ordinary HF model directories that transformers and the CPU build of vLLM load
and generate with, identical for the same seed; the MLA + MoE one also inside Kimi-K2.5's multimodal wrapper
(served by vLLM in tests/e2e/test_mla_pipeline.py)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from eagle3_ray.core.tiny_verifier import CHAT_TEMPLATE, build_tiny_verifier

pytestmark = pytest.mark.unit


CHAT = [{"role": "user", "content": "Write a function that reverses a list."}]


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory) -> dict[str, str]:
    """The DeepSeek-V3-shaped verifier and its Kimi-K2.5-wrapped twin, built from the same seed."""
    base = tmp_path_factory.mktemp("mla-verifiers")
    return {arch: str(build_tiny_verifier(arch, base / arch)) for arch in ("deepseek_v3", "kimi")}


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    return str(build_tiny_verifier("qwen3", tmp_path_factory.mktemp("verifiers") / "tiny-qwen3"))


def _generate_with_transformers(path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    return model, tokenizer, inputs["input_ids"], out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_verifier_loads_in_transformers_and_generates_from_the_chat_template(arch, tiny_llama, tiny_qwen3):
    path = {"llama": tiny_llama, "qwen3": tiny_qwen3}[arch]
    model, tokenizer, prompt_ids, out = _generate_with_transformers(path)
    assert model.config.model_type == arch and model.config.num_hidden_layers == 6
    assert model.config.head_dim == 64  # a head size the vLLM CPU attention backend supports
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.decode(prompt_ids[0]).endswith("<|im_start|>assistant\n")
    assert out.shape[1] > prompt_ids.shape[1]
    assert out[0, : prompt_ids.shape[1]].tolist() == prompt_ids[0].tolist()


def test_same_seed_builds_identical_weights_another_seed_differs_and_a_finished_build_is_reused(tmp_path):
    def weights(name: str, seed: int):
        path = build_tiny_verifier("llama", tmp_path / name, num_layers=2, seed=seed)
        return load_file(str(path / "model.safetensors")), json.loads((path / "tokenizer.json").read_text())

    (first, tok_first), (again, tok_again), (other, _) = weights("a", 0), weights("b", 0), weights("c", 1)
    assert first.keys() == again.keys() and all(first[k].equal(again[k]) for k in first)
    assert tok_first == tok_again
    assert any(not first[k].equal(other[k]) for k in first)

    stamp = (tmp_path / "a" / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_verifier("llama", tmp_path / "a", num_layers=2) == tmp_path / "a"
    assert (tmp_path / "a" / "model.safetensors").stat().st_mtime_ns == stamp


def test_builders_racing_on_one_node_both_get_the_complete_verifier(tmp_path):
    """Engine actors, ingest tasks and train workers on one node may build the same tiny verifier at once."""
    import subprocess
    import sys

    code = (
        "import sys; from eagle3_ray.core.tiny_verifier import build_tiny_verifier; "
        "print(build_tiny_verifier('llama', sys.argv[1], num_layers=2))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "v")], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs == [str(tmp_path / "v")] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"], "a temporary build was left behind"
    assert json.loads((tmp_path / "v" / "tiny_verifier.json").read_text())["num_layers"] == 2
    assert load_file(str(tmp_path / "v" / "model.safetensors"))


def test_a_node_without_the_tiny_verifier_builds_the_same_one_where_the_driver_has_it(tmp_path):
    import hashlib
    import shutil

    from eagle3_ray.core.verifiers import verifier_dir_on_this_node

    driver_side = build_tiny_verifier("llama", tmp_path / "verifier-tiny-llama-bfloat16")
    digest = hashlib.sha256((driver_side / "model.safetensors").read_bytes()).hexdigest()
    assert verifier_dir_on_this_node("tiny:llama", str(driver_side), "bfloat16") == str(driver_side)
    shutil.rmtree(driver_side)  # what another node's temp dir looks like
    rebuilt = verifier_dir_on_this_node("tiny:llama", str(driver_side), "bfloat16")
    assert rebuilt == str(driver_side)
    assert hashlib.sha256((driver_side / "model.safetensors").read_bytes()).hexdigest() == digest
    assert verifier_dir_on_this_node("org/real-model", "org/real-model", "bfloat16") == "org/real-model"


def test_deepseek_v3_verifier_has_mla_moe_and_the_routing_bias_vllm_loads(tiny_mla):
    config = json.loads(open(f"{tiny_mla['deepseek_v3']}/config.json").read())
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576  # the MLA head size vLLM's CPU kernels decode
    assert config["q_lora_rank"] is None and config["first_k_dense_replace"] == 1
    assert (config["n_routed_experts"], config["n_shared_experts"], config["num_experts_per_tok"]) == (8, 1, 2)
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    weights = load_file(f"{tiny_mla['deepseek_v3']}/model.safetensors")
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in weights
    assert "model.layers.0.mlp.gate_proj.weight" in weights and not any(".0.mlp.experts" in k for k in weights)
    assert "model.layers.5.mlp.experts.7.down_proj.weight" in weights


def test_kimi_verifier_nests_the_same_text_model_in_kimi_k25s_wrapper(tiny_mla):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(tiny_mla["kimi"])
    assert config.model_type == "kimi_k25" and config.architectures == ["KimiK25ForConditionalGeneration"]
    assert config.text_config.model_type == "deepseek_v3" and config.text_config.num_hidden_layers == 6
    assert config.media_placeholder_token_id == config.image_token_id  # vLLM's EAGLE proposer reads the first
    bare, wrapped = (load_file(f"{tiny_mla[a]}/model.safetensors") for a in ("deepseek_v3", "kimi"))
    assert set(wrapped) == {f"language_model.{k}" for k in bare}
    assert all(wrapped[f"language_model.{k}"].equal(v) for k, v in bare.items())

    kimi = AutoModelForImageTextToText.from_pretrained(tiny_mla["kimi"], dtype=torch.float32).eval()
    deepseek = AutoModelForCausalLM.from_pretrained(tiny_mla["deepseek_v3"], dtype=torch.float32).eval()
    prompt = torch.tensor([[0, 3, 100, 200, 300, 4]])
    with torch.no_grad():
        assert torch.equal(kimi(input_ids=prompt).logits, deepseek(prompt).logits)


def test_unknown_tiny_verifier_arch_names_the_ones_there_are(tmp_path):
    with pytest.raises(ValueError, match=r"one of \['llama', 'qwen3', 'deepseek_v3', 'kimi'\], got 'mamba'"):
        build_tiny_verifier("mamba", tmp_path / "v")
