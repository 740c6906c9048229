"""The tiny verifiers built in code: ordinary HF model directories that transformers and the CPU build of vLLM load
and generate with, identical for the same seed."""

from __future__ import annotations

import gc
import json

import pytest
from safetensors.torch import load_file

from eagle3_ray.tiny_verifier import CHAT_TEMPLATE, IM_END_ID, build_tiny_verifier

CHAT = [{"role": "user", "content": "Write a function that reverses a list."}]


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


@pytest.fixture(scope="module")
def vllm_engine(tiny_llama):
    """One CPU vLLM engine for the module (starting one takes ~20-25 s), shut down afterwards."""
    from vllm import LLM

    llm = LLM(model=tiny_llama, dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=256 << 20,
              max_model_len=512, max_num_seqs=8, seed=0)
    yield llm
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def test_tiny_verifier_generates_in_cpu_vllm_with_the_chat_template(vllm_engine, tiny_llama):
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0)
    [out] = vllm_engine.chat([CHAT], params, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    expected_prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert list(out.prompt_token_ids) == expected_prompt
    generated = out.outputs[0].token_ids
    assert 0 < len(generated) <= 16
    assert out.outputs[0].finish_reason == ("stop" if generated[-1] == IM_END_ID else "length")
    # Greedy decoding is deterministic: the same request gives the same tokens.
    [again] = vllm_engine.chat([CHAT], params, use_tqdm=False)
    assert list(again.outputs[0].token_ids) == list(generated)
