"""Tiny, deterministic verifiers built in code (no downloads), each with a BPE tokenizer trained locally on Python's
standard library sources and a ChatML chat template, saved as ordinary HF model directories that transformers and
vLLM (CPU build) load:

- `llama`, `qwen3`: dense, GQA attention (head_dim 64).
- `deepseek_v3`: Multi-head Latent Attention + mixture of experts, shaped like DeepSeek-V3 / Kimi-K2 (q_lora_rank
  none, kv_lora_rank 512 + qk_rope_head_dim 64 = MLA head size 576, 8 routed experts + 1 shared, 2 per token, first
  layer dense, `noaux_tc` routing with sigmoid scores and `e_score_correction_bias`).
- `kimi`: the same text model (same weights) inside Kimi-K2.5's multimodal wrapper: `model_type: kimi_k25`,
  `architectures: [KimiK25ForConditionalGeneration]`, the DeepSeek-V3 config under `text_config`, a vision config
  beside it, weights under `language_model.*`. transformers 5 and vLLM 0.32 both know `kimi_k25` natively (no remote
  code). The checkpoint has no vision-tower weights: vLLM must run it text-only
  (`limit_mm_per_prompt: {vision_chunk: 0}`, which skips building the tower).

    python -m eagle3_ray.core.tiny_verifier llama /tmp/tiny-llama

`verifier.path: tiny:<arch>` resolves to one of these in core/verifiers.py.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Literal

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
]
BOS_ID, EOT_ID, PAD_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3, 4

# ChatML; `enable_thinking=false` closes an empty think block the way Qwen3's template does, so the reasoning switch
# of the generate stage has something real to act on.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

Arch = Literal["llama", "qwen3", "deepseek_v3", "kimi"]
ARCHS = ("llama", "qwen3", "deepseek_v3", "kimi")


@functools.lru_cache(maxsize=4)
def _trained_bpe(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_training_files(), trainer)
    return tok.to_str()


def _training_files(limit: int = 168) -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(stdlib, "*.py")))[:limit]


def build_tokenizer(vocab_size: int = 4096):
    """A byte-level BPE tokenizer trained on the standard library's top-level modules (about a second, once per
    process and vocab size: the training is deterministic)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_trained_bpe(vocab_size))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|im_end|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _model_config(arch: Arch, vocab_size: int, num_layers: int):
    """The text model's config; for `kimi` that is the DeepSeek-V3 config (the wrapper is written after saving)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=PAD_ID,
    )
    if arch in ("llama", "qwen3"):
        from transformers import LlamaConfig, Qwen3Config

        config_cls = LlamaConfig if arch == "llama" else Qwen3Config
        return config_cls(rope_theta=10000.0, num_key_value_heads=2, head_dim=64, **common)
    if arch in ("deepseek_v3", "kimi"):
        return _deepseek_v3_config(common)
    raise ValueError(f"tiny verifier arch must be one of {list(ARCHS)}, got {arch!r}")


def _deepseek_v3_config(common: dict):
    """MLA + MoE. vLLM's MLA kernels take the latent head size kv_lora_rank + qk_rope_head_dim; the reference CPU
    backend (CPU_MLA, used where the CPU has no AMX) decodes only 576 = 512 + 64 (DeepSeek-V3's own sizes): 320 loads
    but fails at the first decode step with "Unsupported block size: 16". `topk_method`/`scoring_func` are read by
    vLLM (transformers' model always routes this way) and make it load `mlp.gate.e_score_correction_bias`."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        num_key_value_heads=common["num_attention_heads"],
        moe_intermediate_size=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        rope_theta=10000.0,
        **common,
    )


def _kimi_wrapper_config(text: dict) -> dict:
    """Kimi-K2.5's config.json layout around a saved DeepSeek-V3 text config: a small vision config beside it
    (never built: vLLM runs it with `limit_mm_per_prompt: {vision_chunk: 0}`), media token ids pointed at the pad
    id (no prompt holds it).
    `media_placeholder_token_id` is the hub config's name for the image token, which vLLM 0.32's EAGLE proposer reads
    from a Kimi-K2.5 verifier (transformers' Kimi_K25Config calls it image_token_id): without it the engine with a
    drafter fails to load."""
    text = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version")}
    vision = {
        "model_type": "kimi_k25_vision",
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "patch_size": 14,
        "pos_emb_height": 8,
        "pos_emb_width": 8,
        "merge_kernel_size": [2, 2],
    }
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "dtype": text["dtype"],
        "text_config": text,
        "vision_config": vision,
        "projection_hidden_size": 64,
        "tie_word_embeddings": False,
        "image_token_id": PAD_ID,
        "video_token_id": PAD_ID,
        "vision_start_token_id": PAD_ID,
        "vision_end_token_id": PAD_ID,
        "media_placeholder_token_id": PAD_ID,
    }


