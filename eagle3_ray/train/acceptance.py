"""Serving-faithful acceptance estimate: vLLM's draft/verify chain replayed over a drafter's validation predictions.

Training's `acc_j` treats every response position as a draft start. vLLM starts a draft only where the previous one
ended: it drafts k tokens, the verifier accepts the matching prefix plus one token of its own, and the next draft
starts after that. Starts then land more often on hard positions, so `1 + sum_j acc_j` overstates what vLLM measures
(tiny run: 2.22 vs 1.76); this replay matched vLLM to 0.004 there. Pure torch: no Ray, vLLM or I/O.

What speculators' `Eagle3DraftModel.forward` gives back (speculators 0.9.0, models/eagle3/core.py + metrics.py):
`draft_tokens`, one [1, T] tensor of draft-vocab ids per TTT step. Step j's prediction at row position p belongs to
the draft that *starts* at p (inputs shifted left by j, teacher-forced) and is scored against the target at p + j
(`align_for_step`: logits[:, :-j] vs targets[:, j:]). Targets are argmax(verifier_lm_head(verifier_norm(last))),
also draft-vocab ids, here with the verifier choices outside the draft vocab made unmatchable (`target_ids`).
After speculators' `shift_batch`, position t holds (x[t+1], g[t]) and its target is the verifier's greedy x[t+2]:

    row position          p      p+1     p+2             (one document; loss mask taken at the target position)
    step 0 predicts       x[p+2]                         vs target[p]
    step 1 predicts       x[p+3]                         vs target[p+1], counted only if step 0 matched
    step 2 predicts       x[p+4]                         vs target[p+2], counted only if steps 0, 1 matched
    accepted a, bonus 1 -> next draft starts at p + a + 1

The first masked position of a response is where vLLM drafts right after the prompt's prefill (its target is the
second response token). A draft whose steps run past the end of the document, or onto a masked-out position, stops
there (those steps count as rejected). The drafter only predicts `ttt_steps` positions: a longer k is replayed with
`min(k, ttt_steps)` steps (`replay_lengths`). Metric names: `val_replay_acceptance_length_k{k}` (tokens per verifier
step, vLLM's mean acceptance length) and `val_replay_acc_k{k}_{j}` (share of drafts whose token j was accepted,
vLLM's per-position acceptance); `val_replay_acceptance_length` is the largest k's.

The replay covers what the evaluate stage decodes: the first `evaluate.max_tokens` response tokens of each document
(`first_response_tokens`), not every captured one: acceptance changes along a response, so a replay over whole
responses would not estimate what vLLM measures over their first tokens.
"""

from __future__ import annotations

import torch


def replay_lengths(num_speculative_tokens: list[int], ttt_steps: int) -> list[int]:
    """The draft lengths a drafter trained with `ttt_steps` steps can be replayed at, for the evaluated ks."""
    return sorted({min(k, ttt_steps) for k in num_speculative_tokens})


def target_ids(
    model, verifier_last_hidden_states: torch.Tensor, input_ids: torch.Tensor, document_ids: torch.Tensor
) -> torch.Tensor:
    """What each position's draft must match, in draft-vocab ids. shape: [1, T]

    speculators' target is the argmax of the verifier head's draft-vocab rows; vLLM accepts a draft token only if it
    is the verifier's own (full-vocab) choice. Where the row holds that token (the teacher-forced input one position
    on: x[t+2], the verifier's own output when `generate.temperature` is 0) and the draft-vocab argmax maps
    (d2t) to another token, the verifier's choice is outside the draft vocab: no draft matches it (-1)."""
    restricted = model.verifier_lm_head(model.verifier_norm(verifier_last_hidden_states)).argmax(dim=-1)
    as_target = draft_to_target(model, restricted)
    next_tokens = torch.full_like(input_ids, -1)
    next_tokens[:, :-1] = input_ids[:, 1:].masked_fill(document_ids[:, 1:] != document_ids[:, :-1], -1)
    return restricted.masked_fill((next_tokens >= 0) & (as_target != next_tokens), -1)


