"""The replay of vLLM's draft/verify chain over hand-made drafter predictions (pure torch, no Ray, no vLLM)."""

from __future__ import annotations

import pytest
import torch

from eagle3_ray.train import acceptance

pytestmark = pytest.mark.unit


def perfect_drafts(targets: list[int], num_steps: int) -> list[torch.Tensor]:
    """Step j at position p predicts target p + j (what a perfect drafter says); 0 past the row's end."""
    return [torch.tensor([[*targets[j:], *[0] * j]]) for j in range(num_steps)]


def row(values: list[int]) -> torch.Tensor:
    return torch.tensor([values])


def counts(draft_tokens, targets, mask, docs, k):
    correct, valid = acceptance.step_matches(draft_tokens, row(targets), row(mask), row(docs))
    return acceptance.replay(correct, valid, k, row(docs))


def test_a_perfect_drafter_accepts_every_draft_token_and_the_chain_jumps_k_plus_one_positions():
    targets = [5, 6, 7, 8, 9, 10, 11, 12]
    got = counts(perfect_drafts(targets, 3), targets, [1] * 8, [0] * 8, 3)
    # drafts start at 0 and 4; the second one's steps land on 4, 5, 6: both accept all three
    assert got == {"drafts": 2, "accepted": 6, "accepted_0": 2, "accepted_1": 2, "accepted_2": 2}


def test_draft_starts_follow_the_chain_not_every_position():
    targets = [1, 2, 3, 4, 5, 6]
    step0 = [1, 0, 3, 0, 5, 0]  # right at even positions only: per-position accuracy 0.5
    even = counts([row(step0)], targets, [1] * 6, [0] * 6, 1)
    assert (even["drafts"], even["accepted"]) == (3, 3)  # starts 0, 2, 4 all land on a right guess: length 2.0
    odd = counts([row([0, 2, 0, 4, 0, 6])], targets, [1] * 6, [0] * 6, 1)
    assert (odd["drafts"], odd["accepted"]) == (4, 3)  # starts 0 (miss), 1, 3, 5: length 1.75


def test_a_later_step_that_matches_after_a_miss_is_not_accepted():
    targets = [1, 2, 3, 4]
    drafts = perfect_drafts(targets, 3)
    drafts[0][0, 0] = 99  # step 0 of the draft starting at 0 misses; its steps 1 and 2 are still right
    got = counts(drafts, targets, [1] * 4, [0] * 4, 3)
    # start 0: 0 accepted although steps 1 and 2 match; start 1: targets 1, 2, 3 accepted
    assert got == {"drafts": 2, "accepted": 3, "accepted_0": 1, "accepted_1": 1, "accepted_2": 1}


def test_drafts_start_at_the_first_masked_position_and_restart_after_an_unmasked_turn():
    targets = list(range(10, 22))
    mask = [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]  # prompt, response, user turn, response
    got = counts(perfect_drafts(targets, 2), targets, mask, [0] * 12, 2)
    # start 2: steps at 2, 3 accepted; start 5 is masked (skip to 8): steps at 8, 9; start 11: step 11, row ends
    assert got == {"drafts": 3, "accepted": 5, "accepted_0": 3, "accepted_1": 2}


def test_a_draft_stops_at_its_documents_end_and_the_next_document_starts_fresh():
    targets = [1, 2, 3, 4, 5, 6, 7]
    docs = [0, 0, 0, 1, 1, 1, -1]  # two packed samples and one padding position
    got = counts(perfect_drafts(targets, 3), targets, [1] * 7, docs, 3)
    # doc 0: start 0 accepts 3 (positions 0..2); doc 1: start 3 accepts 3 (3..5); padding never starts a draft
    assert got == {"drafts": 2, "accepted": 6, "accepted_0": 2, "accepted_1": 2, "accepted_2": 2}
    cut = counts(perfect_drafts(targets, 3), targets, [1] * 7, [0, 0, 1, 1, 1, 1, -1], 3)
    assert cut["accepted_2"] == 1  # the draft at 0 ends with its document after 2 tokens


