"""Build a real-shaped verifier directory without downloading anything: the model's config.json written here, the
project's small locally trained tokenizer (tiny_verifier.build_tokenizer, 4096 ids, ChatML template), and either
random bf16 weights (safetensors shards, made on the GPU when there is one) or no weights at all (for vLLM's
`load_format="dummy"`).

    python3 -m bench.gpu.make_verifier llama3-8b /tmp/verifiers/llama3-8b            # 16 GB of random weights
    python3 -m bench.gpu.make_verifier qwen3-30b-a3b /tmp/verifiers/qwen3-moe --no-weights --num-layers 8
    python3 -m bench.gpu.make_verifier tiny /tmp/verifiers/tiny                     # CPU rehearsal, seconds

The tokenizer has 4096 ids while the model keeps its real vocabulary (128256 for Llama-3.1): the rows of lm_head
past the tokenizer are zero, so greedy decoding (generate.temperature=0) only emits ids the tokenizer can decode.
Sampling with temperature > 0 would reach those ids; keep this verifier greedy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eagle3_ray.core.tiny_verifier import BOS_ID, IM_END_ID, PAD_ID, build_tokenizer

_LLAMA31_ROPE = {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
# config.json as the model's authors ship it (Llama-3.1-8B-Instruct, Qwen3-30B-A3B), with the special token ids
# of our tokenizer instead of theirs.
PRESETS = {
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_ROPE,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        initializer_range=0.02,
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        initializer_range=0.02,
    ),
    # The tiny verifier's shape (tiny_verifier.py), for rehearsing this script and the benches on CPU.
    "tiny": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=8192,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        initializer_range=0.02,
    ),
}
SHARD_BYTES = 4 << 30


def model_config(preset: str, num_layers: int | None, max_position_embeddings: int | None) -> dict:
    cfg = dict(
        PRESETS[preset], bos_token_id=BOS_ID, eos_token_id=IM_END_ID, pad_token_id=PAD_ID, torch_dtype="bfloat16"
    )
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
    if max_position_embeddings is not None:
        cfg["max_position_embeddings"] = max_position_embeddings
    return cfg


def weight_shapes(out: Path) -> dict[str, torch.Size]:
    """Parameter names and shapes of the architecture in config.json, from a model built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    return {name: p.shape for name, p in model.state_dict().items()}


def random_weight(name: str, shape: torch.Size, std: float, num_tokenizer_ids: int, device: str) -> torch.Tensor:
    if len(shape) == 1:  # RMSNorm scales are ones; biases (none in these presets) zeros
        return (torch.ones if name.endswith("norm.weight") else torch.zeros)(shape, dtype=torch.bfloat16, device=device)
    w = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std)
    if name == "lm_head.weight":
        w[num_tokenizer_ids:] = 0  # greedy decoding then stays inside the tokenizer's ids (module docstring)
    return w


def write_weights(out: Path, std: float, num_tokenizer_ids: int, device: str) -> int:
    """Random bf16 weights in <= 4 GiB safetensors shards plus the index transformers and vLLM read."""
    from safetensors.torch import save_file

    shapes = weight_shapes(out)
    groups, current, used = [], [], 0
    for name, shape in shapes.items():
        size = shape.numel() * 2
        if current and used + size > SHARD_BYTES:
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    groups.append(current)
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: random_weight(n, shapes[n], std, num_tokenizer_ids, device).cpu() for n in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def build(
    preset: str,
    out: Path,
    *,
    weights: bool,
    num_layers: int | None = None,
    max_position_embeddings: int | None = None,
    seed: int = 0,
) -> dict:
    if weights and "num_experts" in PRESETS[preset]:
        raise ValueError(
            f"{preset}: random weights are written from transformers' parameter names, which for MoE "
            "models are not the checkpoint names vLLM loads; use --no-weights (load_format=dummy)"
        )
    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(preset, num_layers, max_position_embeddings)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": IM_END_ID, "pad_token_id": PAD_ID})
    )
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight_bytes = write_weights(out, cfg["initializer_range"], len(tokenizer), device) if weights else 0
    info = {
        "preset": preset,
        "path": str(out),
        "num_hidden_layers": cfg["num_hidden_layers"],
        "vocab_size": cfg["vocab_size"],
        "tokenizer_ids": len(tokenizer),
        "weights": weights,
        "weight_bytes": weight_bytes,
        "build_s": round(time.monotonic() - start, 1),
    }
    (out / "make_verifier.json").write_text(json.dumps(info))
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--no-weights", action="store_true", help="config + tokenizer only (load_format=dummy)")
    parser.add_argument("--num-layers", type=int, help="fewer decoder layers than the real model")
    parser.add_argument("--max-position-embeddings", type=int)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    print(
        json.dumps(
            build(
                a.preset,
                a.out,
                weights=not a.no_weights,
                num_layers=a.num_layers,
                max_position_embeddings=a.max_position_embeddings,
                seed=a.seed,
            )
        )
    )


if __name__ == "__main__":
    main()
