#!/usr/bin/env bash
# Runs ON the device: copy the wheel pieces carried by this call (one or more .whl/gK folders) into /tmp/wheels,
# checking each against gpu_machine/parts.sha256, then say which groups are still missing.
#
#   bash gpu_machine/stage_wheels.sh .whl/g3
#
# /tmp survives only while the machine stays warm (30 s after a call): a fresh machine starts with no pieces, and
# the listing below shows it (start again from g1).
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${E3R_WHEELS:-/tmp/wheels}/parts"
mkdir -p "$dest"
for group in "$@"; do
    for part in "$group"/wheels.tar.part-*; do
        name="${group#.whl/}/$(basename "$part")"
        want=$(grep " $name\$" gpu_machine/parts.sha256 | cut -d' ' -f1)
        got=$(sha256sum "$part" | cut -d' ' -f1)
        [ -n "$want" ] && [ "$want" = "$got" ] || { echo "stage: $name does not match parts.sha256" >&2; exit 1; }
        cp "$part" "$dest/"
    done
done
staged=() missing=()
while read -r _ name; do
    if [ -f "$dest/$(basename "$name")" ]; then staged+=("${name%%/*}"); else missing+=("${name%%/*}"); fi
done < gpu_machine/parts.sha256
echo "stage: staged ${staged[*]:-none}; missing ${missing[*]:-none}; $(uptime -p 2>/dev/null || true)"
