#!/usr/bin/env bash
# Runs ON the device after every group was staged: join the pieces, check every wheel against
# gpu_machine/wheels.sha256, install them into /tmp/site (no index, no dependency resolution: the set is complete and
# checked by check_wheels.py), then print the versions that matter. A second run on the same machine is a no-op.
#
#   bash gpu_machine/stage_wheels.sh .whl/g8 && bash gpu_machine/install.sh && source gpu_machine/env.sh && ...
#
# PIP_TARGET_FLAGS lets the same script be rehearsed on another Python (here: CPython 3.11 installing the cp312 set,
# e.g. PIP_TARGET_FLAGS="--python-version 3.12 --platform manylinux_2_39_x86_64 ... --only-binary=:all:").
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${E3R_WHEELS:-/tmp/wheels}"
site="${E3R_SITE:-/tmp/site}"
stamp="$site/.eagle3_ray_wheels.sha256"
PY="${PY:-python3}"

if [ -f "$stamp" ] && cmp -s "$stamp" gpu_machine/wheels.sha256; then
    echo "install: $site already holds this wheel set"
else
    missing=$(while read -r _ name; do [ -f "$wheels/parts/$(basename "$name")" ] || echo "${name%%/*}"; done \
              < gpu_machine/parts.sha256 | tr "\n" " ")
    [ -z "$missing" ] || { echo "install: groups not staged on this machine: $missing" >&2; exit 1; }
    rm -rf "$wheels/all" && mkdir -p "$wheels/all"
    cat "$wheels"/parts/wheels.tar.part-* | tar -x -C "$wheels/all"
    (cd "$wheels/all" && sha256sum --quiet -c -) < gpu_machine/wheels.sha256
    start_s=$(date +%s)
    # shellcheck disable=SC2086  # PIP_TARGET_FLAGS is a list of flags
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        ${PIP_TARGET_FLAGS:-} "$wheels"/all/*.whl
    cp gpu_machine/wheels.sha256 "$stamp"
    echo "install: $(ls "$wheels"/all/*.whl | wc -l) wheels into $site in $(( $(date +%s) - start_s )) s"
fi
# The project travels as the repository on PYTHONPATH, not as an installed package: its entry points
# (pyproject.toml; the vLLM plugin of generate.capture_method=forward) go into a dist-info of their own in the site.
plugin="$site/eagle3_ray_entry_points-0.0.0.dist-info"
mkdir -p "$plugin"
printf 'Metadata-Version: 2.1\nName: eagle3-ray-entry-points\nVersion: 0.0.0\n' > "$plugin/METADATA"
"$PY" - "$plugin" <<'PY'
import sys, tomllib
groups = tomllib.load(open("pyproject.toml", "rb"))["project"]["entry-points"]
with open(f"{sys.argv[1]}/entry_points.txt", "w") as f:
    f.writelines(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for g, eps in groups.items())
PY
[ -n "${PIP_TARGET_FLAGS:-}" ] && exit 0  # a rehearsal on another Python cannot import the cp312 set

# shellcheck source=gpu_machine/env.sh
source gpu_machine/env.sh
"$PY" - <<'PY'
import importlib.metadata as md
names = ["torch", "vllm", "ray", "speculators", "transformers", "numpy", "numba", "pyarrow", "datasets",
         "safetensors", "pydantic", "xgrammar", "flashinfer-python", "triton", "tensorboard"]
def version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "MISSING"
print("install: " + ", ".join(f"{n} {version(n)}" for n in names))
import torch, vllm, ray, speculators, eagle3_ray  # noqa: E401,F401  the imports that every later call needs
plugins = [e.name for e in md.entry_points(group="vllm.general_plugins")]
print(f"install: vLLM plugins {plugins}")
print(f"install: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, eagle3_ray from {eagle3_ray.__file__}")
PY
