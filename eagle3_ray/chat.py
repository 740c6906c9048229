"""Conversations -> engine requests -> token ids, loss masks and captured hidden states (used by the engine actor).

generate mode, one request per user turn, all samples of a unit batched per round:
    round r: prompt = chat_template(history + user turn r, generation prompt) -> the verifier answers -> history
    Only the last turn's capture is kept (include_output_tokens), and it already holds the whole conversation:
    capture costs no pass beyond the generation itself; earlier turns' captures are discarded. Stored tokens, with n = len(input_ids):
        input_ids  [p0 p1 ... p(m-1) | r0 r1 ... r(k-1)]      m prompt tokens (earlier turns inside), k response
        hidden     [h0 h1 ... h(m-1) | g0 ... g(k-2)]        T = n - 1: the last response token is never fed back
capture_only mode: one prefill request (max_tokens=1) over the templated conversation; T = n.
loss_mask is 1 on every assistant turn's tokens (content and its end-of-turn tokens), 0 elsewhere.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

import torch

from eagle3_ray.config import Config

Message = dict[str, str]


class ChatEncoder:
    """Chat template + tokenizer, with the reasoning switch passed only when the config sets it."""

    def __init__(self, tokenizer: Any, enable_thinking: bool | None):
        self.tokenizer = tokenizer
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    def encode(self, messages: list[Message], generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.template_kwargs)
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
        mask[start:min(end, num_tokens)] = [1] * (min(end, num_tokens) - start)
    return mask


def request_seed(run_seed: int, sample_id: str, turn: int) -> int:
    """Per-request sampling seed: a retried unit samples the same tokens."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{sample_id}:{turn}".encode()).digest()[:4], "little")


class TurnRunner:
    """Runs one unit's samples through the engine (`generate_fn(prompts, params) -> outputs`)."""

    def __init__(self, encoder: ChatEncoder, generate_fn: Callable, cfg: Config, scratch: str, unit_id: str):
        self.encoder, self.generate_fn, self.cfg = encoder, generate_fn, cfg
        self.dir = os.path.join(scratch, unit_id)
        self.unit_id = unit_id
        self.max_model_len = cfg.verifier.max_model_len

    def run(self, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        records = [self._record(s) for s in samples]
        if self.cfg.generate.mode == "capture_only":
            self._capture_only(records)
        else:
            self._regenerate(records)
        for r in records:
            if r["status"] == "ok":
                self._attach_capture(r)
        return records

    def _record(self, s: dict[str, Any]) -> dict[str, Any]:
        return {"id": s["id"], "unit_id": self.unit_id, "status": "ok", "messages": s["messages"],
                "source": s.get("source"), "_turns": user_turns(s["messages"]), "_history": []}

    def _params(self, r: dict[str, Any], turn: int, prompt_len: int, max_tokens: int):
        from vllm import SamplingParams

        gen = self.cfg.generate
        path = os.path.join(self.dir, f"{r['id']}-{turn}.safetensors")
        r["_path"] = path
        return SamplingParams(temperature=gen.temperature, top_p=gen.top_p, seed=request_seed(self.cfg.run.seed, r["id"], turn),
                              max_tokens=min(max_tokens, self.max_model_len - prompt_len),
                              extra_args={"kv_transfer_params": {"hidden_states_path": path,
                                                                 "include_output_tokens": gen.mode == "generate"}})

    def _fits(self, r: dict[str, Any], prompt: list[int]) -> bool:
        if len(prompt) < self.max_model_len:
            return True
        _reject(r, "context_too_long", f"{len(prompt)} prompt tokens >= verifier.max_model_len {self.max_model_len}")
        return False

    def _regenerate(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            if not r["_turns"]:
                _reject(r, "no_user_turn", "the conversation has no user message")
        turn = 0
        while active := [r for r in records if r["status"] == "ok" and turn < len(r["_turns"])]:
            prompts, params, batch = [], [], []
            for r in active:
                r["_history"] += r["_turns"][turn]
                prompt = self.encoder.encode(r["_history"], True)
                if self._fits(r, prompt):
                    last = turn == len(r["_turns"]) - 1
                    params.append(self._params(r, turn, len(prompt), self.cfg.generate.max_tokens))
                    prompts.append({"prompt_token_ids": prompt})
                    batch.append((r, prompt, last))
            for (r, prompt, last), out in zip(batch, self.generate_fn(prompts, params)):
                completion = out.outputs[0]
                r["_history"].append({"role": "assistant", "content": completion.text})
                if last:
                    self._finish_generated(r, prompt, list(completion.token_ids), completion.finish_reason)
                else:
                    discard_capture(r["_path"])
            turn += 1

    def _finish_generated(self, r: dict[str, Any], prompt: list[int], response: list[int], finish: str) -> None:
        input_ids = prompt + response
        spans = self.encoder.assistant_spans(r["_history"][:-1]) + [(len(prompt), len(input_ids))]
        r.update(messages=r["_history"], input_ids=input_ids, loss_mask=loss_mask(spans, len(input_ids)),
                 finish_reason=finish, _num_captured=len(input_ids) - 1)

    def _capture_only(self, records: list[dict[str, Any]]) -> None:
        prompts, params, batch = [], [], []
        for r in records:
            ids = self.encoder.encode(r["messages"], False)
            if self._fits(r, ids):
                r.update(input_ids=ids, loss_mask=loss_mask(self.encoder.assistant_spans(r["messages"]), len(ids)),
                         finish_reason="capture_only", _num_captured=len(ids))
                params.append(self._params(r, 0, len(ids), 1))
                prompts.append({"prompt_token_ids": ids})
                batch.append(r)
        self.generate_fn(prompts, params)

    def _attach_capture(self, r: dict[str, Any]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        data = load_hidden_states(r["_path"])  # waits on the writer's file lock
        cleanup_hidden_states(r["_path"])
        hidden, token_ids = data["hidden_states"], data["token_ids"]  # shape: [T, num_layers, H], [T]
        expected = torch.tensor(r["input_ids"][: r["_num_captured"]])
        assert torch.equal(token_ids.cpu().long(), expected), f"{r['id']}: captured tokens differ from input_ids"
        num_response = sum(r["loss_mask"])
        r.update(_hidden_states=hidden, num_response_tokens=num_response,
                 num_prompt_tokens=len(r["input_ids"]) - num_response)
        for k in [k for k in r if k.startswith("_") and k != "_hidden_states"]:
            del r[k]


def discard_capture(path: str) -> None:
    """Delete an earlier turn's capture once its writer is done: only the final turn's conversation is stored."""
    import fcntl

    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import cleanup_hidden_states

    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # sleeps until the writer releases its exclusive lock
    cleanup_hidden_states(path)


def _reject(r: dict[str, Any], reason: str, detail: str) -> None:
    r.update(status="rejected", reason=reason, detail=detail)
    for k in [k for k in r if k.startswith("_")]:
        del r[k]
