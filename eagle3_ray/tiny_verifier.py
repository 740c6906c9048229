"""Tiny, deterministic verifiers built in code (no downloads): a Llama and a Qwen3, each with a BPE tokenizer trained
locally on Python's standard library sources and a ChatML chat template. Saved as ordinary HF model directories that
transformers and vLLM (CPU build) load.

    python -m eagle3_ray.tiny_verifier llama /tmp/tiny-llama
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Literal

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
BOS_ID, EOT_ID, PAD_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3, 4

# ChatML; `enable_thinking=false` closes an empty think block the way Qwen3's template does, so the reasoning switch
# of the generate stage has something real to act on.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

Arch = Literal["llama", "qwen3"]


def _training_files(limit: int = 168) -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(stdlib, "*.py")))[:limit]


def build_tokenizer(vocab_size: int = 4096):
    """A byte-level BPE tokenizer trained on the standard library's top-level modules (about a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(_training_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|im_end|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _model_config(arch: Arch, vocab_size: int, num_layers: int):
    common = dict(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                  tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=IM_END_ID, pad_token_id=PAD_ID)
    if arch == "llama":
        from transformers import LlamaConfig
        return LlamaConfig(rope_theta=10000.0, **common)
    if arch == "qwen3":
        from transformers import Qwen3Config
        return Qwen3Config(rope_theta=10000.0, **common)
    raise ValueError(f"tiny verifier arch must be 'llama' or 'qwen3', got {arch!r}")


def build_tiny_verifier(arch: Arch, out_dir: str | Path, *, dtype: str = "bfloat16", num_layers: int = 6,
                        seed: int = 0) -> Path:
    """Build (or reuse, when already complete) a tiny verifier directory and return its path. The build is seeded
    (byte-identical on every machine) and atomic: it is written beside `out_dir` and renamed into place, so engine
    actors or workers building it at the same time on one node never see a half-written directory."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

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


def local_run_dir(run_dir: str, run_name: str) -> str:
    """A local folder for what must be local files (the tiny verifier): the run dir itself when it is local
    (`file://` stripped), else a folder under the temp dir named after the run."""
    if run_dir.startswith("file://"):
        return run_dir[len("file://"):]
    if "://" in run_dir:
        return os.path.join(tempfile.gettempdir(), "eagle3_ray", run_name)
    return run_dir


def verifier_dir(cfg) -> str:
    """The verifier directory every stage uses: `verifier.path`, or the tiny verifier it names, built (once) in the
    run's local folder. One place, so every stage resolves the same directory and records the same path."""
    return resolve_verifier_path(cfg.verifier.path, local_run_dir(cfg.run.run_dir, cfg.run.name), cfg.verifier.dtype)


def verifier_dir_on_this_node(source: str, path: str, dtype: str) -> str:
    """For code in Ray actors and tasks, which need not run on the driver's node: `path` as the driver resolved
    `verifier.path` (`source`), except that a tiny verifier missing on this node (a remote run dir keeps it in each
    node's temp dir) is built here first, at the same path (seeded: the same bytes)."""
    if source.startswith("tiny:") and not Path(path).exists():  # builds are atomic: a dir that exists is complete
        return str(build_tiny_verifier(source.split(":", 1)[1], path, dtype=dtype))
    return path


def resolve_verifier_path(path: str, run_dir_local: str, dtype: str = "bfloat16") -> str:
    """`tiny:<arch>` builds a tiny verifier under the run dir; anything else is returned unchanged."""
    if not path.startswith("tiny:"):
        return path
    arch = path.split(":", 1)[1]
    return str(build_tiny_verifier(arch, Path(run_dir_local) / f"verifier-tiny-{arch}-{dtype}", dtype=dtype))


if __name__ == "__main__":
    print(build_tiny_verifier(sys.argv[1], sys.argv[2], dtype=sys.argv[3] if len(sys.argv) > 3 else "bfloat16"))
