"""The tiny verifiers built in code: ordinary HF model directories that transformers and the CPU build of vLLM load
and generate with, identical for the same seed; the MLA + MoE one also inside Kimi-K2.5's multimodal wrapper
(served by vLLM in tests/e2e/test_mla_pipeline.py)."""

from __future__ import annotations

import pytest

from eagle3_ray.core.tiny_verifier import IM_END_ID

pytestmark = pytest.mark.e2e


CHAT = [{"role": "user", "content": "Write a function that reverses a list."}]


@pytest.fixture(scope="module")
def vllm_engine(tiny_llama, ray_session):
    """One CPU vLLM engine for the module, in a Ray actor of the session: vLLM's engine core runs in that actor's
    process (conftest.py), not in pytest's: after an in-process engine in pytest's own process, DataLoader workers
    that later tests forked from pytest hung in their first torch op (also with VLLM_CPU_OMP_THREADS_BIND=nobind)."""

    @ray_session.remote(num_cpus=1)
    class Engine:
        def __init__(self, model: str):
            from vllm import LLM

            self.llm = LLM(
                model=model,
                dtype="bfloat16",
                enforce_eager=True,
                kv_cache_memory_bytes=256 << 20,
                max_model_len=512,
                max_num_seqs=8,
                seed=0,
            )

        def chat(self, messages: list[dict], max_tokens: int) -> dict:
            from vllm import SamplingParams

            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            [out] = self.llm.chat([messages], params, use_tqdm=False)
            return {
                "prompt_token_ids": list(out.prompt_token_ids),
                "token_ids": list(out.outputs[0].token_ids),
                "finish_reason": out.outputs[0].finish_reason,
            }

    engine = Engine.remote(tiny_llama)
    yield lambda messages, max_tokens: ray_session.get(engine.chat.remote(messages, max_tokens))
    ray_session.kill(engine)


def test_tiny_verifier_generates_in_cpu_vllm_with_the_chat_template(vllm_engine, tiny_llama):
    from transformers import AutoTokenizer

    out = vllm_engine(CHAT, 16)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    expected_prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert out["prompt_token_ids"] == expected_prompt
    generated = out["token_ids"]
    assert 0 < len(generated) <= 16
    assert out["finish_reason"] == ("stop" if generated[-1] == IM_END_ID else "length")
    # Greedy decoding is deterministic: the same request gives the same tokens.
    assert vllm_engine(CHAT, 16)["token_ids"] == generated