def draft_to_target(model, draft_ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocab ids as verifier ids (d2t holds offsets); a drafter over the whole verifier vocabulary has no d2t."""
    return draft_ids if model.d2t is None else draft_ids + model.d2t[draft_ids]


def step_matches(
    draft_tokens: list[torch.Tensor], targets: torch.Tensor, loss_mask: torch.Tensor, document_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, valid), both bool [num_steps, T]: whether step j of the draft starting at p matched its target at
    p + j, and whether that target exists (inside the row, same document, in the loss mask)."""
    num_steps, total = len(draft_tokens), targets.shape[-1]
    targets, mask, docs = targets.reshape(total), loss_mask.reshape(total).bool(), document_ids.reshape(total)
    correct = torch.zeros(num_steps, total, dtype=torch.bool, device=targets.device)
    valid = torch.zeros_like(correct)
    for j, step in enumerate(draft_tokens):
        if j >= total:
            break
        end = total - j
        correct[j, :end] = step.reshape(total)[:end] == targets[j:]
        valid[j, :end] = mask[j:] & (docs[j:] == docs[:end]) & (docs[:end] >= 0)
    return correct, valid


def first_response_tokens(loss_mask: torch.Tensor, document_ids: torch.Tensor, max_tokens: int | None) -> torch.Tensor:
    """`loss_mask` kept on the first `max_tokens` masked (response) positions of each document of a packed row, as
    vLLM decodes at most `max_tokens` per request; None keeps the whole mask."""
    if max_tokens is None:
        return loss_mask
    mask, docs = loss_mask.reshape(-1).bool(), document_ids.reshape(-1)
    seen = torch.cumsum(mask.long(), 0)  # masked positions up to and including each position, over the whole row
    position = torch.arange(docs.numel(), device=docs.device)
    starts = torch.ones_like(mask)
    starts[1:] = docs[1:] != docs[:-1]
    doc_start = torch.cummax(torch.where(starts, position, torch.zeros_like(position)), 0).values
    before = torch.where(doc_start > 0, seen[(doc_start - 1).clamp(min=0)], torch.zeros_like(seen))
    return (mask & (seen - before <= max_tokens)).reshape(loss_mask.shape).to(loss_mask.dtype)


def replay(correct: torch.Tensor, valid: torch.Tensor, k: int, document_ids: torch.Tensor) -> dict[str, float]:
    """Walk vLLM's chain with drafts of `k` tokens over one packed row, each document (request) from its start;
    returns the counts (sums, reducible across ranks): `drafts`, `accepted`, `accepted_{j}` per draft position j."""
    assert k <= correct.shape[0], f"k={k} needs {k} draft steps, the predictions have {correct.shape[0]}"
    ok = (correct[:k] & valid[:k]).tolist()  # ok[j][p]: step j of the draft starting at p is accepted
    starts, docs = valid[0].tolist(), document_ids.reshape(-1).tolist()
    counts = {"drafts": 0.0, "accepted": 0.0, **{f"accepted_{j}": 0.0 for j in range(k)}}
    p = 0
    while p < len(starts):
        if not starts[p]:  # prompt, another turn's user text, padding: no draft starts here
            p += 1
            continue
        num_accepted = 0
        while num_accepted < k and ok[num_accepted][p]:
            counts[f"accepted_{num_accepted}"] += 1
            num_accepted += 1
        counts["drafts"] += 1
        counts["accepted"] += num_accepted
        doc, p = docs[p], p + 1
        for _ in range(num_accepted):  # jump past the accepted tokens, never into the next document
            if p < len(docs) and docs[p] == doc:
                p += 1
    return counts


def replay_counts(
    draft_tokens: list[torch.Tensor],
    targets: torch.Tensor,
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    ks: list[int],
    max_tokens: int | None = None,
) -> dict[str, float]:
    """`replay` of one batch for every k, keyed `replay_k{k}_{count}` for `MetricSums`-style summing, over the first
    `max_tokens` response tokens of each document (`first_response_tokens`)."""
    loss_mask = first_response_tokens(loss_mask, document_ids, max_tokens)
    correct, valid = step_matches(draft_tokens, targets, loss_mask, document_ids)
    return {f"replay_k{k}_{name}": value for k in ks for name, value in replay(correct, valid, k, document_ids).items()}


def batch_replay_counts(
    model,
    draft_tokens: list[torch.Tensor],
    batch: dict[str, torch.Tensor],
    ks: list[int],
    max_tokens: int | None = None,
) -> dict[str, float]:
    """`replay_counts` of one speculators batch (`input_ids`, `verifier_last_hidden_states`, `loss_mask`,
    `document_ids`) and the draft tokens the model returned for it; call it under the forward's autocast."""
    targets = target_ids(model, batch["verifier_last_hidden_states"], batch["input_ids"], batch["document_ids"])
    return replay_counts(draft_tokens, targets, batch["loss_mask"], batch["document_ids"], ks, max_tokens)


def summarize(
    sums: dict[str, float], ks: list[int], prefix: str = "val_", max_tokens: int | None = None
) -> dict[str, float]:
    """Summed `replay_counts` -> mean acceptance length and per-position acceptance per k (vLLM's definitions:
    1 + accepted / drafts and accepted at position j / drafts), and the response tokens the replay covered
    (`max_tokens`, as `<prefix>replay_max_tokens`): evaluate compares the estimate only with a decode of as many."""
    out = {} if max_tokens is None else {f"{prefix}replay_max_tokens": float(max_tokens)}
    for k in ks:
        drafts = max(sums[f"replay_k{k}_drafts"], 1.0)
        out[f"{prefix}replay_acceptance_length_k{k}"] = 1.0 + sums[f"replay_k{k}_accepted"] / drafts
        for j in range(k):
            out[f"{prefix}replay_acc_k{k}_{j}"] = sums[f"replay_k{k}_accepted_{j}"] / drafts
    out[f"{prefix}replay_acceptance_length"] = out[f"{prefix}replay_acceptance_length_k{max(ks)}"]
    return out


DIAG_SHIFTS = (-1, 0, 1, 2)


def _shift_name(s: int) -> str:
    return f"m{-s}" if s < 0 else str(s)


def target_diagnostics(
    model,
    draft_tokens: list[torch.Tensor],
    batch: dict[str, torch.Tensor],
    ks: list[int],
    max_tokens: int | None = None,
) -> dict[str, float]:
    """Summable counts that tell, from one validation run, why the replay and the teacher-forced accuracy disagree;
    call it under the forward's autocast, like `target_ids`. `target_ids` keeps a target only where the verifier's
    choice (restricted argmax, mapped by d2t) is the row's next token; everything here probes that assumption
    (positions t: loss-masked, inside a document):

    - `diag_agree_{s}` / `diag_positions_{s}`: the choice at t equals the row's token at t + 1 + s (same document).
      s = 0 is the replay's assumption (about 0.97+ on greedy data); a peak at s != 0 means hidden-state rows and
      token ids are offset by s; low everywhere means the rows are not the verifier's greedy output or the head /
      norm here is not the one that generated them.
    - `diag_outside_vocab`: the row's next token is outside the draft vocabulary (t2d), over `diag_positions_0`.
    - `diag_fp32_agree`: the restricted argmax under the autocast equals the float32 one, over `diag_positions_0`.
    - `diag_nomask_replay_k{k}_*`: the replay (over the same first `max_tokens` response tokens) against the
      restricted argmax with no next-token check (what speculators' acc_k scores against); `diagnostics_summary`
      turns it into an acceptance length."""
    hidden, input_ids = batch["verifier_last_hidden_states"], batch["input_ids"]
    mask, docs = batch["loss_mask"].reshape(-1).bool(), batch["document_ids"].reshape(-1)
    restricted = model.verifier_lm_head(model.verifier_norm(hidden)).argmax(dim=-1)
    with torch.autocast(hidden.device.type, enabled=False):
        restricted32 = model.verifier_lm_head(model.verifier_norm(hidden.float())).argmax(dim=-1)
    as_target = draft_to_target(model, restricted).reshape(-1)
    ids, total = input_ids.reshape(-1), input_ids.numel()
    out: dict[str, float] = {}
    for s in DIAG_SHIFTS:
        lo, hi = max(0, -(1 + s)), total - max(0, 1 + s)  # t with t + 1 + s inside the row
        t = torch.arange(lo, hi, device=ids.device)
        ok = mask[t] & (docs[t] >= 0) & (docs[t + 1 + s] == docs[t])
        out[f"diag_positions_{_shift_name(s)}"] = float(ok.sum())
        out[f"diag_agree_{_shift_name(s)}"] = float((ok & (as_target[t] == ids[t + 1 + s])).sum())
    t = torch.arange(0, total - 1, device=ids.device)
    ok = mask[t] & (docs[t] >= 0) & (docs[t + 1] == docs[t])
    outside = torch.zeros_like(ok) if model.t2d is None else ~model.t2d.bool()[ids[t + 1]]
    out["diag_outside_vocab"] = float((ok & outside).sum())
    out["diag_fp32_agree"] = float((ok & (restricted.reshape(-1)[t] == restricted32.reshape(-1)[t])).sum())
    nomask = replay_counts(draft_tokens, restricted, batch["loss_mask"], batch["document_ids"], ks, max_tokens)
    out.update({f"diag_nomask_{k}": v for k, v in nomask.items()})
    return out


def diagnostics_summary(sums: dict[str, float], ks: list[int], prefix: str = "val_") -> dict[str, float]:
    """Summed `target_diagnostics` counts -> shares and the unmasked replay's acceptance length per k."""
    positions = max(sums["diag_positions_0"], 1.0)
    out = {
        f"{prefix}diag_agree_{_shift_name(s)}": sums[f"diag_agree_{_shift_name(s)}"]
        / max(sums[f"diag_positions_{_shift_name(s)}"], 1.0)
        for s in DIAG_SHIFTS
    }
    out[f"{prefix}diag_outside_vocab"] = sums["diag_outside_vocab"] / positions
    out[f"{prefix}diag_fp32_agree"] = sums["diag_fp32_agree"] / positions
    nomask = summarize({k[len("diag_nomask_") :]: v for k, v in sums.items() if k.startswith("diag_nomask_")}, ks, "")
    out.update({f"{prefix}diag_nomask_{k}": v for k, v in nomask.items() if k.startswith("replay_acc")})
    return out
