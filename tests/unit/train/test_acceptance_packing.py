"""The replay estimate over packed validation batches (pure torch: no Ray, no vLLM, no verifier dir).

On the H200 the replay read 1.08-1.15 against vLLM's 1.62 while acc_0 was 0.53. Packing, flex attention, compile
and bf16 all reproduced the CPU estimate on CPU (see the report of 2026-12-05); what the replay alone depends on is
its assumption that the row's next token is the verifier's own choice (`target_ids`). These tests pin that packing
changes nothing, and that `target_diagnostics` tells an offset between hidden-state rows and tokens, or rows that
are not the verifier's greedy output, apart from a drafter that is simply wrong.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eagle3_ray.train import acceptance, data

pytestmark = pytest.mark.unit

NUM_DRAFT, STRIDE, HIDDEN = 16, 3, 16  # draft id i is target id 3 * i; target ids 1, 2, 4, ... are outside it
VOCAB = STRIDE * NUM_DRAFT + 2


def verifier_head() -> SimpleNamespace:
    """A verifier whose last hidden state is the one-hot of its (draft-vocab) choice: argmax = that draft id."""
    head = torch.nn.Linear(HIDDEN, NUM_DRAFT, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(NUM_DRAFT, HIDDEN))
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.arange(NUM_DRAFT) * STRIDE] = True
    d2t = torch.arange(NUM_DRAFT) * (STRIDE - 1)  # offsets: i + d2t[i] = 3 * i
    return SimpleNamespace(verifier_lm_head=head, verifier_norm=torch.nn.Identity(), d2t=d2t, t2d=t2d)


def greedy_sample(seed: int, length: int, prompt: int = 4, offset: int = 0) -> dict[str, torch.Tensor]:
    """A sample in ShardDataset's layout whose response tokens are the verifier's greedy choices: the state at
    position i chooses token i + 1. `offset` = s stores the state of position i + s in row i (a capture offset)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, NUM_DRAFT, (length + 2,), generator=g) * STRIDE  # draftable target ids
    choice = torch.zeros(length + 2, dtype=torch.long)
    choice[:-1] = tokens[1:] // STRIDE  # draft id of the next token
    rows = torch.arange(length) + offset
    last = torch.nn.functional.one_hot(choice[rows.clamp(max=length + 1)], HIDDEN).float()
    mask = torch.zeros(length, dtype=torch.long)
    mask[prompt:] = 1
    return {
        "hidden_states": torch.zeros(length, 3 * HIDDEN),
        "input_ids": tokens[:length],
        "verifier_last_hidden_states": last,
        "loss_mask": mask,
        "lengths": torch.tensor([length]),
        "position_ids": torch.arange(length),
    }


def drafts_for(model, batch: dict[str, torch.Tensor], num_steps: int = 3) -> list[torch.Tensor]:
    """A drafter right on a fixed pattern of (position in its document, step), the same whatever the packing:
    step j at p says the verifier's draft-vocab choice at p + j when it is right, draft id 0 (never chosen) else."""
    restricted = model.verifier_lm_head(model.verifier_norm(batch["verifier_last_hidden_states"])).argmax(-1)[0]
    docs = batch["document_ids"][0]
    starts = torch.zeros_like(docs)
    for p in range(1, docs.numel()):
        starts[p] = starts[p - 1] if docs[p] == docs[p - 1] else p
    local = torch.arange(docs.numel()) - starts
    out = []
    for j in range(num_steps):
        step = torch.zeros_like(restricted)
        step[: restricted.numel() - j] = restricted[j:]
        right = (local * 7 + j * 3) % 5 < 3
        out.append(torch.where(right, step, torch.zeros_like(step))[None])
    return out


def replay_over(model, samples: list[dict], total_seq_len: int | None, ks=(1, 3)) -> dict[str, float]:
    """Summed replay counts with the samples packed `total_seq_len` at a time (None: one sample per batch)."""
    groups = [[s] for s in samples] if total_seq_len is None else [samples]
    sums: dict[str, float] = {}
    for group in groups:
        length = total_seq_len or int(group[0]["lengths"][0]) - 1
        batch = data.PackedCollate(length, HIDDEN, 3, torch.float32)(group)
        batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        for k, v in acceptance.batch_replay_counts(model, drafts_for(model, batch), batch, list(ks)).items():
            sums[k] = sums.get(k, 0.0) + v
    return sums


