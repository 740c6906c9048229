"""Conversations -> engine requests -> token ids, loss masks and captured hidden states (used by the engine actor).

generate mode, one request per user turn; each conversation advances on its own (engine_loop.py):
    turn r: prompt = chat_template(history + user turn r, generation prompt) -> the verifier answers -> history
    Only the last turn's capture is kept (include_output_tokens), and it already holds the whole conversation:
    capture costs no pass beyond the generation itself; earlier turns' captures are discarded. Stored tokens, with
    n = len(input_ids):
        input_ids  [p0 p1 ... p(m-1) | r0 r1 ... r(k-1)]      m prompt tokens (earlier turns inside), k response
        hidden     [h0 h1 ... h(m-1) | g0 ... g(k-2)]        T = n - 1: the last response token is never fed back
two_pass mode: the same turns on a plain engine ("plain", nothing captured), then one prefill of input_ids[:-1]
    (max_tokens=1): the same input_ids, loss_mask and T = n - 1 as generate mode, without capture during decode.
capture_only mode: one prefill request (max_tokens=1) over the templated conversation; T = n. The planner tokenizes
    it already (plan.with_prefill_ids: the count is the unit plan's cost), so the engine actor sends those ids on
    at once, and the loss mask (two more template passes per assistant turn) is left to the writer thread
    (Conversation.complete_record), off the engine's path.
loss_mask is 1 on every assistant turn's tokens (content and its end-of-turn tokens), 0 elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

import torch

from eagle3_ray.core import sample_ids, shards
from eagle3_ray.core.config import Config

Message = dict[str, str]


class ChatEncoder:
    """Chat template + tokenizer, with the reasoning switch passed only when the config sets it."""

    def __init__(self, tokenizer: Any, enable_thinking: bool | None):
        self.tokenizer = tokenizer
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        # the engine loop and the writer threads (capture_only's loss masks) share it; a fast tokenizer used from
        # two threads at once can fail ("Already borrowed"), and templating holds the GIL anyway
        self.lock = threading.Lock()

    def encode(self, messages: list[Message], generation_prompt: bool) -> list[int]:
        with self.lock:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
            )
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def assistant_spans(self, messages: list[Message]) -> list[tuple[int, int]]:
        """[start, end) token ranges of each assistant message of a templated conversation."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                spans.append((len(self.encode(messages[:i], True)), len(self.encode(messages[: i + 1], False))))
        return spans


def user_turns(messages: list[Message]) -> list[list[Message]]:
    """The messages to add before each response: assistant messages are dropped (they get regenerated)."""
    turns, current = [], []
    for m in messages:
        if m["role"] == "assistant":
            if any(x["role"] == "user" for x in current):
                turns.append(current)
                current = []
        else:
            current.append(m)
    if any(x["role"] == "user" for x in current):
        turns.append(current)
    return turns


def loss_mask(spans: list[tuple[int, int]], num_tokens: int) -> list[int]:
    mask = [0] * num_tokens
    for start, end in spans:
        mask[start : min(end, num_tokens)] = [1] * (min(end, num_tokens) - start)
    return mask


