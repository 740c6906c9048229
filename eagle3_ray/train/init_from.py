"""`train.init_from`: training that starts from an existing speculators-format EAGLE-3 drafter instead of random
weights: one this project exported (`<run>/export/<version>/speculators/`) or a published one laid out the same way
(config.json + model.safetensors), on a local path or a URI.

    python ray_jobs/pipeline.py ray_jobs/configs/tiny_cpu.yaml train.init_from=runs/old/export/<version>/speculators

The contract is checked in the driver before any compute: at pipeline start against the capture the run will make
(`check_before_compute`: the verifier's config and `verifier.aux_layer_ids`, generate's own capture_contract), and
again when the train stage starts against the capture.json it trains on (`check`). What cannot be adapted (the
verifier's hidden size, vocabulary or architecture, the aux layer ids, the drafter flags, the number of draft layers;
core/contract.py initial_drafter_problems) ends the job with one `error:` line naming the field on each side.

A draft vocabulary that differs (another size, or other tokens: the run builds its own from its data) is adapted:
`remap_head_rows` carries the drafter's lm_head row of every token both draft vocabularies hold over to the run's
draft id of that token; a token new to the run's draft vocabulary keeps the row a cold start gives it, the verifier's
lm_head row (speculators' load_verifier_weights). The `init_from` log line and the train summary say how many rows
came from where. Embeddings, verifier head and norm come from the verifier, as in any run.

Workers load the weights when the run has no checkpoint of its own (worker.Loop.restore: a resumed run restores its
own state instead); the optimizer starts fresh. Each worker checks the sha256 of the bytes it loads against the one
the driver recorded.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from eagle3_ray.core import contract, storage
from eagle3_ray.core.config import Config, TrainConfig, UserError
from eagle3_ray.core.telemetry import log


def trained_flags(tc: TrainConfig) -> dict[str, bool]:
    """The drafter flags (contract.DRAFTER_FLAGS) of the drafters training builds with `tc` (worker.build_model):
    norms before the residual and on the output always, the input norms per `train.fc_norm`."""
    return {"norm_before_residual": True, "norm_before_fc": not tc.fc_norm, "fc_norm": tc.fc_norm, "norm_output": True}


FILES = ("config.json", "model.safetensors")
# Tensors a drafter may carry that a run takes from elsewhere: the verifier's (embeddings, head, norm; export leaves
# them out, speculators' save_pretrained keeps embed_tokens) and the draft vocabulary's mapping (the run's own).
NOT_LOADED = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.", "d2t", "t2d")
# New draft tokens' head rows: where they come from, as the summary says it.
NEW_ROWS_FROM = "the verifier's lm_head rows (as a cold start)"


def read_config(path: str) -> dict[str, Any]:
    """The drafter's config.json; UserError when the directory lacks a file a drafter has."""
    for name in FILES:
        if not storage.exists(storage.join(path, name)):
            raise UserError(
                f"train.init_from={path} has no {name}: name a speculators-format drafter directory (config.json + "
                f"model.safetensors, what export writes under <run>/export/<version>/speculators/)"
            )
    return storage.read_json(storage.join(path, "config.json"))


def check(cfg: Config, capture: dict[str, Any]) -> dict[str, Any]:
    """Raise UserError (one line) unless `train.init_from` can start a run that captures `capture`; log what is
    adapted. Returns the drafter's draft vocabulary size."""
    path = cfg.train.init_from
    assert path is not None
    config = read_config(path)
    where = f"{path}/config.json"
    try:
        problems = contract.initial_drafter_problems(
            config,
            capture,
            flags=trained_flags(cfg.train),
            num_draft_layers=cfg.train.num_draft_layers,
            drafter_where=where,
            verifier_where=f"{capture['verifier_path']}/config.json",
        )
    except (ValueError, KeyError) as e:
        raise UserError(f"train.init_from: {where} is not a speculators eagle3 drafter config ({e})") from None
    if problems:
        raise UserError("; ".join(problems))
    draft_vocab_size = int(config["draft_vocab_size"])
    log(
        "train",
        "init_from_checked",
        path=path,
        drafter_draft_vocab_size=draft_vocab_size,
        run_draft_vocab_size=cfg.train.draft_vocab_size,
        adapt="head rows mapped onto the run's draft vocabulary when training starts",
    )
    return {"draft_vocab_size": draft_vocab_size}


def check_before_compute(cfg: Config) -> None:
    """`check` against the capture this config will make, before anything is generated (the pipeline's start; the
    train stage's start in online mode). A no-op without `train.init_from`."""
    if cfg.train.init_from is None:
        return
    from eagle3_ray.core import verifiers
    from eagle3_ray.generate.output import capture_contract

    check(cfg, capture_contract(cfg, verifiers.verifier_dir(cfg)))