def test_packing_many_samples_into_a_long_row_gives_the_replay_of_one_sample_per_batch():
    model = verifier_head()
    samples = [greedy_sample(seed, length) for seed, length in enumerate([37, 64, 21, 90, 55, 48, 70, 33])]
    alone = replay_over(model, samples, None)
    assert alone["replay_k3_drafts"] > 50 and 0 < alone["replay_k3_accepted"] < 3 * alone["replay_k3_drafts"]
    for total_seq_len in (512, 8192):  # the last with nearly 8k padding positions, as on the H200
        assert replay_over(model, samples, total_seq_len) == alone


def diagnostics(model, samples: list[dict], ks=(3,)) -> dict[str, float]:
    batch = data.PackedCollate(8192, HIDDEN, 3, torch.float32)(samples)
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    draft = drafts_for(model, batch)
    counts = {
        **acceptance.batch_replay_counts(model, draft, batch, list(ks)),
        **acceptance.target_diagnostics(model, draft, batch, list(ks)),
    }
    return {**acceptance.summarize(counts, list(ks)), **acceptance.diagnostics_summary(counts, list(ks))}


def test_diagnostics_on_greedy_rows_agree_with_the_replay():
    got = diagnostics(verifier_head(), [greedy_sample(seed, 80) for seed in range(6)])
    assert got["val_diag_agree_0"] == 1.0 and got["val_diag_outside_vocab"] == 0.0 and got["val_diag_fp32_agree"] == 1.0
    assert got["val_diag_nomask_replay_acceptance_length_k3"] == got["val_replay_acceptance_length_k3"] > 1.5


def test_diagnostics_name_a_capture_offset_that_only_the_replay_sees():
    """Hidden-state rows one position ahead of the tokens: the drafter still matches its (shifted) targets, so
    acc_k and the unmasked replay stay where they were, but the row's next token is no longer the target: the
    replay collapses (the H200 signature) and `diag_agree_1`, not `diag_agree_0`, is 1."""
    model = verifier_head()
    good = diagnostics(model, [greedy_sample(seed, 80) for seed in range(6)])
    shifted = diagnostics(model, [greedy_sample(seed, 80, offset=1) for seed in range(6)])
    assert shifted["val_diag_agree_1"] == 1.0 and shifted["val_diag_agree_0"] < 0.2
    assert shifted["val_diag_nomask_replay_acceptance_length_k3"] == pytest.approx(
        good["val_diag_nomask_replay_acceptance_length_k3"], abs=0.05
    )
    assert shifted["val_replay_acceptance_length_k3"] < 1.2 < good["val_replay_acceptance_length_k3"]


def test_diagnostics_count_next_tokens_outside_the_draft_vocab():
    sample = greedy_sample(0, 40)
    sample["input_ids"][10:20] = 1  # not draftable (1 is not a multiple of 3)
    got = diagnostics(verifier_head(), [sample])
    # after the shift, positions 8..17 have an undraftable next token, of the 35 masked ones with a next token
    assert got["val_diag_outside_vocab"] == pytest.approx(10 / 35)


def test_a_drafter_over_the_whole_verifier_vocab_has_no_d2t_and_still_replays():
    """speculators registers d2t / t2d as None when draft_vocab_size equals the verifier's vocabulary."""
    model = verifier_head()
    full = SimpleNamespace(**{**vars(model), "d2t": None, "t2d": None})
    samples = [greedy_sample(seed, 50) for seed in range(3)]
    for s in samples:
        s["input_ids"] = s["input_ids"] // STRIDE  # verifier ids are the draft ids now
    assert replay_over(full, samples, 512)["replay_k3_drafts"] > 0
    assert diagnostics(full, samples)["val_diag_agree_0"] == 1.0