def request_seed(run_seed: int, sample_id: str, turn: int) -> int:
    """Per-request sampling seed: a retried unit samples the same tokens."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{sample_id}:{turn}".encode()).digest()[:4], "little")


class Conversation:
    """One sample on its way through the engine: the request of each turn, then the record it commits as.

    `kind`: "generate" (regenerate, capture the final turn with include_output_tokens), "plain" (regenerate without
    capture: two_pass's first pass), "prefill" (capture one templated conversation, or given `input_ids`: two_pass's
    second pass, which prefills input_ids[:-1] so that T = len(input_ids) - 1 as in generate mode).
    `start()` and `on_output(out)` return the next request (request_id, prompt, SamplingParams) or None when done;
    `discarded` collects earlier turns' capture files for the writer to delete."""

    def __init__(
        self, sample: dict[str, Any], encoder: ChatEncoder, cfg: Config, scratch: str, unit_id: str, kind: str
    ):
        self.encoder, self.cfg, self.kind, self.unit_id = encoder, cfg, kind, unit_id
        self.dir = os.path.join(scratch, unit_id)
        self.max_model_len = cfg.verifier.max_model_len
        self.record: dict[str, Any] = {
            "id": sample["id"],
            "unit_id": unit_id,
            "status": "ok",
            "messages": sample["messages"],
            "source": sample.get("source"),
        }
        self.sample, self.turns, self.history, self.turn = sample, user_turns(sample["messages"]), [], 0
        self.prompt: list[int] = []
        self.capture_path: str | None = None
        # the kv_transfer_params of its capture request: commit.ShardPlan adds a planned sample's place in its shard
        self.transfer_params: dict[str, Any] | None = None
        # what the request of the capture it stores (generate: the final turn's) adds to them: the unit's open shards
        # (commit.FinishOrderShards), set before the conversation starts
        self.capture_target: dict[str, Any] = {}
        self.discarded: list[str] = []
        # commit.CaptureWriter: the final capture read, as (stats, encoded) or the error reading it raised
        self.prepared: tuple | BaseException | None = None
        self.prepare_lock = threading.Lock()
        # (commit.ShardPlan, shard index) of a prefill unit's planned shards; (commit.FinishOrderShards, None) of a
        # generate unit's open shards
        self.shard: tuple | None = None
        self.timing: dict[str, float] = {}  # the writer's seconds on this capture (commit.CaptureWriter.TIMINGS)

    def start(self):
        if self.sample.get("status") == "rejected":  # two_pass: rejected by the first pass
            return _reject(self.record, self.sample["reason"], self.sample["detail"])
        if self.kind == "prefill":
            return self._prefill()
        if not self.turns:
            return _reject(self.record, "no_user_turn", "the conversation has no user message")
        return self._turn_request()

    def _turn_request(self):
        self.history += self.turns[self.turn]
        self.prompt = self.encoder.encode(self.history, True)
        if not self._fits(self.prompt):
            return None
        last = self.turn == len(self.turns) - 1
        capture = self.kind == "generate"
        return self._request(self.prompt, self.cfg.generate.max_tokens, capture, include_output=last)

    def on_output(self, out: Any):
        completion = out.outputs[0]
        self.history.append({"role": "assistant", "content": completion.text})
        if self.kind == "prefill":
            return None
        if self.capture_path and self.turn < len(self.turns) - 1:
            self.discarded.append(self.capture_path)
        if self.turn == len(self.turns) - 1:
            self._finish_generated(list(completion.token_ids), completion.finish_reason)
            return None
        self.turn += 1
        return self._turn_request()

    def _finish_generated(self, response: list[int], finish: str) -> None:
        input_ids = self.prompt + response
        spans = self.encoder.assistant_spans(self.history[:-1]) + [(len(self.prompt), len(input_ids))]
        mask = loss_mask(spans, len(input_ids))
        self.record.update(
            messages=self.history,
            input_ids=input_ids,
            loss_mask=mask,
            finish_reason=finish,
            num_response_tokens=sum(mask),
            num_prompt_tokens=len(input_ids) - sum(mask),
        )
        self.record["_num_captured"] = len(input_ids) - 1

    def _prefill(self):
        r, s = self.record, self.sample
        if s.get("loss_mask") is not None:  # two_pass: exactly the tokens the first pass generated
            ids, mask, finish = s["input_ids"], s["loss_mask"], s["finish_reason"]
            prompt = ids[:-1]
        else:  # capture_only: the planner's ids when it sent them; the mask waits for complete_record
            ids = s["input_ids"] if s.get("input_ids") is not None else self.encoder.encode(r["messages"], False)
            prompt, mask, finish = ids, None, "capture_only"
        if not self._fits(prompt):
            return None
        r.update(input_ids=ids, loss_mask=mask, finish_reason=finish, _num_captured=len(prompt))
        return self._request(prompt, 1, capture=True, include_output=False)

    def complete_record(self) -> None:
        """A prefill record's token counts, and capture_only's loss mask first (two template passes per assistant
        turn): called by the writer thread before it reads the capture, so the engine's requests never wait for it.
        Idempotent; generate-mode records are complete already."""
        r = self.record
        if self.kind != "prefill" or r["status"] != "ok" or "num_prompt_tokens" in r:
            return
        if r["loss_mask"] is None:
            r["loss_mask"] = loss_mask(self.encoder.assistant_spans(r["messages"]), len(r["input_ids"]))
        num_response = sum(r["loss_mask"])
        r.update(num_response_tokens=num_response, num_prompt_tokens=len(r["input_ids"]) - num_response)

    def _request(self, prompt: list[int], max_tokens: int, capture: bool, include_output: bool):
        from vllm import SamplingParams

        gen = self.cfg.generate
        request_id = f"{self.unit_id}:{self.record['id']}:{self.turn}"
        extra = None
        if capture:
            self.capture_path = os.path.join(self.dir, f"{self.record['id']}-{self.turn}.safetensors")
            self.transfer_params = {"hidden_states_path": self.capture_path, "include_output_tokens": include_output}
            if include_output:  # generate's final turn: the capture that is stored
                self.transfer_params.update(self.capture_target)
            extra = {"kv_transfer_params": self.transfer_params}
        greedy = sample_ids.is_greedy_response(self.record["id"], gen.temperature, gen.responses_per_prompt)
        params = SamplingParams(
            temperature=0.0 if greedy else gen.temperature,
            top_p=gen.top_p,
            seed=request_seed(self.cfg.run.seed, self.record["id"], self.turn),
            ignore_eos=gen.ignore_eos and max_tokens > 1,
            max_tokens=min(max_tokens, self.max_model_len - len(prompt)),
            extra_args=extra,
        )
        return request_id, {"prompt_token_ids": prompt}, params

    def _fits(self, prompt: list[int]) -> bool:
        if len(prompt) < self.max_model_len:
            return True
        _reject(
            self.record,
            "context_too_long",
            f"{len(prompt)} prompt tokens >= verifier.max_model_len {self.max_model_len}",
        )
        return False


