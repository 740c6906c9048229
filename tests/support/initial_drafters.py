"""Drafters to start a run from (train.init_from), made by the library's own functions without training: the
train stage's untrained drafter (worker.build_model) for a verifier, written the way the export stage writes one
(export.export_config + export.write_speculators), with config.json fields changed where a test needs a drafter that
does not fit."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch


def untrained_drafter_dir(
    verifier_dir: str,
    out: Path,
    *,
    aux_layer_ids: list[int],
    draft_vocab_size: int = 256,
    changes: dict[str, Any] | None = None,
    layer_changes: dict[str, Any] | None = None,
) -> Path:
    """`out` as a speculators drafter directory for `verifier_dir`; `changes` replace top-level config.json
    fields, `layer_changes` fields of its transformer_layer_config."""
    from eagle3_ray.core.config import config_from_dict
    from eagle3_ray.generate.output import capture_contract
    from eagle3_ray.train import checkpoints, export, vocab, worker

    cfg = config_from_dict(
        {
            "verifier": {"path": verifier_dir, "aux_layer_ids": aux_layer_ids},
            "train": {"draft_vocab_size": draft_vocab_size, "compile": "off"},
        }
    )
    capture = capture_contract(cfg, verifier_dir)
    with tempfile.TemporaryDirectory(prefix="drafter-") as tmp:
        vocab.save_vocab(tmp, *vocab.build_vocab({}, draft_vocab_size, capture["vocab_size"]), {})
        model = worker.build_model(cfg, capture, tmp, torch.device("cpu"))
        model.save_pretrained(tmp, state_dict=checkpoints.trainable_state_dict(model), safe_serialization=True)
        checkpoint_config = json.loads(Path(tmp, "config.json").read_text())
    config = export.export_config(checkpoint_config, capture, verifier_dir, "bfloat16")
    export.write_speculators(model, config, out, "bfloat16")
    config.update(changes or {})
    config["transformer_layer_config"].update(layer_changes or {})
    (out / "config.json").write_text(json.dumps(config))
    return out
