#!/usr/bin/env bash
# Runs HERE (CPU, with PyPI): download the wheels the H200 machines (no internet) lack, pack them into call-sized groups.
#
#   bash gpu_machine/build_wheels.sh    # -> .whl/all/*.whl, .whl/g1 .. .whl/gN, gpu_machine/{wheels,parts}.sha256
#
# One device call carries at most 64 MiB (working tree + carry), so the wheels travel as one deterministic tar stream
# cut into PART_MIB pieces, one piece per group folder .whl/gK (one call's `carry`). On the device
# gpu_machine/stage_wheels.sh collects the pieces in /tmp/wheels and gpu_machine/install.sh joins and installs them.
# The tar is byte-reproducible (sorted names, fixed owner and mtime), so the committed sha256 lists match a rebuild.
set -euo pipefail
cd "$(dirname "$0")/.."
PART_MIB="${PART_MIB:-55}"
PY="${PY:-.venv/bin/python}"
here=gpu_machine
platforms=""
for n in 39 38 35 34 31 28 27 24 17; do platforms+=" --platform manylinux_2_${n}_x86_64"; done
platforms+=" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any"

mkdir -p .whl/all
grep -q '^/.whl/$' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
# pip matches each manylinux_2_N tag exactly, hence the list of N.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
    -d .whl/all -r "$here/wheels.txt" 2>&1 | grep -v 'is ignored' || true

# Exactly the pinned set: a wheel left over from an older pin list would install a second version.
want=$(grep -v '^#' "$here/wheels.txt" | grep . | wc -l)
have=$(ls .whl/all/*.whl | wc -l)
[ "$want" = "$have" ] || { echo "expected $want wheels in .whl/all, found $have: remove stale ones" >&2; exit 1; }
"$PY" "$here/check_wheels.py" .whl/all

(cd .whl/all && sha256sum *.whl) > "$here/wheels.sha256"
rm -rf .whl/g[0-9]* .whl/parts && mkdir -p .whl/parts
tar -C .whl/all --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . \
    | split -b "${PART_MIB}M" -d -a 2 - .whl/parts/wheels.tar.part-
k=0
for part in .whl/parts/wheels.tar.part-*; do
    k=$((k + 1)); mkdir -p ".whl/g$k"; mv "$part" ".whl/g$k/"
done
rmdir .whl/parts
(cd .whl && sha256sum g*/wheels.tar.part-*) > "$here/parts.sha256"
{
    echo "# group  bytes  MiB  part   (one device call carries one group: carry [\".whl/gK\"])"
    for g in $(ls -d .whl/g* | sort -V); do
        f=$(ls "$g"); b=$(stat -c %s "$g/$f")
        printf '%s  %s  %.1f  %s\n' "${g#.whl/}" "$b" "$(echo "$b/1048576" | bc -l)" "$f"
    done
    total=$(du -cb .whl/all/*.whl | tail -1 | cut -f1)
    printf '# %s wheels, %s bytes (%.1f MiB) in %s groups\n' "$have" "$total" "$(echo "$total/1048576" | bc -l)" "$k"
} > "$here/groups.txt"
cat "$here/groups.txt"