# What vLLM's Kimi-K2.5 processor reads at engine start even when images are off (`media_proc_cfg`).
KIMI_PREPROCESSOR_CONFIG = {
    "media_proc_cfg": {
        "patch_size": 14,
        "merge_kernel_size": 2,
        "in_patch_limit": 1024,
        "patch_limit_on_one_side": 64,
        "in_patch_limit_each_frame": 1024,
        "in_patch_limit_video": None,
        "fixed_output_tokens": None,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "temporal_merge_kernel_size": 4,
        "sample_fps": 2.0,
        "timestamp_mode": "hh:mm:ss.fff",
        "config_type": "media_proc",
    }
}


def _wrap_as_kimi(model_dir: Path) -> None:
    """Turn a saved DeepSeek-V3 directory into Kimi-K2.5's layout in place: weights `model.*` / `lm_head.*` become
    `language_model.model.*` / `language_model.lm_head.*` (the names of Kimi's checkpoints, which vLLM and
    transformers map onto their own modules), config.json becomes the wrapper. Written by hand because
    transformers 5.19's save_pretrained of Kimi_K25ForConditionalGeneration renames the text layers wrongly
    (`layers` -> `blocks`, `self_attn.q_proj` -> `self_wqkv`: its vision renames reversed over every key)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(model_dir / "model.safetensors"))
    save_file(
        {f"language_model.{k}": v.contiguous() for k, v in weights.items()},
        str(model_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    text = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(_kimi_wrapper_config(text), indent=2, sort_keys=True))
    (model_dir / "preprocessor_config.json").write_text(json.dumps(KIMI_PREPROCESSOR_CONFIG, indent=2))


def build_tiny_verifier(
    arch: Arch, out_dir: str | Path, *, dtype: str = "bfloat16", num_layers: int = 6, seed: int = 0
) -> Path:
    """Build (or reuse, when already complete) a tiny verifier directory and return its path. The build is seeded
    (byte-identical on every machine) and atomic: it is written beside `out_dir` and renamed into place, so engine
    actors or workers building it at the same time on one node never see a half-written directory."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"tiny verifier arch must be one of {list(ARCHS)}, got {arch!r}")
    out = Path(out_dir)
    spec = {"arch": arch, "dtype": dtype, "num_layers": num_layers, "seed": seed}
    if _built(out, spec):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tokenizer = build_tokenizer()
    config = _model_config(arch, len(tokenizer), num_layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # A random head gives near-uniform next-token distributions; sharpen it so greedy text is less flat.
        model.lm_head.weight.mul_(5.0)
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=IM_END_ID, pad_token_id=PAD_ID)
    model.save_pretrained(tmp)
    if arch == "kimi":
        _wrap_as_kimi(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "tiny_verifier.json").write_text(json.dumps(spec))
    if out.exists() and not _built(out, spec):
        shutil.rmtree(out, ignore_errors=True)  # an older spec or an interrupted non-atomic build
    try:
        os.rename(tmp, out)
    except OSError:  # another builder renamed its identical copy first
        shutil.rmtree(tmp, ignore_errors=True)
        if not _built(out, spec):
            raise
    return out


def _built(out: Path, spec: dict) -> bool:
    marker = out / "tiny_verifier.json"
    return marker.exists() and json.loads(marker.read_text()) == spec


if __name__ == "__main__":
    print(build_tiny_verifier(sys.argv[1], sys.argv[2], dtype=sys.argv[3] if len(sys.argv) > 3 else "bfloat16"))
