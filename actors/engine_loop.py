"""Drive one Engine from a background thread and hand results back as futures.

Why a thread: `Engine.step()` is a blocking torch call (one whole block cycle). Running
it off the actor's asyncio loop lets every batch in flight keep adding requests while a
cycle runs, so the engine's pending queue is refilled before it drains; each caller just
awaits the futures of its own rows.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import traceback
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

from engine.config import SamplingParams  # dataclasses only: no torch
from engine.sequence import FinishReason, RequestOutput

if TYPE_CHECKING:
    from engine import Engine

logger = logging.getLogger(__name__)

StepHook = Callable[["Engine", List[RequestOutput]], None]


def error_output(request_id: Any, prompt: Sequence[int], message: str) -> RequestOutput:
    """A RequestOutput for a request the engine never returned (it crashed or refused it)."""
    return RequestOutput(request_id=request_id, prompt_token_ids=list(prompt), token_ids=[],
                         finish_reason=FinishReason.ERROR, error=message)


class EngineLoop:
    """Owns the engine thread. `submit` is thread-safe and returns a Future that always
    resolves to a RequestOutput (never raises), so one bad row never fails a batch.

    A step that raises fails the requests in flight (error outputs) and a fresh engine
    takes over. Should building that engine raise too, the loop is `broken`: its thread
    ends, and the requests in flight and every later one resolve at once to an error
    output saying both, so that no caller waits for an engine that will never step."""

    def __init__(self, engine_factory: Callable[[], "Engine"], on_step: Optional[StepHook] = None,
                 idle_wait_s: float = 0.5):
        self._factory = engine_factory
        self.engine = engine_factory()
        self._on_step = on_step
        self._idle_wait_s = idle_wait_s
        self._futures: Dict[Any, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.broken: Optional[str] = None  # why no engine can run (see the class docstring)
        self._thread = threading.Thread(target=self._run, name="dllm-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams, request_id: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if request_id in self._futures:
                raise ValueError(f"duplicate request id {request_id!r}")
            if self.broken is not None:
                fut.set_result(error_output(request_id, prompt, self.broken))
                return fut
            self._futures[request_id] = fut
        self._hand_over(request_id, prompt, params)
        self._wake.set()
        return fut

    def _hand_over(self, request_id: Any, prompt: Sequence[int], params: SamplingParams) -> None:
        """Give a registered request to the engine (the tensor-parallel loop queues it for its
        next broadcast instead)."""
        try:
            self.engine.add_request(list(prompt), params, request_id=request_id)
        except Exception as e:  # noqa: BLE001 - the contract says it never raises; be safe anyway
            self._resolve(error_output(request_id, prompt, f"add_request failed: {type(e).__name__}: {e}"))

    def _resolve(self, out: RequestOutput) -> None:
        with self._lock:
            fut = self._futures.pop(out.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(out)

    def _run(self) -> None:
        while not self._stop.is_set() and self.broken is None:
            self._wake.clear()
            self._step(self.engine)

    def _step(self, engine: "Engine") -> None:
        """One pass of the engine thread, the same on one device and on rank 0 of a
        tensor-parallel engine (actors/tensor_parallel.LockstepLoop): wait while `engine` is
        idle, else step it, hand its outputs back and call the step hook; a step that
        raises goes to `_recover`."""
        if not engine.has_unfinished():
            self._wake.wait(self._idle_wait_s)
            return
        try:
            outs = engine.step()
        except Exception as e:  # noqa: BLE001 - fail the rows in flight, keep serving
            self._recover(e)
            return
        for out in outs:
            self._resolve(out)
        if self._on_step is not None:
            try:
                self._on_step(engine, outs)
            except Exception:  # noqa: BLE001 - metrics must never stop generation
                logger.exception("engine step hook failed")

    def _recover(self, error: Exception) -> None:
        """A step raised: its batch state is unknown, so every request in flight gets the
        error and a fresh engine (same model) takes over; if that cannot be built, the loop
        is broken (see the class docstring)."""
        logger.error("engine step failed; failing in-flight requests:\n%s", traceback.format_exc())
        message = f"engine step failed: {type(error).__name__}: {error}"
        with self._lock:  # submits wait for the new engine (or the verdict)
            failed, self._futures = self._futures, {}
            try:
                self.engine = self._factory()
            except Exception as e:  # noqa: BLE001 - no engine to serve any request: fail them all
                logger.exception("rebuilding the engine failed; every request fails from now on")
                message = self.broken = f"{message}; rebuilding the engine failed: {type(e).__name__}: {e}"
        for rid, fut in failed.items():
            if not fut.done():
                fut.set_result(error_output(rid, [], message))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
