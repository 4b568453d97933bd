"""One engine over N devices (tensor_parallel_size N > 1): its ranks on a placement group, in lock step.

Who does what:
- The run's group actor (actors/rank.py) reserves, per engine, a placement group of N
  bundles, one per rank (PACK, as ray.data.llm reserves one for a tensor-parallel vLLM
  engine), and starts the engine actor (actors/engine_actor.py) on bundle 0: rank 0.
- Rank 0 (`RankGroup`) starts ranks 1..N-1 (`TensorParallelFollower`, one per other bundle,
  its children), and all join one torch.distributed group (engine.parallel: a tcp://
  rendezvous on rank 0's node and a free port; NCCL on GPUs, gloo on CPU); each loads its
  shard of the weights (engine.load_model(..., tp=...)).
- SPMD: rank 0 takes the batches from its dispatcher as one engine does (run_batch ->
  `LockstepLoop.submit`, which queues). Before each step its engine thread broadcasts one
  `StepOrder` to the others: the requests admitted since the last one (ids, token ids,
  SamplingParams with the seed filled in: every rank must draw the same noise), the engine's
  epoch, or stop. Every rank then adds those requests in that order and steps when its
  engine has unfinished requests: the same requests and the same host decisions on every
  rank (the engine agrees on the measured ones itself: engine.parallel), so the same steps.
  Only rank 0 returns outputs. One small broadcast per step; an idle rank 0 sends an empty
  one every idle wait (half a second), so the others never wait on a collective for long.
- A step that raises on every rank (a deterministic error) fails the requests in flight,
  as one engine does: rank 0 raises the epoch, and at the next order every rank builds a
  fresh engine. A rank whose step raised alone, or that missed one that rank 0's raised,
  has diverged: it raises (`GroupDiverged`), which is a lost rank.
- Failover: a lost rank fails its whole engine. Rank 0 watches its followers' `run` calls
  (their Ray futures, from a thread: no collective can hide a loss); when one ends while
  the engine runs, or a collective of rank 0's own loop fails, rank 0's process exits. Its
  followers, its children, go with it (Ray's owner fate sharing); Ray restarts rank 0
  (max_restarts=-1) on bundle 0 of the engine's placement group, which then starts its
  ranks again on the bundles freed; meanwhile the calls in flight to it fail and its
  dispatcher sends those batches to a live engine, exactly once (actors/engine_router.py).
  Rank 0 lost: the same, seen by Ray directly. A node lost: Ray reschedules the placement
  group's bundles, and the engine restarts there. The placement group itself is kept
  (reserved by the group actor) across restarts and removed with the engine.
- Collectives that hang rather than fail (a peer alive but stuck) wait for the backend's
  own timeout (engine.parallel's init_process_group default), then fail as above.

Ray here, torch only inside the rank processes (imported when they run).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import random
import socket
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from engine.config import SamplingParams  # dataclasses only: no torch

from .engine_loop import EngineLoop, error_output
from .spec import EngineSpec

logger = logging.getLogger(__name__)

Add = Tuple[Any, List[int], SamplingParams]  # (request id, token ids, params with the seed filled in)


@dataclasses.dataclass
class StepOrder:
    """What rank 0 tells the other ranks before each engine step: add `adds` in this
    order (to the engine of `epoch`: a higher one than theirs means build a fresh engine
    first, after a step failed on every rank), then step when unfinished; or `stop`."""

    adds: List[Add] = dataclasses.field(default_factory=list)
    epoch: int = 0
    stop: bool = False


class GroupDiverged(RuntimeError):
    """A rank's engine no longer runs in lock step with rank 0's: a lost rank."""


def on_bundle(pg: Any, index: int) -> Dict[str, Any]:
    """Ray options that place an actor on bundle `index` of placement group `pg` (its own
    children not captured: a rank starts none)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False)}


def bundle_options(bundle: Dict[str, float]) -> Dict[str, Any]:
    """An actor's num_cpus / num_gpus / resources asking for all of `bundle`."""
    rest = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    return dict(num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0), **({"resources": rest} if rest else {}))


def rendezvous() -> str:
    """tcp://<this node's IP>:<a free port>: where the ranks of this engine meet (rank 0's
    node, the placement group being packed on one)."""
    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((ip, 0))
        return f"tcp://{ip}:{s.getsockname()[1]}"


def fill_seed(params: SamplingParams) -> SamplingParams:
    """`params` with a seed: a row without one gets a drawn one on rank 0, which every rank
    then uses (a rank's own draw would differ from the others')."""
    return params if params.seed is not None else dataclasses.replace(params, seed=random.getrandbits(62))


START_GRACE_S = 10.0  # a follower failing while rank 0 still starts: how long rank 0 may take to fail alike


