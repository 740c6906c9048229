"""Our drafter against speculators' own Trainer on the same captured data, both served by the same vLLM in one call.

    python3 -m bench.gpu.parity ray_jobs/configs/smollm2_h200.yaml --set run.storage_path=/tmp/runs <the run's
        overrides> --epochs 3 --out $OUT/parity.json

The recipe and overrides name a run; its latest export is measured, with the train and generate outputs that export
came from (their provenance.json). From that generate output this writes speculators' data format for the samples
of our training split (our validation samples stay held out from both drafters): per-sample
`hidden_states/hs_{i}.safetensors` (`token_ids` + `hidden_states`) and a datasets folder of input_ids / loss_mask /
seq_len, the first T = len(input_ids) - 1 tokens (those the capture covers), with the run's own draft vocabulary
(train/<version>/vocab: the same d2t / t2d for both drafters). It then trains speculators' drafter with
`python3 -m speculators.train` and its own defaults (Muon, lr 1e-3, linear schedule, total_seq_len 8192, ttt 3) for
`--epochs` epochs, and measures plain decoding, the run's exported drafter and speculators' last checkpoint (its config
written as the export writes ours: `served_copy`) on the recipe's evaluate prompts, at every
`evaluate.num_speculative_tokens` and `evaluate.concurrency`, with the evaluate stage's engines: speed, acceptance (per
MT-Bench category too), and each drafter's acceptance on the run's first `evaluate.contract_prompts` validation prompts
next to training's replay estimate (`predicted_vs_measured`).
speculators' Trainer needs a GPU; `--theirs DIR` skips its training and measures DIR instead (the CPU rehearsal
passes the run's own export there). `--stage train` / `--stage measure` split the work over two calls of at most
10 minutes each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

from bench.gpu_train_bench import speculators_cli_command, write_spec_dataset
from eagle3_ray.core import shards, storage, verifiers
from eagle3_ray.core.config import load_config
from eagle3_ray.evaluate import acceptance, report
from eagle3_ray.evaluate.engine import engine_args
from eagle3_ray.evaluate.measure import measure_baseline_again, plain_runs, run_engine
from eagle3_ray.evaluate.prediction import predicted_vs_measured, training_metrics
from eagle3_ray.evaluate.prompts import load_prompts, tokenize_prompts, validation_prompts
from eagle3_ray.train import data, export


def write_speculators_data(gen_dir: str, train_dir: str, spec_dir: str, cfg) -> dict:
    """speculators' data format from a generate output, for the samples of our training split (data.split_role under
    the run's config, which must agree with train/split.json: our validation samples, and the sampled responses of
    validation prompts, stay held out from both drafters) with our draft vocabulary; returns counts. A finished dir
    (its counts.json) is kept: a later call goes on to training."""
    done = Path(spec_dir, "counts.json")
    if done.exists():
        return json.loads(done.read_text())
    vocab_dir = storage.join(train_dir, "vocab")
    split = storage.read_json(storage.join(train_dir, "split.json"))
    every = pq.read_table(os.path.join(gen_dir, "manifest.parquet")).to_pylist()
    manifest = [m for m in every if data.split_role(m["id"], cfg) == "train"]
    stray = [i for i in split["val_ids"] if data.split_role(i, cfg) != "val"]
    if stray:
        raise ValueError(
            f"{train_dir}: validation sample {stray[0]} (of {len(stray)}) is not a validation sample under the "
            "config given: pass the run's own overrides"
        )
    conversations = {r["id"]: r for r in pq.read_table(os.path.join(gen_dir, "conversations.parquet")).to_pylist()}
    os.makedirs(os.path.join(spec_dir, "hidden_states"), exist_ok=True)
    rows, tokens = [], 0
    for i, m in enumerate(sorted(manifest, key=lambda m: m["id"])):
        t, conv = m["num_tokens"], conversations[m["id"]]
        ids = torch.tensor(conv["input_ids"][:t], dtype=torch.long)
        hs = shards.read_sample(os.path.join(gen_dir, "shards", m["shard"]), m["key"], torch.bfloat16)
        if hs.shape[0] != t:
            raise ValueError(f"{m['id']}: {hs.shape[0]} captured tokens, the manifest says {t}")
        save_file(
            {"token_ids": ids, "hidden_states": hs.contiguous()},
            os.path.join(spec_dir, "hidden_states", f"hs_{i}.safetensors"),
        )
        rows.append({"input_ids": ids.tolist(), "loss_mask": conv["loss_mask"][:t], "seq_len": t})
        tokens += t
    write_spec_dataset(spec_dir, rows)
    draft_vocab = np.load(os.path.join(vocab_dir, "d2t.npy")).size
    for name in ("d2t", "t2d"):  # the run's own mapping, in the file names speculators_cli_command passes
        Path(spec_dir, f"{name}-{draft_vocab}.npy").write_bytes(Path(vocab_dir, f"{name}.npy").read_bytes())
    counts = {
        "samples": len(rows),
        "held_out": len(every) - len(rows),
        "tokens": tokens,
        "draft_vocab_size": draft_vocab,
    }
    done.write_text(json.dumps(counts))
    return counts


def train_speculators(verifier_dir: str, spec_dir: str, aux: list[int], draft_vocab: int, epochs: int, work: str):
    """speculators' Trainer through its CLI with its defaults; returns (its last checkpoint dir, wall seconds). The CLI
    resumes from its last epoch checkpoint in `save_path`, so a call cut short at the machine's time limit goes on
    in the next one."""
    save_path = os.path.join(work, "speculators_ckpt")
    cmd = speculators_cli_command(
        verifier_dir, spec_dir, aux, draft_vocab=draft_vocab, epochs=epochs, save_path=save_path, total_seq_len=None
    )
    log_path = os.path.join(work, "speculators_train.log")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "400"})
    if code != 0:
        raise RuntimeError(f"speculators.train exited {code}; tail:\n{open(log_path).read()[-3000:]}")
    return last_checkpoint(save_path), time.perf_counter() - t0


def served_copy(checkpoint: str, cfg, capture: dict, verifier_dir: str, out: str) -> str:
    """speculators' checkpoint with its config written as our export writes ours (export.export_config, in the
    layout export.compat_layout picks): vLLM 0.24's loader drops the top-level norm_output that speculators' default
    drafter sets, and the evaluate engines refuse a drafter vLLM would misread."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(checkpoint, out)
    config = storage.read_json(os.path.join(out, "config.json"))
    config = export.export_config(
        config,
        capture,
        verifier_dir,
        config.get("dtype", cfg.export.dtype),
        vllm_compat_layout=export.compat_layout(cfg, config, export.serving_version(cfg)),
    )
    Path(out, "config.json").write_text(json.dumps(config, indent=2))
    return out


