"""Check captured hidden states against a transformers forward pass of the same verifier on the same tokens.

    python3 -m bench.gpu.check_capture /tmp/runs/h200-llama3-8b --num-samples 4

Reads the latest generate output of the run (capture.json, manifest.parquet, conversations.parquet, shards), runs
the verifier in transformers on `input_ids[:T]` of a few samples, and compares layer by layer. The reference is taken
with hooks, not `output_hidden_states`, so it means exactly what the capture contract says: id k < L is the input of
decoder layer k, id L the output of the last layer before the final norm. Prints one line per sample and layer
(relative L2 error); exit status 1 when any exceeds --max-rel-error (8e-3 in bf16 on the tiny verifier).

With --fp32-reference the same weights also run in float32, and a layer passes when the capture is within
--max-rel-error of that exact reference or no further from it than transformers' own bf16 forward pass is (times
--bf16-slack): deep random-weight models drift in bf16 whoever computes them. Tokens whose error is far beyond
rounding are listed with the reference position they match best (a shifted or foreign block shows up as an offset).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow.compute as pc
import torch

from eagle3_ray.core import shards, storage
from eagle3_ray.core.layers import reference_hidden_states


def rel_error(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Relative L2 error per layer of [T, L, H] tensors."""
    return [((a[:, j] - b[:, j]).norm() / b[:, j].norm()).item() for j in range(b.shape[1])]


def bad_tokens(stored: torch.Tensor, ref: torch.Tensor, threshold: float = 0.25) -> dict:
    """Positions whose first-layer state is off by more than `threshold` (relative), each with the reference position
    whose state it matches best: offset 0 means noise at that token, another offset a block from elsewhere."""
    s, r = stored[:, 0].float(), ref[:, 0].float()
    per_token = (s - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-6)
    bad = torch.nonzero(per_token > threshold).flatten()
    if bad.numel() == 0:
        return {"count": 0}
    distance = torch.cdist(s[bad], r, compute_mode="donot_use_mm_for_euclid_dist")  # [bad, T]
    best = distance.argmin(dim=-1)
    match = distance.gather(1, best[:, None]).flatten() / r[best].norm(dim=-1).clamp_min(1e-6)
    offsets = (best - bad).tolist()
    return {
        "count": int(bad.numel()),
        "of": int(s.shape[0]),
        "first": int(bad[0]),
        "last": int(bad[-1]),
        "positions": bad.tolist()[:64],
        "best_match_offsets": offsets[:64],
        "best_match_rel_error": [round(x, 4) for x in match.tolist()[:64]],
    }


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
    p.add_argument(
        "--fp32-reference",
        action="store_true",
        help="also run the same weights in float32 and judge against that (see the module docstring)",
    )
    p.add_argument("--bf16-slack", type=float, default=1.5)
    p.add_argument("--out", help="write the per-sample errors as JSON here")
    a = p.parse_args()
    gen = storage.latest(a.run_dir, "generate")["path"]
    contract = storage.read_json(storage.join(gen, "capture.json"))
    manifest = storage.read_parquet(storage.join(gen, "manifest.parquet")).sort_by("id")
    conversations = storage.read_parquet(storage.join(gen, "conversations.parquet"), columns=["id", "input_ids"])
    model, device = load_model(contract["verifier_path"], contract["model_dtype"])
    layer_ids, worst, rows = contract["layer_ids"], 0.0, []
    samples = manifest.slice(0, a.num_samples).to_pylist()
    for m in samples:
        ids = conversations.filter(pc.equal(conversations["id"], m["id"]))["input_ids"][0].as_py()[: m["num_tokens"]]
        stored = shards.read_sample(storage.join(gen, "shards", m["shard"]), m["key"]).to(device)  # [T, L, H]
        ref = reference_hidden_states(model, torch.tensor(ids, device=device), layer_ids)
        assert stored.shape == ref.shape, f"{m['id']}: stored {tuple(stored.shape)} vs reference {tuple(ref.shape)}"
        errors = rel_error(stored.float(), ref)
        rows.append(
            {
                "id": m["id"],
                "num_tokens": m["num_tokens"],
                "ids": ids,
                "stored": stored.cpu(),
                "ref": ref.cpu(),
                "rel_error": dict(zip(map(str, layer_ids), errors, strict=True)),
                "bad_tokens": bad_tokens(stored, ref),
            }
        )
        print(
            f"check_capture {m['id']} T={m['num_tokens']} "
            + " ".join(f"layer{k}={e:.2e}" for k, e in zip(layer_ids, errors, strict=True))
            + f" bad_tokens={rows[-1]['bad_tokens']}",
            flush=True,
        )
    if a.fp32_reference:
        model = model.float()
    for row in rows:
        stored = row.pop("stored").to(device)
        ids, ref = row.pop("ids"), row.pop("ref").to(device)
        if a.fp32_reference:
            exact = reference_hidden_states(model, torch.tensor(ids, device=device), layer_ids)
            capture = rel_error(stored.float(), exact)
            baseline = rel_error(ref, exact)  # transformers' own forward pass in the model dtype
            bounds = [max(a.max_rel_error, a.bf16_slack * b) for b in baseline]
            row.update(
                vs_fp32=dict(zip(map(str, layer_ids), capture, strict=True)),
                transformers_vs_fp32=dict(zip(map(str, layer_ids), baseline, strict=True)),
                bound=dict(zip(map(str, layer_ids), bounds, strict=True)),
            )
            passed = all(c <= b for c, b in zip(capture, bounds, strict=True))
            print(
                f"check_capture {row['id']} vs fp32: "
                + " ".join(
                    f"layer{k}={c:.2e}(transformers {b:.2e})"
                    for k, c, b in zip(layer_ids, capture, baseline, strict=True)
                )
                + f" {'ok' if passed else 'FAIL'}",
                flush=True,
            )
        else:
            passed = max(row["rel_error"].values()) <= a.max_rel_error
        row["ok"] = passed
        worst = max(worst, *(row["vs_fp32"] if a.fp32_reference else row["rel_error"]).values())
    ok = all(row["ok"] for row in rows)
    print(
        f"check_capture: {len(rows)} samples, layers {layer_ids}, worst relative error {worst:.2e} "
        f"({'ok' if ok else 'FAIL'}, {'vs fp32, bound max(limit, slack x transformers) ' if a.fp32_reference else ''}"
        f"limit {a.max_rel_error:g}, dtype {contract['model_dtype']}, device {device})"
    )
    if a.out:
        Path(a.out).write_text(json.dumps({"worst": worst, "ok": ok, "samples": rows, "contract": contract}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