class RankGroup:
    """Rank 0's side of one engine's group: starts the other ranks on the other bundles of
    the placement group it runs on, joins them (`tp`), and stops this process when one of
    them is lost (see the module docstring)."""

    def __init__(self, spec: EngineSpec):
        import ray

        from engine.parallel import init_tensor_parallel

        n = spec.tensor_parallel_size
        pg = ray.util.get_current_placement_group()
        if pg is None or len(pg.bundle_specs) < n:
            raise RuntimeError(f"tensor_parallel_size {n}: the engine actor must run on bundle 0 of a placement group "
                               f"of {n} bundles (the run's group actor places it so: actors/rank.py)")
        where = rendezvous()
        follower = ray.remote(TensorParallelFollower)
        self.followers = [follower.options(max_restarts=0, **bundle_options(pg.bundle_specs[r]), **on_bundle(pg, r))
                          .remote(spec, r, n, where) for r in range(1, n)]
        self._runs = [f.run.remote() for f in self.followers]
        self.loop: Optional[LockstepLoop] = None
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, name="dllm-tp-watch", daemon=True).start()
        self.tp = init_tensor_parallel(0, n, where)
        logger.info("tensor-parallel engine: rank 0 of %d joined at %s", n, where)

    def lockstep(self, factory: Callable[[], Any], on_step: Any = None) -> "LockstepLoop":
        """Rank 0's engine loop (built as the other ranks build their first engine)."""
        self.loop = LockstepLoop(factory, self.tp, on_step=on_step, on_shutdown=self._stopping.set,
                                 on_lost=lambda e: self._lost(0, e))
        return self.loop

    def _watch(self) -> None:
        """Wait for the first follower's `run` to end; unless this engine is stopping, that
        is a lost rank: exit this process (see the module docstring). Ray futures, no ray.get
        (this is an async actor)."""
        futures = {ref.future(): r for r, ref in enumerate(self._runs, start=1)}
        done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
        if self._stopping.is_set():
            return
        fut = next(iter(done))
        if self.loop is None:  # still starting: a failure every rank meets (a model that cannot be
            # sharded N ways) raises in rank 0's constructor too, which Ray reports as the
            # engine's start failure (not restarted): give it that chance before exiting
            self._stopping.wait(START_GRACE_S)
        self._lost(futures[fut], fut.exception() or RuntimeError("its loop ended while the engine runs"))

    def _lost(self, rank: int, why: BaseException) -> None:
        """Rank `rank` is lost (0: this rank's collectives failed): unless the engine is
        stopping, exit this process; Ray restarts the engine, and its other ranks, children
        of this process, go with it."""
        if self._stopping.is_set():
            return
        logger.error("tensor-parallel rank %d of this engine is lost (%s: %s): stopping every rank; Ray restarts the "
                     "engine on its placement group and its batches go to a live engine", rank,
                     type(why).__name__, (str(why).splitlines() or [""])[0])
        logging.shutdown()
        os._exit(1)


class LockstepLoop(EngineLoop):
    """Rank 0's EngineLoop under tensor parallelism: `submit` only queues (with the seed
    filled in), and the engine thread broadcasts the queued requests (a StepOrder) before it
    adds them and steps, as every other rank does (`follow`)."""

    def __init__(self, engine_factory: Callable[[], Any], tp: Any, on_step: Any = None, idle_wait_s: float = 0.5,
                 on_shutdown: Optional[Callable[[], None]] = None, on_lost: Optional[Callable[[Any], None]] = None):
        self.tp = tp
        self._on_lost = on_lost
        self._queue: List[Add] = []
        self._epoch = 0  # raised by a failed step: every rank then builds a fresh engine
        self._on_shutdown = on_shutdown
        super().__init__(engine_factory, on_step=on_step, idle_wait_s=idle_wait_s)

    def _hand_over(self, request_id: Any, prompt: Sequence[int], params: SamplingParams) -> None:
        """Queue the request for the next step's broadcast (every rank adds it then), its seed filled in."""
        with self._lock:
            if request_id in self._futures:  # not failed meanwhile by a failed step (_recover)
                self._queue.append((request_id, list(prompt), fill_seed(params)))

    def _run(self) -> None:
        epoch = 0  # of the engine this rank runs
        try:
            while self.broken is None:
                self._wake.clear()
                with self._lock:
                    adds, self._queue = self._queue, []
                stop = self._stop.is_set()
                self.tp.broadcast_object(StepOrder(adds, self._epoch, stop))
                if stop:
                    return
                if epoch != self._epoch:  # a step failed on every rank: each builds a fresh engine now
                    epoch = self._epoch
                    if not self._rebuild():
                        return
                engine = self.engine
                add_all(engine, adds, self._resolve)
                self._step(engine)  # EngineLoop's body; a failed step: _recover below
        except Exception as e:  # noqa: BLE001 - a collective failed (a rank gone, or timed out): the group is lost
            logger.exception("tensor-parallel engine loop failed")
            self._break(f"tensor-parallel group failed: {type(e).__name__}: {e}")
            if self._on_lost is not None:
                self._on_lost(e)  # rank 0's process exits: Ray restarts the whole group

    def _recover(self, error: Exception) -> None:
        """A step raised: the requests in flight (and those queued for it) get the error, and
        the next order raises the epoch, at which every rank builds a fresh engine (see the
        module docstring), rather than this rank alone rebuilding now as EngineLoop does."""
        logger.error("engine step failed; failing in-flight requests", exc_info=True)
        with self._lock:
            failed, self._futures, self._queue = self._futures, {}, []
            self._epoch += 1
        for rid, fut in failed.items():
            if not fut.done():
                fut.set_result(error_output(rid, [], f"engine step failed: {type(error).__name__}: {error}"))

    def _rebuild(self) -> bool:
        """A fresh engine, built on every rank at once (its budget is agreed collectively).
        Should it raise here, the other ranks' state is unknown: the group is lost."""
        try:
            self.engine = self._factory()
            return True
        except Exception as e:  # noqa: BLE001 - no engine to serve any request: fail them all
            logger.exception("rebuilding the engine failed")
            self._break(f"rebuilding the engine failed: {type(e).__name__}: {e}")
            if self._on_lost is not None:
                self._on_lost(e)
            return False

    def _break(self, message: str) -> None:
        with self._lock:
            self.broken = message
            failed, self._futures, self._queue = self._futures, {}, []
        for rid, fut in failed.items():
            if not fut.done():
                fut.set_result(error_output(rid, [], message))

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._on_shutdown is not None:
            self._on_shutdown()  # the followers' loops end now: no lost rank
        super().shutdown(timeout)