def last_checkpoint(save_path: str) -> str:
    """speculators' last epoch checkpoint dir (`<save_path>/<epoch>/` with its config.json)."""
    epochs_saved = [p for p in Path(save_path).iterdir() if p.name.isdigit() and (p / "config.json").exists()]
    if not epochs_saved:
        raise FileNotFoundError(f"no speculators checkpoint in {save_path}: run --stage train first")
    return str(max(epochs_saved, key=lambda p: int(p.name)))


def measure(
    cfg, verifier_dir: str, drafters: dict[str, str], capture: dict, capture_where: str, gen_dir: str, vocab_dir: str
):
    """Plain decoding, then every drafter (in the order of `drafters`) at every k and concurrency on the recipe's
    evaluate prompts, and on the run's first `evaluate.contract_prompts` validation prompts (the split training's
    replay estimate was computed on); with `evaluate.baseline_again`, plain decoding again at the end, into its rows
    (`tokens_per_s_again`, `baseline_drift`: did the machine's speed move while the drafters ran?). Returns the rows
    and, for our drafter, training's prediction next to both measurements."""
    from eagle3_ray.core import contract
    from eagle3_ray.core.raycluster import ensure_ray

    prompts = load_prompts(cfg)
    token_prompts = tokenize_prompts(verifier_dir, prompts, cfg.verifier.trust_remote_code)
    own = validation_prompts(cfg, gen_dir)
    own_tokens = tokenize_prompts(verifier_dir, own, cfg.verifier.trust_remote_code)
    ensure_ray(cfg.run)
    base, _ = plain_runs(cfg, verifier_dir, prompts, token_prompts)
    rows = [{"drafter": None, **report.baseline_row(c, run)} for c, run in base.items()]
    in_vocab = np.load(os.path.join(vocab_dir, "t2d.npy"))  # the draft vocabulary both drafters predict over
    for row, run in zip(rows, base.values(), strict=True):
        tokens = np.concatenate([np.asarray(o, dtype=np.int64) for o in run["outputs"]])
        row["outside_draft_vocab"] = float(1.0 - in_vocab[tokens].mean())  # training's val_diag_outside_vocab
        print("RESULT", json.dumps(row), flush=True)
    predictions = {}
    for name, drafter_dir in drafters.items():
        infos, contract_runs, own_rows = {}, {}, []
        for k in cfg.evaluate.num_speculative_tokens:
            args = engine_args(cfg, verifier_dir, drafter_dir, k)
            spec = run_engine(cfg, args, token_prompts, prompts, contract_prompts=own_tokens)
            infos[k] = spec["speculative"]
            contract.check_vllm_aux_layers(infos[k]["aux_layer_ids"], capture, capture_where=capture_where)
            if "contract" in spec:
                contract_runs[k] = spec["contract"]["spec"]
            for c, run in spec["runs"].items():
                tokens_per_s = report.baseline_row(c, run)["tokens_per_s"]
                rows.append(
                    {
                        "drafter": name,
                        "num_speculative_tokens": k,
                        "concurrency": c,
                        "tokens_per_s": tokens_per_s,
                        "speedup": tokens_per_s / next(r["tokens_per_s"] for r in rows if r["concurrency"] == c),
                        **{key: run["spec"][key] for key in acceptance.SPEC_TOTALS},
                        **acceptance.acceptance(run["spec"]),
                        "acceptance_per_position": acceptance.per_position(run["spec"]),
                        "by_category": report.breakdown(run, base[c], "category"),
                    }
                )
                own_rows.append(rows[-1])
                print("RESULT", json.dumps(rows[-1]), flush=True)
        metrics = training_metrics(drafter_dir) if name == "ours" else {}
        predictions[name] = predicted_vs_measured(metrics, own_rows, infos, contract_runs, cfg.evaluate.max_tokens)
        print("RESULT prediction", name, json.dumps(predictions[name]), flush=True)
    measure_baseline_again(cfg, verifier_dir, token_prompts, prompts, rows)
    for row in (r for r in rows if "tokens_per_s_again" in r):
        print("RESULT again", json.dumps(row), flush=True)
    return rows, predictions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("--set", nargs="*", default=[], help="the run's overrides (section.field=value)")
    p.add_argument("--epochs", type=int, default=3, help="speculators' Trainer epochs (its default is 20)")
    p.add_argument("--theirs", help="a drafter dir to measure instead of training speculators' (CPU rehearsal)")
    p.add_argument(
        "--stage",
        choices=("all", "train", "measure"),
        default="all",
        help="train: speculators' drafter only; measure: both drafters, speculators' from an earlier train call",
    )
    p.add_argument(
        "--order",
        default="ours,speculators",
        help="the order the drafters are measured in (speculators,ours: the other way round)",
    )
    p.add_argument("--work", default="/tmp/parity")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = load_config(args.recipe, args.set)
    # the run's latest export, and the train and generate outputs it came from
    export_dir = storage.latest(cfg.run.run_dir, "export")["path"]
    train_dir = storage.read_json(storage.join(export_dir, "provenance.json"))["inputs"]["train"]
    gen_dir = storage.read_json(storage.join(train_dir, "provenance.json"))["inputs"]["generate"]
    capture_where = storage.join(export_dir, "capture.json")
    capture = storage.read_json(capture_where)
    verifier_dir = verifiers.verifier_dir(cfg)
    result = {"recipe": args.recipe, "overrides": args.set, "generate": gen_dir, "export": export_dir}
    theirs, result["speculators_train_s"] = args.theirs, None
    if theirs is None and args.stage == "measure":  # trained by an earlier `--stage train` call
        theirs = last_checkpoint(os.path.join(args.work, "speculators_ckpt"))
    elif theirs is None:
        spec_dir = os.path.join(args.work, "spec_data")
        result["data"] = write_speculators_data(gen_dir, train_dir, spec_dir, cfg)
        print("RESULT data", json.dumps(result["data"]), flush=True)
        theirs, result["speculators_train_s"] = train_speculators(
            verifier_dir, spec_dir, capture["aux_layer_ids"], result["data"]["draft_vocab_size"], args.epochs, args.work
        )
        print("RESULT speculators", json.dumps({"checkpoint": theirs, "train_s": result["speculators_train_s"]}))
    if args.stage == "train":
        Path(args.out).write_text(json.dumps(result, indent=2))
        return
    theirs = served_copy(theirs, cfg, capture, verifier_dir, os.path.join(args.work, "speculators_served"))
    drafters = {"ours": storage.join(export_dir, "speculators"), "speculators": theirs}
    order = args.order.split(",")
    if sorted(order) != sorted(drafters):
        raise SystemExit(f"--order {args.order}: name each of {sorted(drafters)} once")
    drafters = {name: drafters[name] for name in order}
    result["drafters"] = drafters
    result["rows"], result["predicted_vs_measured"] = measure(
        cfg, verifier_dir, drafters, capture, capture_where, gen_dir, storage.join(train_dir, "vocab")
    )
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
