"""A vLLM scheduler for capture engines that never schedules draft tokens (`generate.capture_method=
extract_hidden_states`).

vLLM's `extract_hidden_states` method caches the verifier's aux hidden states of every token a step computes, and
then returns each request's sampled token as a one-token "draft": the next decode step computes two tokens per
request and verifies the dummy one with the rejection sampler. Ignoring those drafts here (vLLM's `scheduler_cls`)
makes every decode step compute one token per request, the sampled one, whose hidden states the method still caches
on the next step: the same capture at the cost of plain decoding. Needs synchronous scheduling (the stage sets it for
capture engines): async scheduling reserves draft slots before the drafts exist.
"""

from __future__ import annotations

from eagle3_ray.core.vllm_support import Scheduler


class NoDraftScheduler(Scheduler):
    """vLLM's scheduler with the proposer's draft tokens dropped."""

    def update_draft_token_ids(self, draft_token_ids) -> None:
        return None
