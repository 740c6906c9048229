"""Continuous batching for the engine actor: one thread drives vLLM's `LLMEngine` (`add_request` / `step`, the
loop `LLM.generate` runs inside, in vLLM 0.24 and 0.32 alike) for every unit the actor holds at once.

    units (asyncio tasks of the actor) --submit--> RequestLoop thread --add_request/step--> vLLM EngineCore
        finished output --> the conversation's handler (same thread): next turn submitted at once, or done

A unit's conversations advance independently: a multi-turn conversation sends its next turn as soon as its previous
answer is back, not when the whole unit's round is. How many requests run together is the engine scheduler's
business (max_num_seqs, KV cache); ByteBudget bounds the captured bytes that wait for the writer.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from typing import Any, Callable

from eagle3_ray import telemetry

# handler(output) runs on the loop thread when a request finishes; it returns follow-up requests to add.
Handler = Callable[[Any], list[tuple[str, dict, Any, "Handler"]]]


class RequestLoop:
    """Owns `llm_engine`: only this thread calls into it. `submit` is safe from any thread."""

    def __init__(self, llm_engine: Any):
        self.engine = llm_engine
        self.inbox: queue.Queue = queue.Queue()
        self.handlers: dict[str, Handler] = {}
        self.num_steps = 0
        threading.Thread(target=self._run, name="engine-loop", daemon=True).start()

    def submit(self, requests: list[tuple[str, dict, Any, Handler]]) -> None:
        """requests: (request_id, prompt {"prompt_token_ids": [...]}, SamplingParams, handler)."""
        self.inbox.put(requests)

    def _run(self) -> None:
        while True:
            self._admit(block=not self.handlers)
            try:
                outputs = self.engine.step()
            except Exception as e:
                self._die(e)
            self.num_steps += 1
            for out in outputs:
                if out.finished:
                    self._add(self.handlers.pop(out.request_id)(out))

    def _admit(self, block: bool) -> None:
        """Add what units submitted; with nothing running, sleep until something arrives."""
        try:
            self._add(self.inbox.get(block=block))
            while True:
                self._add(self.inbox.get_nowait())
        except queue.Empty:
            pass

    def _add(self, requests: list[tuple[str, dict, Any, Handler]]) -> None:
        from vllm.sampling_params import RequestOutputKind

        for request_id, prompt, params, handler in requests:
            params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it finishes
            self.handlers[request_id] = handler
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception as e:
                self._die(e)

    def _die(self, e: BaseException) -> None:
        """An engine that failed mid-step cannot be trusted with the requests it holds. Exiting the actor process
        makes Ray restart it (Ray Data actors: max_restarts=-1, max_task_retries=-1) and retry its units, which
        have not committed (a unit commits only after all its requests finished)."""
        telemetry.log("generate", "engine_dead", pid=os.getpid(), error=f"{type(e).__name__}: {e}")
        os._exit(1)


class ByteBudget:
    """Captured bytes a replica holds before they are committed (scratch files + the writer's queue). `acquire`
    waits while the budget is spent; a request larger than the whole budget is let in alone. Used from the actor's
    event loop only."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.used = max_bytes, 0
        self.changed = asyncio.Condition()

    async def acquire(self, num_bytes: int, what: str) -> None:
        start = time.monotonic()
        async with self.changed:
            await self.changed.wait_for(lambda: self.used == 0 or self.used + num_bytes <= self.max_bytes)
            self.used += num_bytes
        waited_s = time.monotonic() - start
        if waited_s > 0.5:
            telemetry.log("generate", "backpressure", unit=what, waited_s=round(waited_s, 2),
                          bytes_uncommitted=self.used - num_bytes, budget_bytes=self.max_bytes)

    async def release(self, num_bytes: int) -> None:
        async with self.changed:
            self.used -= num_bytes
            self.changed.notify_all()
