"""Check captured hidden states against a transformers forward pass of the same verifier on the same tokens.

    python3 bench/gpu/check_capture.py /tmp/runs/h200-llama3-8b --num-samples 4

Reads the latest generate output of the run (capture.json, manifest.parquet, conversations.parquet, shards), runs
the verifier in transformers on `input_ids[:T]` of a few samples, and compares layer by layer. The reference is taken
with hooks, not `output_hidden_states`, so it means exactly what the capture contract says: id k < L is the input of
decoder layer k, id L the output of the last layer before the final norm. Prints one line per sample and layer
(relative L2 error); exit status 1 when any exceeds --max-rel-error (FACTS.md saw 8e-3 in bf16 on the tiny verifier).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow.compute as pc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for eagle3_ray
from eagle3_ray import shards, storage  # noqa: E402


def reference_states(model, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[T, len(layer_ids), H] from one forward pass: inputs of layers k < L, output of the last layer for k = L."""
    layers = model.model.layers
    seen: dict[int, torch.Tensor] = {}

    def keep_input(k):
        return lambda module, args, kwargs: seen.__setitem__(k, (args[0] if args else kwargs["hidden_states"])[0])

    def keep_output(module, args, kwargs, output):
        seen[len(layers)] = (output[0] if isinstance(output, tuple) else output)[0]

    hooks = [layers[k].register_forward_pre_hook(keep_input(k), with_kwargs=True) for k in layer_ids if k < len(layers)]
    hooks.append(layers[-1].register_forward_hook(keep_output, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=input_ids.unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([seen[k].float() for k in layer_ids], dim=1)


def load_model(path: str, dtype: str):
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.to(device).eval(), device


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="{run.storage_path}/{run.name}")
    p.add_argument("--num-samples", type=int, default=4)
    p.add_argument("--max-rel-error", type=float, default=2e-2)
    p.add_argument("--out", help="write the per-sample errors as JSON here")
    a = p.parse_args()
    gen = storage.latest(a.run_dir, "generate")["path"]
    contract = storage.read_json(storage.join(gen, "capture.json"))
    manifest = storage.read_parquet(storage.join(gen, "manifest.parquet")).sort_by("id")
    conversations = storage.read_parquet(storage.join(gen, "conversations.parquet"), columns=["id", "input_ids"])
    model, device = load_model(contract["verifier_path"], contract["model_dtype"])
    layer_ids, worst, rows = contract["layer_ids"], 0.0, []
    for m in manifest.slice(0, a.num_samples).to_pylist():
        ids = conversations.filter(pc.equal(conversations["id"], m["id"]))["input_ids"][0].as_py()[: m["num_tokens"]]
        stored = shards.read_sample(storage.join(gen, "shards", m["shard"]), m["key"]).to(device)  # [T, L, H]
        ref = reference_states(model, torch.tensor(ids, device=device), layer_ids)
        assert stored.shape == ref.shape, f"{m['id']}: stored {tuple(stored.shape)} vs reference {tuple(ref.shape)}"
        errors = [((stored[:, j] - ref[:, j]).norm() / ref[:, j].norm()).item() for j in range(len(layer_ids))]
        worst = max(worst, *errors)
        rows.append({"id": m["id"], "num_tokens": m["num_tokens"], "rel_error": dict(zip(map(str, layer_ids), errors))})
        print(f"check_capture {m['id']} T={m['num_tokens']} " + " ".join(
            f"layer{k}={e:.2e}" for k, e in zip(layer_ids, errors)), flush=True)
    ok = worst <= a.max_rel_error
    print(f"check_capture: {len(rows)} samples, layers {layer_ids}, worst relative error {worst:.2e} "
          f"({'ok' if ok else 'FAIL'}, limit {a.max_rel_error:g}, dtype {contract['model_dtype']}, device {device})")
    if a.out:
        Path(a.out).write_text(json.dumps({"worst": worst, "ok": ok, "samples": rows, "contract": contract}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