def test_the_replay_covers_the_first_max_tokens_response_tokens_of_each_document_as_vllm_decodes_them():
    # two packed documents, each a 2-token prompt and a 5-token response; the drafter is right only late in a response
    docs = [0] * 7 + [1] * 7
    mask = [0, 0, 1, 1, 1, 1, 1] * 2
    bounded = acceptance.first_response_tokens(row(mask), row(docs), 3)
    assert bounded.tolist() == [[0, 0, 1, 1, 1, 0, 0] * 2] and bounded.dtype == row(mask).dtype
    assert torch.equal(acceptance.first_response_tokens(row(mask), row(docs), None), row(mask))
    targets = list(range(100, 114))
    step0 = [t if i % 7 >= 5 else 0 for i, t in enumerate(targets)]  # right at response tokens 4 and 5 only
    whole = acceptance.replay_counts([row(step0)], row(targets), row(mask), row(docs), [1])
    first3 = acceptance.replay_counts([row(step0)], row(targets), row(mask), row(docs), [1], max_tokens=3)
    # over whole responses: starts 2, 3, 4, 5 (accepted, jumps past 6) per document; over the first 3: 2, 3, 4, no hit
    assert (whole["replay_k1_drafts"], whole["replay_k1_accepted"]) == (8, 2)
    assert (first3["replay_k1_drafts"], first3["replay_k1_accepted"]) == (6, 0)


def test_summary_uses_vllms_definitions_and_names_the_largest_k():
    sums = {
        "replay_k1_drafts": 4.0,
        "replay_k1_accepted": 3.0,
        "replay_k1_accepted_0": 3.0,
        "replay_k3_drafts": 2.0,
        "replay_k3_accepted": 3.0,
        "replay_k3_accepted_0": 2.0,
        "replay_k3_accepted_1": 1.0,
        "replay_k3_accepted_2": 0.0,
    }
    got = acceptance.summarize(sums, [1, 3])
    assert got["val_replay_acceptance_length_k1"] == 1.75 and got["val_replay_acc_k1_0"] == 0.75
    assert got["val_replay_acceptance_length_k3"] == 2.5
    assert [got[f"val_replay_acc_k3_{j}"] for j in range(3)] == [1.0, 0.5, 0.0]
    assert got["val_replay_acceptance_length"] == 2.5
    assert "val_replay_max_tokens" not in got  # no window given: the whole responses
    assert acceptance.summarize(sums, [1, 3], max_tokens=64)["val_replay_max_tokens"] == 64


def test_replay_counts_sum_over_batches_like_the_training_metrics():
    targets = [1, 2, 3, 4, 5, 6, 7, 8]
    batch = acceptance.replay_counts(perfect_drafts(targets, 3), row(targets), row([1] * 8), row([0] * 8), [1, 3])
    assert batch["replay_k1_drafts"] == 4 and batch["replay_k1_accepted"] == 4
    assert batch["replay_k3_drafts"] == 2 and batch["replay_k3_accepted"] == 6


@pytest.mark.parametrize("ks, ttt_steps, expected", [([3], 3, [3]), ([1, 3, 5], 3, [1, 3]), ([4, 2], 2, [2])])
def test_draft_lengths_beyond_the_trained_steps_are_replayed_at_ttt_steps(ks, ttt_steps, expected):
    assert acceptance.replay_lengths(ks, ttt_steps) == expected


def test_a_verifier_choice_outside_the_draft_vocab_can_never_be_matched():
    from types import SimpleNamespace

    # draft vocab = target ids [10, 20, 30] (d2t offsets); the head's draft-vocab argmax is draft id 1 everywhere
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]))
    model = SimpleNamespace(
        verifier_lm_head=head, verifier_norm=torch.nn.Identity(), d2t=torch.tensor([10 - 0, 20 - 1, 30 - 2])
    )
    input_ids = row([5, 6, 20, 99, 7])  # the verifier said 20 after position 1, then 99 (not draftable), ...
    docs = row([0, 0, 0, 0, 1])
    targets = acceptance.target_ids(model, torch.ones(1, 5, 2), input_ids, docs)
    # position t's target is the token at t + 1: 6 (not 20: outside), 20 (ok), 99 (outside), doc end, row end
    assert targets.tolist() == [[-1, 1, -1, 1, 1]]
