"""A generate-stage output made with transformers instead of vLLM: the verifier's greedy responses (HF `generate`) and
its hidden states through `layers.reference_hidden_states` (the capture contract on the transformers side), written in
the stage's format (docs/design.md): ids from `formats.conversation_id`, shards and manifest through shards.py and
shard_format.py, conversations.parquet typed as the stage's part files, capture.json from `output.capture_contract`.

    from eagle3_ray.generate.reference import write_reference_output
    gen_dir = write_reference_output(run_dir, verifier_dir, num_samples=48, max_new_tokens=48)

For what runs downstream of generate where vLLM is not wanted: the train, export and evaluate tests, and the CPU
training benchmark (bench/bench_train.py). A tiny verifier's greedy responses give a drafter something learnable.
"""

from __future__ import annotations

import random

import pyarrow as pa
import torch

from eagle3_ray.core import shard_format, shards, storage
from eagle3_ray.core.config import config_from_dict
from eagle3_ray.core.layers import reference_hidden_states
from eagle3_ray.generate.commit import PART_SCHEMA
from eagle3_ray.generate.output import CONVERSATION_COLUMNS, capture_contract
from eagle3_ray.ingest.formats import conversation_id

AUX_LAYER_IDS = [1, 3, 4]
WORDS = (
    "def class return import self value list dict path file error count while for print string index key open read"
    " write name data line"
).split()

# the generate stage's conversations.parquet columns, typed as its part files type them
CONVERSATION_SCHEMA = pa.schema([PART_SCHEMA.field(name) for name in CONVERSATION_COLUMNS])


def make_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """Short coding prompts, each from four words of WORDS drawn with `seed`."""
    rng = random.Random(seed)
    return [f"Write Python that uses {' '.join(rng.sample(WORDS, 4))} ({i})" for i in range(num_prompts)]


@torch.no_grad()
def _greedy_responses(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy responses for a batch of prompts (left padded), each cut after its first end-of-turn token."""
    width = max(len(p) for p in prompt_ids)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    responses = []
    for row in out[:, width:].tolist():
        cut = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        responses.append(row[:cut])
    return responses


def write_reference_output(
    run_dir: str,
    verifier_dir: str,
    *,
    num_samples: int = 48,
    max_new_tokens: int = 48,
    hidden_states_dtype: str = "bfloat16",
    samples_per_shard: int = 16,
    seed: int = 0,
    aux_layer_ids: list[int] | None = None,
    conversations: list[list[dict]] | None = None,
) -> str:
    """Write a finished generate version under `run_dir` and point generate/LATEST.json at it; returns its dir.
    `conversations` (prompt messages) default to `num_samples` prompts from `make_prompts`. The output is
    deterministic: a finished version is reused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
    # float32 on CPU: faster than bf16 here, and the stored bf16/fp8 copy rounds it anyway
    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    aux = list(aux_layer_ids or AUX_LAYER_IDS)
    layer_ids = aux + [model.config.num_hidden_layers]
    prompts = conversations or [[{"role": "user", "content": p}] for p in make_prompts(num_samples, seed)]
    version = storage.version_hash("reference", verifier_dir, prompts, max_new_tokens, hidden_states_dtype, seed, aux)
    out_dir = storage.stage_dir(run_dir, "generate", version)
    if storage.is_complete(out_dir):
        storage.set_latest(run_dir, "generate", version)
        return out_dir
    rows, manifest, pending = [], [], {}
    prompt_ids = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False) for m in prompts
    ]
    responses = _greedy_responses(model, tokenizer, prompt_ids, max_new_tokens)
    for i, (messages, p_ids, r_ids) in enumerate(zip(prompts, prompt_ids, responses, strict=True)):
        input_ids = p_ids + r_ids
        hs = reference_hidden_states(model, input_ids[:-1], layer_ids)  # generate mode: T = tokens - 1
        full_messages = messages + [{"role": "assistant", "content": tokenizer.decode(r_ids, skip_special_tokens=True)}]
        sample_id = conversation_id(messages)
        rows.append(
            {
                "id": sample_id,
                "messages": full_messages,
                "input_ids": input_ids,
                "loss_mask": [0] * len(p_ids) + [1] * len(r_ids),
                "num_prompt_tokens": len(p_ids),
                "num_response_tokens": len(r_ids),
                "finish_reason": "stop" if r_ids[-1] == tokenizer.eos_token_id else "length",
                "source": f"reference:{i}",
            }
        )
        shard_name = f"shard-{i // samples_per_shard:05d}.safetensors"
        key = f"s{i:06d}"
        pending.setdefault(shard_name, {}).update(shard_format.encode_sample(key, hs, hidden_states_dtype))
        manifest.append(
            {
                "id": sample_id,
                "shard": shard_name,
                "key": key,
                "num_tokens": hs.shape[0],
                "dtype": "float8_e4m3fn" if hidden_states_dtype == "fp8" else "bfloat16",
                "layer_ids": layer_ids,
                "hidden_size": hs.shape[2],
            }
        )
    for shard_name, tensors in pending.items():
        shards.write_shard(storage.join(out_dir, "shards", shard_name), tensors)
    storage.write_parquet_atomic(
        storage.join(out_dir, "manifest.parquet"), pa.Table.from_pylist(manifest, schema=shards.MANIFEST_SCHEMA)
    )
    storage.write_parquet_atomic(
        storage.join(out_dir, "conversations.parquet"), pa.Table.from_pylist(rows, schema=CONVERSATION_SCHEMA)
    )
    contract_cfg = config_from_dict(
        {
            "verifier": {"aux_layer_ids": aux, "dtype": "float32"},
            "generate": {"hidden_states_dtype": hidden_states_dtype},
        }
    )
    storage.write_json_atomic(storage.join(out_dir, "capture.json"), capture_contract(contract_cfg, verifier_dir))
    storage.write_json_atomic(storage.join(out_dir, "summary.json"), {"num_samples": len(prompts), "path": out_dir})
    storage.mark_complete(out_dir, {"num_samples": len(prompts)})
    storage.set_latest(run_dir, "generate", version)
    return out_dir