def draft_token_ids(d2t: torch.Tensor | None, draft_vocab_size: int) -> torch.Tensor:
    """The verifier token id of every draft id (speculators' d2t holds offsets: target = draft + d2t[draft]); a
    drafter over the whole verifier vocabulary has no d2t. shape: [draft_vocab_size] int64."""
    ids = torch.arange(draft_vocab_size, dtype=torch.long)
    return ids if d2t is None else ids + d2t.long()


def remap_head_rows(
    old_rows: torch.Tensor, old_ids: torch.Tensor, fresh_rows: torch.Tensor, new_ids: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """The run's lm_head: `fresh_rows` (shape [D_new, H], draft ids `new_ids` [D_new] as verifier token ids), with
    the row of every token that the drafter's vocabulary (`old_ids` [D_old], rows `old_rows` [D_old, H]) also holds
    taken from the drafter. Returns (rows [D_new, H] in fresh_rows' dtype, number taken from the drafter)."""
    vocab = int(max(old_ids.max(), new_ids.max())) + 1
    old_position = torch.full((vocab,), -1, dtype=torch.long)
    old_position[old_ids] = torch.arange(len(old_ids))
    source = old_position[new_ids]  # shape: [D_new], -1 where the token is new
    kept = source >= 0
    rows = fresh_rows.detach().clone()
    rows[kept] = old_rows[source[kept]].to(rows.dtype)
    return rows, int(kept.sum())


def fingerprint(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_weights(path: str, expected_sha256: str | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """model.safetensors of the drafter at `path` and its sha256; ValueError when it is not `expected_sha256` (the
    file changed after the driver recorded it)."""
    uri = storage.join(path, "model.safetensors")
    data = storage.read_bytes(uri)
    digest = fingerprint(data)
    if expected_sha256 is not None and digest != expected_sha256:
        raise ValueError(f"{uri} has sha256 {digest}, but the run recorded {expected_sha256}: it changed meanwhile")
    return load_safetensors(data), digest


def drafter_token_ids(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The verifier token id of each row of a drafter's lm_head; none when it ships no head (a drafter over the
    whole vocabulary may leave it to the verifier's)."""
    head = tensors.get("lm_head.weight")
    return torch.zeros(0, dtype=torch.long) if head is None else draft_token_ids(tensors.get("d2t"), head.shape[0])


def head_row_counts(old_ids: torch.Tensor, new_ids: torch.Tensor) -> dict[str, int]:
    """How many of the run's draft tokens (`new_ids`) take their head row from the drafter's (`old_ids`)."""
    kept = int(torch.isin(new_ids, old_ids).sum())
    return {"drafter": len(old_ids), "run": len(new_ids), "rows_from_drafter": kept, "new_rows": len(new_ids) - kept}


def load_into(model, path: str, expected_sha256: str) -> dict[str, int]:
    """Load the drafter at `path` into `model` (the run's freshly built drafter, worker.build_model): its lm_head
    remapped onto the model's draft vocabulary, what the run takes from elsewhere (NOT_LOADED) left as built.
    Returns the head row counts."""
    from eagle3_ray.train.checkpoints import FROZEN_KEYS

    tensors, _digest = read_weights(path, expected_sha256)
    state = {k: v for k, v in tensors.items() if not k.startswith(NOT_LOADED)}
    # On the host: the model may already sit on its GPU (load_state_dict copies across devices).
    run_d2t = None if model.d2t is None else model.d2t.detach().cpu()
    old_ids, new_ids = drafter_token_ids(tensors), draft_token_ids(run_d2t, model.draft_vocab_size)
    if len(old_ids):
        state["lm_head.weight"], _kept = remap_head_rows(
            tensors["lm_head.weight"], old_ids, model.lm_head.weight.detach().cpu(), new_ids
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = set(missing) - set(FROZEN_KEYS) - {"d2t", "t2d", "lm_head.weight"}  # no head shipped: the verifier's rows
    if unexpected or left:
        raise ValueError(
            f"train.init_from={path} does not fit the run's drafter: missing={left} unexpected={unexpected}"
        )
    return head_row_counts(old_ids, new_ids)


def record(path: str, run_d2t: torch.Tensor | None, run_draft_vocab_size: int) -> dict[str, Any]:
    """The train summary's `init_from`, logged: the path, the sha256 of model.safetensors, and where the head rows
    of the run's draft vocabulary (`run_d2t`, None over the whole verifier vocabulary) come from."""
    tensors, digest = read_weights(path)
    counts = head_row_counts(drafter_token_ids(tensors), draft_token_ids(run_d2t, run_draft_vocab_size))
    log("train", "init_from", path=path, sha256=digest, **counts, new_rows_from=NEW_ROWS_FROM)
    return {"path": path, "sha256": digest, "draft_vocab": {**counts, "new_rows_from": NEW_ROWS_FROM}}
