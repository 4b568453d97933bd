"""What every engine shares, whatever it decodes: the masked-diffusion Engine
(engine.engine) and DiffusionGemma's canvas engine (engine.canvas.serve) are an
`EngineCore` each.

- Request intake: `add_request` (thread-safe: the actor's event loop adds while the
  engine thread steps) tokenizes and checks a request at once, and queues it; a bad one
  is never raised, it comes back from the next `step()` as an error output naming why.
- Validation: the checks every engine makes (SamplingParams' own, the fields the
  engine does not read refused (engine.reads), an empty prompt, ids outside the
  vocabulary), then the engine's own (`check`).
- The settings an engine does not read are refused at construction (EngineConfig) and
  per request (SamplingParams), derived from what it declares it reads.
- One step: the queued requests admitted, then the engine's `run`; an exception there
  fails the requests it was serving (error outputs naming it), is logged with its
  traceback (the first time in full, later ones in one line each), and the engine
  goes on with the queued ones."""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

from .config import EngineConfig, SamplingParams
from .reads import Reads, refusal, unread
from .sequence import FinishReason, Prompt, Request, RequestOutput, tokenize
from .stats import EngineStats

logger = logging.getLogger(__name__)


def prompt_refusal(prompt: Sequence[int], vocab_size: Optional[int]) -> Optional[str]:
    """Why a prompt's token ids cannot be served, or None: empty, or an id outside the
    vocabulary (None: not checked). Every engine's check (EngineCore.prepare; the canvas
    engine's own, engine.canvas.engine.CanvasEngine.refusal, when it runs alone)."""
    if not prompt:
        return "empty prompt"
    if vocab_size is not None:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            return f"token id {bad[0]} outside the vocabulary [0, {vocab_size})"
    return None


class EngineCore:
    reads: Reads  # what this engine reads of SamplingParams and EngineConfig (engine.reads)

    def __init__(self, config: EngineConfig, tokenizer: Any = None, vocab_size: Optional[int] = None):
        err = self.reads.refusal(engine=config)
        if err:
            raise ValueError(err)
        self.cfg, self.tokenizer, self.vocab_size = config, tokenizer, vocab_size
        self.stats = EngineStats(token_budget=config.token_budget)
        self.batch_log: Optional[list] = None
        self._intake: List[Request] = []
        self._finished: List[RequestOutput] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._in_flight = 0
        self._failures = 0

    # --- requests -----------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams = SamplingParams(), request_id: Any = None) -> Any:
        """Queue one request (thread-safe). A bad request is not raised: it comes back
        from the next step() with finish_reason "error" and a message naming the problem."""
        if request_id is None:
            request_id = next(self._ids)
        ids, error = tokenize(prompt, self.tokenizer)
        req = Request(request_id, ids or [], params, self.stop_ids(params))
        req.error = error or self.prepare(req)
        with self._lock:
            self._in_flight += 1
            self._intake.append(req)
        return request_id

    def stop_ids(self, params: SamplingParams) -> List[int]:
        return list(params.stop_token_ids or [])

    def prepare(self, req: Request) -> Optional[str]:
        """What makes `req` impossible to serve here, or None (then it is ready to admit):
        the checks every engine makes, then the engine's own (`check`)."""
        reads, who = self.sampling_reads(req)
        err = req.params.validate() or refusal(unread(req.params, reads), who)
        return err or prompt_refusal(req.prompt, self.vocab_size) or self.check(req)

    def sampling_reads(self, req: Request) -> Tuple[FrozenSet[str], str]:
        """The SamplingParams fields this engine reads for `req`, and who reads them (for the
        refusal of the others)."""
        return self.reads.sampling, self.reads.name

    def check(self, req: Request) -> Optional[str]:
        """The engine's own checks and preparation of a request (after the common ones): why
        it cannot be served, or None."""
        return None

    def has_unfinished(self) -> bool:
        with self._lock:
            return self._in_flight > 0

    def generate(self, prompts: Sequence[Prompt],
                 params: Union[SamplingParams, Sequence[SamplingParams]] = SamplingParams()) -> List[RequestOutput]:
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        want = set(ids)
        got: Dict[Any, RequestOutput] = {}
        while len(got) < len(ids):
            for out in self.step():
                if out.request_id in want:
                    got[out.request_id] = out
        return [got[i] for i in ids]

    # --- the loop -----------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        """Admit the queued requests and run one step of the engine (`run`); returns the
        requests that finished, bad ones included."""
        t0, c0 = time.perf_counter(), time.thread_time()
        with self._lock:
            intake, self._intake = self._intake, []
        for req in intake:
            if req.error:
                self.finish_error(req)
            else:
                self.admit(req)
        try:
            self.run()
        except Exception as e:  # noqa: BLE001 - a failing step fails its rows, not the engine
            self._log_failure(e)
            self.fail_active(f"engine failed while serving this request: {type(e).__name__}: {e}")
        self.stats.pending = self.pending()
        self.stats.busy_s += time.perf_counter() - t0
        self.stats.busy_cpu_s += time.thread_time() - c0
        out, self._finished = self._finished, []
        with self._lock:
            self._in_flight -= len(out)
        return out

    def _log_failure(self, exc: Exception) -> None:
        """A step that raises is a bug or a broken device, never a user's row: log it, with
        its traceback the first time this engine sees one (a step that fails every time
        would flood the log otherwise), one line each time after that."""
        self._failures += 1
        self.stats.step_failures = self._failures
        if self._failures == 1:
            logger.exception("engine step failed; the requests it was serving fail with this error, the engine goes "
                             "on", exc_info=exc)
        else:
            logger.error("engine step failed again (%d so far): %s: %s", self._failures, type(exc).__name__, exc)

    def admit(self, req: Request) -> None:
        raise NotImplementedError

    def pending(self) -> int:
        """Requests admitted but not yet served (EngineStats.pending)."""
        raise NotImplementedError

    def run(self) -> None:
        raise NotImplementedError

    def fail_active(self, message: str) -> None:
        """The requests being served fail with `message`; queued ones are untouched."""
        raise NotImplementedError

    def finish_error(self, req: Request) -> None:
        self.output(RequestOutput(request_id=req.request_id, prompt_token_ids=req.prompt + req.lead, token_ids=[],
                                  finish_reason=FinishReason.ERROR, error=req.error,
                                  latency_s=time.perf_counter() - req.arrival))

    def output(self, out: RequestOutput) -> None:
        self.stats.finished[out.finish_reason] = self.stats.finished.get(out.finish_reason, 0) + 1
        if out.finish_reason != FinishReason.ERROR:
            self.stats.generated_tokens += len(out.token_ids)
        self._finished.append(out)