def load_capture(record: dict[str, Any], path: str) -> dict[str, torch.Tensor]:
    """A finished request's capture file, its tokens checked against the record's: `hidden_states`
    [T, num_layers, H] and `token_ids` [T], or, for a sample vLLM's connector wrote into its planned shard, the
    note it left (`token_ids`, `norms` [T, num_layers], `nonfinite` [num_layers]: shard_writer.write_planned_capture).
    The file is deleted once read. The lock is free by now (wait_for_capture), so this only reads."""
    from eagle3_ray.core.vllm_support import cleanup_hidden_states

    if not os.path.exists(path):
        raise RuntimeError(
            f"generate: sample {record['id']}: vLLM's connector wrote no capture at {path} (the engine "
            "log says why: 'Hidden-states write failed')"
        )
    data = shards.read_safetensors(path)
    cleanup_hidden_states(path)
    expected = torch.tensor(record["input_ids"][: record.pop("_num_captured")])
    assert torch.equal(data["token_ids"].long(), expected), f"{record['id']}: captured tokens differ from input_ids"
    return data


def wait_for_capture(path: str) -> None:
    """Sleep until vLLM's connector has written a request's capture file (it holds the file's lock while writing)."""
    import fcntl

    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # sleeps until the writer releases its exclusive lock


def discard_capture(path: str) -> None:
    """Delete an earlier turn's capture once its writer is done: only the final turn's conversation is stored."""
    from eagle3_ray.core.vllm_support import cleanup_hidden_states

    wait_for_capture(path)
    cleanup_hidden_states(path)


def _reject(r: dict[str, Any], reason: str, detail: str) -> None:
    r.update(status="rejected", reason=reason, detail=detail)
    for k in [k for k in r if k.startswith("_")]:
        del r[k]
    return None
