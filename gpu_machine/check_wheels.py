"""Check the wheel set for the H200 machines (no internet access) here, on CPU, before any GPU run.

    .venv/bin/python gpu_machine/check_wheels.py .whl/all

For every wheel: it is a valid zip (all CRCs), its tags install on CPython 3.12 / manylinux_2_39 x86_64, and it is
the only version of its name. Then, from the roots (vllm, speculators, ray[data,train,default]), every Requires-Dist
that applies on Python 3.12 Linux is followed: it must be met by a carried wheel (version checked) or by a package on
the image (gpu_machine/image_packages.txt; version checked where known, assumed where the image list gives no version).
Needs left out on purpose (NOT_NEEDED, each with its reason) and conflicts seen working there are reported, not failed.
Exit status 1 when anything else is unmet or in conflict.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOTS = [("vllm", frozenset()), ("speculators", frozenset()), ("ray", frozenset({"data", "train", "default"}))]
# Needs left out on purpose, with the reason. vLLM's optional kernel packages: its offline LLM, capture and
# generation ran without them on the H200; the rest serve only vLLM's HTTP server or Ray features that
# cannot work on an offline machine.
NOT_NEEDED = {
    **dict.fromkeys(
        [
            "flashinfer-cubin",
            "tilelang",
            "nvidia-cutlass-dsl",
            "quack-kernels",
            "tokenspeed-mla",
            "humming-kernels",
            "fastsafetensors",
            "nvidia-cudnn-frontend",
        ],
        "vLLM ran without it on the H200",
    ),
    **dict.fromkeys(
        ["fastapi-cli", "fastar", "email-validator", "httptools", "websockets", "pycountry"],
        "extras of vLLM's HTTP server; the offline LLM ran without them",
    ),
    "cryptography": "pyjwt[crypto] for mcp's auth; vLLM ran without it",
    "virtualenv": "Ray's runtime_env pip/uv only; impossible offline",
    "google-api-core": "opencensus's Stackdriver exporter only; Ray imports opencensus.stats/metrics/tags",
}
# Version conflicts with the image that were seen working there.
ACCEPTED = {("mistral-common", "numpy"): "vLLM 0.24.0 ran with the image's numpy 2.5.2 on the H200"}
PY312_LINUX = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
IMAGE_LIST = Path(__file__).with_name("image_packages.txt")


def target_tags() -> set:
    platforms = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + [
        "manylinux2014_x86_64",
        "manylinux1_x86_64",
        "linux_x86_64",
    ]
    tags = set(cpython_tags((3, 12), platforms=platforms))
    return tags | set(compatible_tags((3, 12), "cp312", platforms=platforms))


def read_wheel(path: Path) -> tuple[str, Version, list[Requirement]]:
    """Name, version and Requires-Dist of a wheel; raises if the zip is damaged (CRC of every member)."""
    with zipfile.ZipFile(path) as zf:
        bad = zf.testzip()
        if bad is not None:
            raise ValueError(f"{path.name}: damaged member {bad}")
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = zf.read(meta).decode()
    name = re.search(r"^Name: (.+)$", text, re.M).group(1).strip()
    version = Version(re.search(r"^Version: (.+)$", text, re.M).group(1).strip())
    reqs = [
        Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")
    ]
    return canonicalize_name(name), version, reqs


def read_image() -> dict[str, Version | None]:
    image = {}
    for line in IMAGE_LIST.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            image[canonicalize_name(name)] = Version(version) if version else None
    return image


def applies(req: Requirement, extras: frozenset) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**PY312_LINUX, "extra": e}) for e in (extras or {""}))


def walk(carried: dict, image: dict) -> tuple[list[str], list[str], list[str]]:
    """Follow requirements from the roots; returns (problems, assumed image versions, skipped optional needs)."""
    problems, assumed, skipped = [], set(), set()
    todo, seen = list(ROOTS), set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        _, reqs = carried[name]
        for req in (r for r in reqs if applies(r, extras)):
            dep = canonicalize_name(req.name)
            where = f"{name}{sorted(extras) if extras else ''} needs {req}"
            if dep in carried:
                if not req.specifier.contains(carried[dep][0], prereleases=True):
                    problems.append(f"{where}: carried {dep} {carried[dep][0]}")
                todo.append((dep, frozenset(req.extras)))
            elif dep in image:
                if image[dep] is None:
                    assumed.add(f"{dep}{req.specifier}")
                elif not req.specifier.contains(image[dep], prereleases=True):
                    if (name, dep) in ACCEPTED:
                        skipped.add(f"{where}: image has {dep} {image[dep]}: {ACCEPTED[name, dep]}")
                    else:
                        problems.append(f"{where}: image has {dep} {image[dep]}")
            elif dep in NOT_NEEDED:
                skipped.add(f"{where}: left out, {NOT_NEEDED[dep]}")
            else:
                problems.append(f"{where}: MISSING (neither carried nor on the image)")
    return problems, sorted(assumed), sorted(skipped)


def main(wheel_dir: str) -> int:
    tags, carried, problems = target_tags(), {}, []
    for path in sorted(Path(wheel_dir).glob("*.whl")):
        _, _, _, wheel_tags = parse_wheel_filename(path.name)
        if not wheel_tags & tags:
            problems.append(f"{path.name}: no tag installs on cp312 manylinux_2_39 x86_64")
        name, version, reqs = read_wheel(path)
        if name in carried:
            problems.append(f"{name}: two versions carried ({carried[name][0]} and {version})")
        carried[name] = (version, reqs)
    walk_problems, assumed, skipped = walk(carried, read_image())
    problems += walk_problems
    print(f"{len(carried)} wheels, all valid zips, one version each" if not problems else f"{len(carried)} wheels")
    print("image packages assumed to satisfy (no version in the image list):", ", ".join(assumed))
    print("left out or accepted on purpose:", *skipped, sep="\n  ")
    print("PROBLEMS:" if problems else "no problems", *problems, sep="\n  ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".whl/all"))
