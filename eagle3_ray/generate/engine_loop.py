"""Continuous batching for the engine actor: vLLM's async engine (`AsyncLLM`, what `vllm serve` and Ray's own
`ray.data.llm` drive) on an event loop of its own thread, fed the requests of every unit the actor holds at once.

    units (asyncio tasks of the actor) --submit--> RequestLoop thread: one `AsyncLLM.generate` task per request
        --> vLLM EngineCore (its own process): the scheduler batches whatever requests it holds, step by step
        finished output --> the conversation's handler (same thread): next turn submitted at once, or done

A request reaches the engine the moment its unit submits it, also while the engine runs a step: a loop around the
synchronous `LLMEngine.step()` could only add requests between steps, so units that arrived during a long prefill
step waited for it and the engine's next step ran without them. A unit's conversations advance independently: a
multi-turn conversation sends its next turn as soon as its previous answer is back, not when the whole unit's round
is. How many requests run together is the engine scheduler's business (max_num_seqs, KV cache); ByteBudget bounds the
captured bytes that wait for the writer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from eagle3_ray.core import telemetry

# handler(output) runs on the loop thread when a request finishes; it returns follow-up requests to add.
Handler = Callable[[Any], list[tuple[str, dict, Any, "Handler"]]]


def start_async_engine(kwargs: dict[str, Any]):
    """`vllm.AsyncLLM` from the keyword arguments `vllm.LLM` takes (engine.engine_kwargs), converted the way `LLM`
    converts them: a `kv_transfer_config` dict becomes vLLM's KVTransferConfig, per-step stat logging stays off
    unless asked for, and the defaults vLLM derives from the usage context are `LLM`'s (offline batch: e.g.
    max_num_batched_tokens 16384 on an H200, where the engine context would get 2048). Config dicts such as
    `compilation_config` are vLLM's EngineArgs' own business."""
    from vllm import AsyncEngineArgs

    from eagle3_ray.core.vllm_support import AsyncLLM, KVTransferConfig, UsageContext, quiet_engine_death_log

    quiet_engine_death_log()
    kwargs = {"disable_log_stats": True, **kwargs}
    if isinstance(kwargs.get("kv_transfer_config"), dict):
        kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])

    def build():
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), usage_context=UsageContext.LLM_CLASS)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return build()
    # AsyncLLM starts its output handler on the loop running where it is built, and RequestLoop drives it from a
    # loop of its own: outputs would never reach its requests. Ray runs a plain async actor's __init__ on the
    # actor's loop (a Ray Data actor's runs outside any loop), so build it on a thread where no loop runs.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-start") as pool:
        return pool.submit(build).result()


def process_exiting() -> bool:
    """The interpreter is shutting down (the actor exits: Python stops the main thread before it runs atexit
    handlers and finalisers, which may stop the engine before the actor's own close() does)."""
    return not threading.main_thread().is_alive()


def _teardown_line(reason: str, where: str, error: BaseException | None, detail: str = "") -> None:
    text = f"{type(error).__name__}: {error}" if error is not None else detail
    telemetry.log("generate", "teardown_error", pid=os.getpid(), reason=reason, where=where, error=text[:300])


def quiet_teardown_errors(reason: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """From now on this process is ending (the engine died, or the finished stage retires the actor): an error that
    vLLM's teardown raises in a thread of its own, in an object's finaliser or (with `loop`) in a task of that loop
    nobody awaits any more is one `teardown_error` line, not a traceback that reads like a crash. Before this, such
    errors keep Python's own report."""
    threading.excepthook = lambda a: _teardown_line(reason, f"thread {a.thread.name if a.thread else '?'}", a.exc_value)
    sys.unraisablehook = lambda u: _teardown_line(
        reason, f"finaliser {getattr(u.object, '__qualname__', u.object)!r}", u.exc_value
    )
    if loop is not None:  # one attribute the loop reads when a task's error goes unretrieved: set from any thread
        loop.set_exception_handler(
            lambda _, c: _teardown_line(reason, "asyncio", c.get("exception"), str(c.get("message")))
        )


class RequestLoop:
    """Owns an `AsyncLLM`: only this thread's event loop calls into it. `submit` is safe from any thread."""

    def __init__(self, engine: Any, on_death: Callable[[str], None]):
        self.engine = engine
        self.on_death = on_death  # told the error before the actor exits
        self.loop = asyncio.new_event_loop()
        self.tasks: set[asyncio.Task] = set()  # the event loop keeps only weak references to its tasks
        self.num_finished = 0
        self.retiring = threading.Event()  # set by close(): from then on the engine's end is not its death
        threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True).start()

    def close(self, timeout_s: float = 60.0) -> None:
        """Shut the engine down on purpose (the actor's process exits: Ray Data retires it when the stage is
        done). vLLM's output handler is cancelled before its EngineCore stops, so the end of a finished stage is
        not logged as the engine's death (an `EngineDeadError` traceback) and does not count as one."""
        if self.retiring.is_set():
            return
        self.retiring.set()
        quiet_teardown_errors("retired", self.loop)

        async def stop() -> None:
            handler = getattr(self.engine, "output_handler", None)
            if handler is not None:
                handler.cancel()
            self.engine.shutdown()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout_s)
        except Exception as e:  # the process is exiting either way: say so in one line, not a traceback
            telemetry.log("generate", "engine_shutdown_failed", pid=os.getpid(), error=f"{type(e).__name__}: {e}")

    def submit(self, requests: list[tuple[str, dict, Any, Handler]]) -> None:
        """requests: (request_id, prompt {"prompt_token_ids": [...]}, SamplingParams, handler)."""
        self.loop.call_soon_threadsafe(self._add, requests)

    def _add(self, requests: list[tuple[str, dict, Any, Handler]]) -> None:
        from eagle3_ray.core.vllm_support import RequestOutputKind

        for request_id, prompt, params, handler in requests:
            params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it finishes
            task = self.loop.create_task(self._run(request_id, prompt, params, handler))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _run(self, request_id: str, prompt: dict, params: Any, handler: Handler) -> None:
        final = None
        try:
            async for out in self.engine.generate(prompt, params, request_id):
                final = out
        except Exception as e:
            if self.retiring.is_set() or process_exiting():  # the engine stopped because the process is exiting
                return
            self._die(e)
        self.num_finished += 1
        self._add(handler(final))

    def _die(self, e: BaseException) -> None:
        """An engine that failed (or refused a request) cannot be trusted with the requests it holds. Exiting the
        actor process makes Ray restart it (Ray Data actors: max_restarts=-1, max_task_retries=-1) and retry its
        units, which have not committed (a unit commits only after all its requests finished)."""
        error = f"{type(e).__name__}: {e}"
        telemetry.log("generate", "engine_dead", pid=os.getpid(), error=error)
        quiet_teardown_errors("engine_dead", self.loop)
        self.on_death(error)
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
            telemetry.log(
                "generate",
                "backpressure",
                unit=what,
                waited_s=round(waited_s, 2),
                bytes_uncommitted=self.used - num_bytes,
                budget_bytes=self.max_bytes,
            )

    async def release(self, num_bytes: int) -> None:
        async with self.changed:
            self.used -= num_bytes
            self.changed.notify_all()
