#!/usr/bin/env bash
# Runs on the H200 machine: a recipe's stages as a job that outlives the call that starts it, and the calls that
# wait for it. A process in its own session (setsid) runs on until the machine goes back (30 s after the last call
# ends), so no stage has to fit one call.
#
#   E3R_RECIPE=... E3R_OVERRIDES='...' E3R_STAGES=ingest,generate,train,export bash gpu_machine/background.sh start
#   E3R_RECIPE=... E3R_STAGES=... [E3R_RECOVERY=1] bash gpu_machine/background.sh as-written   # no overrides
#   [E3R_ADAPT_ARGS='--variants ...'] bash gpu_machine/background.sh adapt   # bench/gpu/adapt.py --scale gpu
#   bash gpu_machine/background.sh wait [seconds]     # each later call, back to back: waits (default 560 s) for the
#                                                   # job, copies its logs and results into $OUT, prints its events
#
# The job's log is /tmp/bg/recipe_<stages>.log, its results (run_checks.sh recipe) in /tmp/bg, its exit status in
# /tmp/bg/DONE. Do not change the repository's tracked files between the calls: each call copies the working tree
# again, and the job imports modules as its stages reach them.
set -uo pipefail
cd "$(dirname "$0")/.."
bg=/tmp/bg
case "${1:-}" in
start)
    mkdir -p "$bg" && rm -f "$bg/DONE"
    stages="${E3R_STAGES:?set E3R_STAGES}"
    log="$bg/recipe_${stages//,/_}.log"
    # shellcheck disable=SC2016  # expanded by the job's shell
    setsid nohup bash -c 'date -u +"start %FT%TZ $E3R_STAGES"; OUT=/tmp/bg bash gpu_machine/run_checks.sh recipe;
        rc=$?; date -u +"end %FT%TZ rc=$rc"; echo "rc=$rc" > /tmp/bg/DONE' > "$log" 2>&1 < /dev/null &
    echo "started: $stages, log $log"
    ;;
as-written)
    # The recipe (E3R_RECIPE) exactly as a user runs it (E3R_AS_WRITTEN: no override, its own run.storage_path),
    # from a copy of the repository in /tmp/bgrepo made when it starts (its runs/ stays), so the working tree that
    # later calls copy again never changes what the job imports. E3R_RECOVERY=1 also kills a generate engine after
    # its second committed unit (bench/gpu/recovery.py kill-engine) and a training worker at step 300 of epoch 1
    # (E3R_KILL_WORKER_AT; train/worker.py's hook).
    mkdir -p "$bg" && rm -f "$bg/DONE"
    mkdir -p /tmp/bgrepo && tar --exclude=./.whl --exclude=./.gpu --exclude=./runs -cf - . | tar -C /tmp/bgrepo -xf -
    stages="${E3R_STAGES:?set E3R_STAGES}"
    log="$bg/recipe_${stages//,/_}.log"
    # shellcheck disable=SC2016  # expanded by the job's shell
    setsid nohup bash -c 'cd /tmp/bgrepo && source gpu_machine/env.sh && date -u +"start %FT%TZ $E3R_STAGES";
        if [ -n "${E3R_RECOVERY:-}" ]; then
            "${PY:-python3}" bench/gpu/recovery.py kill-engine "runs/*" > /tmp/bg/kill_engine.log 2>&1 &
            export EAGLE3_RAY_TEST_KILL_WORKER_AT="${E3R_KILL_WORKER_AT:-1,300}"
        fi
        E3R_AS_WRITTEN=1 OUT=/tmp/bg bash gpu_machine/run_checks.sh recipe;
        rc=$?; date -u +"end %FT%TZ rc=$rc"; echo "rc=$rc" > /tmp/bg/DONE' > "$log" 2>&1 < /dev/null &
    echo "started as written: $stages, log $log"
    ;;
adapt)
    # The adaptation benchmark (bench/gpu/adapt.py --scale gpu) from a copy of the repository in /tmp/adaptrepo: its
    # train phase (the base recipe's run in /tmp/runs, skipped where finished; the code data; every variant), then its
    # evaluate phase as a second process with a Ray of its own (plain decoding right after training runs slower).
    # E3R_ADAPT_ARGS: more arguments of both phases (--variants, --base-set). The table and adapt.json land in /tmp/bg.
    mkdir -p "$bg" /tmp/adaptrepo && rm -f "$bg/DONE"
    tar --exclude=./.whl --exclude=./.gpu --exclude=./runs -cf - . | tar -C /tmp/adaptrepo -xf -
    # shellcheck disable=SC2016  # expanded by the job's shell
    setsid nohup bash -c 'cd /tmp/adaptrepo && source gpu_machine/env.sh && date -u +"start %FT%TZ adapt";
        for phase in train evaluate; do
            "${PY:-python3}" -m bench.gpu.adapt --scale gpu --phase $phase --out /tmp/bg/adapt.json \
                ${E3R_ADAPT_ARGS:-} 2>&1 | tee /tmp/bg/adapt_$phase.log; rc=${PIPESTATUS[0]}
            [ "$rc" = 0 ] || break
        done
        date -u +"end %FT%TZ rc=$rc"; echo "rc=$rc" > /tmp/bg/DONE' > "$bg/adapt.log" 2>&1 < /dev/null &
    echo "started: adapt, log $bg/adapt.log"
    ;;
wait)
    end=$(( $(date +%s) + ${2:-560} ))
    while [ ! -f "$bg/DONE" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    if [ -f "$bg/DONE" ]; then echo "done: $(cat "$bg/DONE")"; else echo "still running"; fi
    cp -r "$bg/." "${OUT:-/tmp/e3r_out}/" 2>/dev/null
    for log in "$bg"/recipe_*.log "$bg"/adapt.log; do
        [ -f "$log" ] || continue
        echo "== $log"
        grep -a "\[eagle3\|Error\|evaluated \|start 20\|end 20\|^| \|reaches" "$log" | grep -av "progress\|heartbeat\| train step=" \
            | tail -25
    done
    ;;
*)
    echo "usage: $0 start|as-written|adapt|wait [seconds]" >&2; exit 2 ;;
esac
