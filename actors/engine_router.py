"""The engine stage: a lost engine's batches go to a live engine at once.

Why the engines are not Ray Data's pool actors themselves: Ray Data 2.60 binds each task
of an actor pool to one actor. With the pool's defaults (max_restarts=-1,
max_task_retries=-1) the batches a dead actor held are retried on that same actor once Ray
has restarted it: after a model load, or, when its node is gone and no node has a free
slot (a GPU, an `engine_slot`), only once a slot frees. With max_task_retries=0 they fail,
and Ray Data fails the dataset (or, with `max_errored_blocks`, drops their rows). Nothing
in the pool (ray/data/_internal/execution/operators/actor_pool_map_operator.py) hands such
a task to another actor. So the pool holds dispatchers, and each engine is an actor of its
own:

- `EngineDispatcher`, the Ray Data callable class (one per engine; a twentieth of a CPU, no
  GPU, no model, no torch; on the driver's node when there is room, so that a lost worker
  node takes no dispatcher with it), has the run's group actor (actors/rank.py) start one
  engine for it and sends every batch Ray Data gives it to that engine. While nothing
  fails, the stage is a pool of engines pulling blocks (Ray Data hands the next block to a
  dispatcher with a free call slot), as before.
- The engine, a `DLLMEngineActor` (actors/engine_actor.py), has the engine's CPUs, GPUs
  and custom resources, `max_restarts=-1` and `max_task_retries=0`: when it dies, the
  calls in flight to it fail (`ActorUnavailableError`, about 2 s after a SIGKILL here) instead of waiting
  for its restart. The dispatcher sends each such batch again, at once, to the live engine
  of the run with the fewest batches in flight, and sends its new batches there too until
  its own engine answers again (Ray restarts it wherever a slot is free).
- The group actor owns the engines, so an engine outlives its dispatcher: once Ray Data
  has handed out every block it releases each dispatcher that falls idle, and the engine
  of such a dispatcher is still there for a batch that a lost engine held. An engine whose
  dispatcher is gone stops once no batch of the run is in flight.
- A batch is yielded once, by the dispatcher, from the one engine call that returned, so
  every row is written once; its `engine_retries` column counts the times it was sent again.

Starting without blocking: both actors are async, and a blocking `ray.get` in an async
actor stalls its event loop (Ray warns of it in every run). So the dispatcher's
constructor only asks the group to start its engine, and is ready for Ray Data at once;
its first batches await the engine's handle and then its `ready` (it answers once it has
loaded its model), all of them behind one wait bounded by `wait_for_engines_s` from the
dispatcher's start: no batch goes to an engine before it has loaded, every dispatcher's
first batches go to its own engine (so a small run still reaches every engine), and an
engine that is not up in time fails the job with `EnginesNotReady` naming the option (one
whose constructor raised: `EngineStartError`, with its cause). With
`wait_for_engines_s=0`, and in a dispatcher Ray restarted, nothing waits: batches go to the
live engines until its own answers. The engine likewise asks the group for its rank in its
constructor and awaits it at its first call.

Prefix affinity (engines with `enable_prefix_caching`, issue 40): a dispatcher whose engine
is up asks the group where a batch should run (`route`: the engine that served the batch's
prefix last, where the prefix cache still holds its K/V, unless that engine has more than
one batch more in flight than the least loaded; else the least loaded, its own among
equals; actors/prefix_affinity.py), on the first try only: a batch sent again after a loss
goes where the failover above sends it.

The engine gets only the columns it reads (token ids, the tokenizer's error, sampling
params, seed, id) and each row's index; the dispatcher puts the engine's columns back on the
whole batch, so pass-through columns never travel to an engine.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple, Union

import pyarrow as pa
import ray

from common.schema import ENGINE_RETRIES, OUTPUT_SCHEMA, STOP_TEXT, as_table

from .prefix_affinity import prefix_key
from .spec import EngineSpec

logger = logging.getLogger(__name__)

# What the dispatcher asks of Ray Data: it only moves Arrow tables.
DISPATCHER_CPUS = 0.05
# An engine is lost when a call to it fails like this (not when its own code raises).
ENGINE_LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)
PROBE_S = 0.5  # how often a dispatcher asks whether its lost engine is back
LOAD_TIMEOUT_S = 1.0  # an engine that does not say its load within this is skipped
_ROW = "__row"
_ADDED = [*OUTPUT_SCHEMA.names, STOP_TEXT]


class EnginesNotReady(TimeoutError):
    """A dispatcher's engine did not load its model within `wait_for_engines_s`: the
    cluster lacks what an engine asks for, or the model loads slowly (a TimeoutError: the
    job's environment, for the user to fix; pipeline/failures.py)."""


class EngineStartError(RuntimeError):
    """A dispatcher's engine failed to start (its constructor raised: Ray does not restart
    it), at the run's start or when no other engine can take its batches; its cause says
    why (what it raised decides whether that is the user's to fix or a bug,
    pipeline/failures.py)."""


class EngineDispatcher:
    """Ray Data callable class of the engine stage; see the module docstring.

    `spec`: the engine's EngineSpec (actors/spec.py); `engine_options`: its Ray options
    (num_cpus, num_gpus, resources, scheduling_strategy); `group`: the run's group actor
    (actors/rank.py; a handle, which the dataset holds while it exists, so the group and
    its engines live as long); `wait_for_engines_s`: how long its first batches wait for
    its engine to load (0: they go to any engine that is up meanwhile)."""

    def __init__(self, spec: EngineSpec, engine_options: Dict[str, Any], group: "ray.actor.ActorHandle",
                 wait_for_engines_s: float = 0.0):
        ctx = ray.get_runtime_context()
        self._columns = spec.columns()
        self._group = group
        self._key = ctx.get_actor_id() or uuid.uuid4().hex  # the same across this dispatcher's restarts
        self._options = engine_options
        # Asked now, awaited at the first batch (an async actor's constructor must not block):
        # `current_actor` is a weak handle, it does not keep this dispatcher alive.
        self._engine_ref = self._group.start_engine.remote(self._key, spec, engine_options, ctx.current_actor)
        self._engine: Optional["ray.actor.ActorHandle"] = None
        self._up = False  # its engine answers now
        self._gone: Optional[BaseException] = None  # its engine cannot come back (a restart failed)
        self._watcher: Optional[asyncio.Future] = None
        # A first start holds its batches until its engine has loaded, within this bound, as
        # a pool of engines would; a restarted dispatcher (or wait_for_engines_s=0) sends
        # them to the live engines meanwhile.
        self._wait_s = wait_for_engines_s if not ctx.was_current_actor_reconstructed else 0.0
        self._deadline = time.monotonic() + self._wait_s
        self._first_start: Optional[asyncio.Future] = None
        # engines that cache prompt prefixes: a batch goes to the engine that served its prefix last
        self._affinity = spec.prefix_affinity and spec.prefix_caching()
        self._token_ids, self._block_length = spec.token_ids_column, spec.engine.block_length

    async def __call__(self, batch: Union[pa.Table, Dict[str, Any]]):
        yield await self.run_batch(batch)

    async def run_batch(self, batch: Union[pa.Table, Dict[str, Any]]) -> pa.Table:
        table = as_table(batch)
        send = table.select([c for c in self._columns if c in table.column_names]).append_column(
            _ROW, pa.array(range(table.num_rows), pa.int64()))
        retries, routed = 0, None
        self._group.track.remote(self._key, +1)  # an engine whose dispatcher is gone waits for these
        try:
            while True:
                engine = await self._pick()
                if self._affinity and not retries and engine is self._engine:  # the first try: by its prefix
                    engine, routed = await self._route(send, engine)
                try:
                    out = await engine.run_batch.remote(send)
                    break
                except ENGINE_LOST as e:
                    retries += 1
                    own = engine is self._engine
                    if own:
                        self._up = False
                    logger.warning("%s engine lost with a batch of %d rows in flight; sending it to another "
                                   "engine (%s: %s)", "this dispatcher's" if own else "another dispatcher's",
                                   table.num_rows, type(e).__name__, (str(e).splitlines() or [""])[0])
        finally:
            self._group.track.remote(self._key, -1)
            if routed is not None:
                self._group.routed_done.remote(routed)
        return self._merge(table, out, retries)

    async def _route(self, send: pa.Table, own: "ray.actor.ActorHandle") -> Tuple["ray.actor.ActorHandle", str]:
        """(engine, its dispatcher key) for a batch by prefix affinity (the group decides:
        actors/prefix_affinity.py); its own engine when the chosen one is not known."""
        col = send.column(self._token_ids).slice(0, 1).to_pylist() if self._token_ids in send.column_names else []
        target = await self._group.route.remote(prefix_key(col, self._block_length), self._key)
        if target == self._key:
            return own, target
        handle = (await self._group.engines.remote()).get(target)
        return (handle, target) if handle is not None else (own, target)

    # --- routing ----------------------------------------------------------------------
    async def _own(self) -> "ray.actor.ActorHandle":
        """Its engine's handle, once the group has started it (asked in the constructor)."""
        if self._engine is None:
            self._engine = await self._engine_ref
        return self._engine

    async def _pick(self) -> "ray.actor.ActorHandle":
        """Its own engine while it is up (at a first start: once it has loaded); else the
        live engine with the fewest batches in flight; with none alive, wait (raise if its
        own engine cannot come back)."""
        engine = await self._own()
        if self._wait_s > 0 and not self._up:
            if self._first_start is None:  # one wait, shared by the batches that arrive meanwhile
                self._first_start = asyncio.ensure_future(self._wait_for_first_start(engine))
            await asyncio.shield(self._first_start)
        while True:
            if self._up:
                return engine
            self._watch()
            peers = await self._live_peers()
            if peers:
                return min(peers, key=lambda p: p[0])[1]
            if self._gone is not None:
                raise EngineStartError("no engine to run on: this dispatcher's engine failed to start and no "
                                       "other engine answers") from self._gone
            await asyncio.sleep(PROBE_S)

    async def _wait_for_first_start(self, engine: "ray.actor.ActorHandle") -> None:
        """Until its engine answers `ready` (it has loaded its model), within wait_for_engines_s
        of this dispatcher's start (a loaded engine answers at once, however late the first
        batch comes); then it is up and nothing waits here again."""
        while True:
            left = self._deadline - time.monotonic()
            try:
                rank = await asyncio.wait_for(engine.ready.remote(), max(left, LOAD_TIMEOUT_S))
            except asyncio.TimeoutError:
                raise self._not_ready() from None
            except ray.exceptions.ActorDiedError as e:
                if e.actor_init_failed:  # its constructor raised: Ray does not restart it
                    raise EngineStartError("this dispatcher's engine failed to start") from e
            except ENGINE_LOST:
                pass  # lost while it loaded: Ray restarts it
            else:
                logger.info("engine up (rank %d)", rank)
                self._up, self._wait_s = True, 0.0  # a later loss: failover (_watch), not this wait
                return
            if time.monotonic() >= self._deadline:
                raise self._not_ready()
            await asyncio.sleep(PROBE_S)

    def _not_ready(self) -> EnginesNotReady:
        """The error of an engine not up in time, naming the option and what it asks Ray for
        (an engine that asks for what no node has stays pending: Ray raises nothing)."""
        keys = ("num_cpus", "num_gpus", "resources")
        asks = ", ".join(f"{k}={self._options[k]}" for k in keys if self._options.get(k)) or "no resources"
        if self._options.get("placement"):  # tensor parallel: its ranks' placement group
            pg = self._options["placement"]
            asks = f"a placement group of {len(pg['bundles'])} bundles {pg['bundles']}, {pg['strategy']}"
        return EnginesNotReady(
            f"an engine did not load its model within {self._wait_s:g} s (wait_for_engines_s, --wait-for-engines-s): "
            f"the cluster may lack what it asks for ({asks}), or the model loads slowly; free or add resources, or "
            "raise --wait-for-engines-s")

    async def _live_peers(self) -> List[Tuple[int, "ray.actor.ActorHandle"]]:
        engines = await self._group.engines.remote()
        others = [h for key, h in engines.items() if key != self._key]
        loads = await asyncio.gather(*(self._load(h) for h in others))
        return [(n, h) for n, h in zip(loads, others) if n is not None]

    @staticmethod
    async def _load(engine: "ray.actor.ActorHandle") -> Optional[int]:
        try:
            return await asyncio.wait_for(engine.load.remote(), LOAD_TIMEOUT_S)
        except (asyncio.TimeoutError, *ENGINE_LOST):
            return None  # lost, restarting, or not placed: not a candidate

    def _watch(self) -> None:
        """Start waiting for its own engine to answer again (Ray restarts it)."""
        if self._gone is None and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.ensure_future(self._wait_for_engine())

    async def _wait_for_engine(self) -> None:
        engine = await self._own()
        while not self._up:
            try:
                rank = await engine.ready.remote()
            except ray.exceptions.ActorDiedError as e:
                if e.actor_init_failed:  # its restart failed: it stays dead
                    self._gone = e
                    return
            except ENGINE_LOST:
                pass
            else:
                logger.info("engine back (rank %d)", rank)
                self._up = True
                return
            await asyncio.sleep(PROBE_S)

    # --- output -------------------------------------------------------------------------
    @staticmethod
    def _merge(table: pa.Table, out: pa.Table, retries: int) -> pa.Table:
        """The whole batch with the engine's columns (one row per output row of the engine,
        which gives n rows for a row with n samples) and `engine_retries`."""
        rows = out.column(_ROW)
        base = table.drop_columns([c for c in (*_ADDED, ENGINE_RETRIES.name) if c in table.column_names])
        if rows.to_pylist() != list(range(table.num_rows)):
            base = base.take(rows)
        for name in _ADDED:
            base = base.append_column(out.schema.field(name), out.column(name))
        return base.append_column(ENGINE_RETRIES, pa.array([retries] * out.num_rows, pa.int64()))