def add_all(engine: Any, adds: Sequence[Add], resolve: Optional[Callable[[Any], None]] = None) -> None:
    """Add the requests of one StepOrder to `engine`, in order (the same on every rank).
    add_request does not raise (a bad request comes back from step with its error); should
    it, the request fails on every rank alike."""
    for rid, prompt, params in adds:
        try:
            engine.add_request(prompt, params, request_id=rid)
        except Exception as e:  # noqa: BLE001 - never expected: see the docstring
            if resolve is not None:
                resolve(error_output(rid, prompt, f"add_request failed: {type(e).__name__}: {e}"))


def follow(tp: Any, factory: Callable[[], Any], before_add: Optional[Callable[[Any, SamplingParams], None]] = None,
           ) -> int:
    """A follower rank's engine loop: each StepOrder of rank 0 applied as rank 0 applies it
    (see LockstepLoop._run), until stop; returns the steps run. Raises GroupDiverged when
    this rank's engine is no longer in lock step with rank 0's."""
    engine, epoch, failed, steps = factory(), 0, False, 0
    while True:
        order: StepOrder = tp.broadcast_object(None)
        if order.stop:
            return steps
        if order.epoch != epoch:
            if not failed or order.epoch != epoch + 1:
                raise GroupDiverged(f"rank 0's engine is at epoch {order.epoch} (a step failed there), this rank's "
                                    f"at {epoch}{' (its step failed too)' if failed else ''}")
            engine, epoch, failed = factory(), order.epoch, False
        elif failed:
            raise GroupDiverged("this rank's step failed and rank 0's did not")
        if before_add is not None:
            for _, _, params in order.adds:
                before_add(engine, params)
        add_all(engine, order.adds)
        if engine.has_unfinished():
            try:
                engine.step()
                steps += 1
            except Exception:  # noqa: BLE001 - rank 0's order says whether it failed there too
                logger.exception("engine step failed on this rank")
                failed = True


class TensorParallelFollower:
    """Rank `rank` (1..size-1) of one tensor-parallel engine, started by its rank 0 on
    bundle `rank` of the engine's placement group: `run` joins the group at `init_method`,
    loads this rank's shard and follows rank 0's steps until it stops (see the module
    docstring). A plain (threaded) actor: `run` is its only call."""

    def __init__(self, spec: EngineSpec, rank: int, size: int, init_method: str):
        import torch

        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self.spec, self.rank, self.size, self.init_method = spec, rank, size, init_method
        self._tokenizer: Any = None

    def run(self) -> int:
        from engine.parallel import init_tensor_parallel

        from .engine_build import load_engine, resolve_device, warm_up

        spec = self.spec
        tp = init_tensor_parallel(self.rank, self.size, self.init_method)
        ckpt = spec.checkpoint()
        device = resolve_device(spec.device)
        self._dir = ckpt.weights_dir()
        model, _, config, factory = load_engine(spec, ckpt, device, self._dir, lambda: self._tokenizer, tp=tp)
        if spec.warmup and ckpt.serving.warms_up:
            warm_up(model, config)  # as rank 0 does: its forwards are collectives too
        text_stops = ckpt.serving.uses_tokenizer
        logger.info("tensor-parallel engine: rank %d of %d loaded on %s", self.rank, self.size, device)

        def before_add(engine: Any, params: SamplingParams) -> None:
            if params.stop and text_stops:  # stop strings are decided on the text, as on rank 0
                engine.tokenizer = self._tokenizer_of(ckpt)

        return follow(tp, factory, before_add)

    def _tokenizer_of(self, ckpt: Any) -> Any:
        if self._tokenizer is None:
            from common.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self._dir, ckpt.hf, ckpt.tokenizer.config)
        return self._tokenizer
