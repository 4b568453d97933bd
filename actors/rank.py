"""The engines of one processor run: ranks 0..n-1, the engine actors, their stats, and how long they live.

Why: Ray Data's actor pool does not number its actors, but metrics, logs and output rows
are tagged by engine rank; and a dispatcher whose engine died sends its batches to another
engine of the run (actors/engine_router.py), so the run's engines must be known, and must
outlive the dispatcher that asked for them. One small named actor per run (no resources,
on the driver's node; the processor creates it and the engine stage of the dataset it
builds holds it, so it lives as long as either):

- hands out the next rank to every engine that starts (a restarted engine gets a new one);
- starts each dispatcher's engine and owns it: Ray Data releases an idle dispatcher as
  soon as its operator has handed out every block, and an engine owned by its dispatcher
  would go with it while another dispatcher may still need it;
- keeps the stats each engine posts after a batch (EngineSpec.post_stats: tests, benches,
  the report);
- counts the batches each dispatcher has in flight, and stops an engine once its
  dispatcher is gone and no dispatcher of the run has a batch in flight (the engine asks,
  every couple of seconds, once it sees its dispatcher gone);
- reserves the placement group of a tensor-parallel engine (its options' "placement": one
  bundle per rank, PACK, as ray.data.llm does for a vLLM engine of tensor_parallel_size > 1)
  and starts the engine actor, rank 0, on bundle 0; rank 0 starts the other ranks on the
  other bundles (actors/tensor_parallel.py). The group holds the placement group while the
  engine lives (a restarted rank 0 comes back on bundle 0 and starts its ranks again; Ray
  reschedules the bundles of a lost node) and removes it when it stops the engine.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import ray


@ray.remote(num_cpus=0)
class _EngineGroup:
    def __init__(self) -> None:
        self._next = 0
        self._engines: Dict[str, Any] = {}  # dispatcher key -> its engine (a DLLMEngineActor handle)
        self._busy: Dict[str, int] = {}  # dispatcher key -> batches it has in flight
        self._stats: Dict[int, Dict[str, Any]] = {}  # rank -> its engine's stats as last posted
        self._groups: Dict[str, Any] = {}  # dispatcher key -> its tensor-parallel engine's placement group

    def next(self) -> int:
        rank, self._next = self._next, self._next + 1
        return rank

    def start_engine(self, key: str, spec: Any, options: Dict[str, Any], dispatcher: Any) -> Any:
        """Dispatcher `key`'s engine (an EngineSpec and its Ray options): started (owned by
        this actor) at its first call, the same engine when the dispatcher was restarted.
        max_task_retries=0: a call in flight to a lost engine fails at once, and the
        dispatcher sends the batch elsewhere (actors/engine_router.py)."""
        if key not in self._engines:
            from .engine_actor import DLLMEngineActor  # torch-free to import: torch loads in the engine

            options = dict(options)
            placement = options.pop("placement", None)
            if placement is not None:  # tensor parallel: rank 0 on bundle 0 of the engine's own group
                from .tensor_parallel import on_bundle

                self._groups[key] = pg = ray.util.placement_group(**placement)
                options.update(on_bundle(pg, 0))
            self._engines[key] = ray.remote(DLLMEngineActor).options(
                max_restarts=-1, max_task_retries=0, **options).remote(
                spec, ray.get_runtime_context().current_actor, key, dispatcher)
        self._busy[key] = 0  # a restarted dispatcher's batches come back through Ray Data
        return self._engines[key]

    def engines(self) -> Dict[str, Any]:
        """{dispatcher key: its engine}: live, restarting and lost ones (callers find out)."""
        return dict(self._engines)

    def put_stats(self, rank: int, stats: Dict[str, Any]) -> None:
        self._stats[int(rank)] = stats

    def stats(self) -> Dict[int, Dict[str, Any]]:
        return dict(self._stats)

    def track(self, key: str, delta: int) -> None:
        self._busy[key] = self._busy.get(key, 0) + delta

    def release(self, key: str) -> bool:
        """Called by an engine whose dispatcher is gone: stop it unless a batch of the run
        is in flight (it may be sent there). True when stopped."""
        self._busy.pop(key, None)  # a gone dispatcher has nothing in flight
        if any(self._busy.values()) or key not in self._engines:
            return False
        ray.kill(self._engines.pop(key), no_restart=True)  # its other ranks, its children, go with it
        if key in self._groups:
            ray.util.remove_placement_group(self._groups.pop(key))
        return True


def engine_group() -> "ray.actor.ActorHandle":
    """A fresh group actor for one run. The processor creates it on the driver, on the
    driver's node: it owns the run's engines, so it must outlive any worker node, and an
    engine that dies cannot take it (and rank 0) with it."""
    return _EngineGroup.options(label_selector=_this_node(), fallback_strategy=[{"label_selector": {}}]).remote()


def _this_node() -> Dict[str, str]:
    if not ray.is_initialized():
        ray.init()  # what the actor's .remote() would do first
    node: Optional[str] = ray.get_runtime_context().get_node_id()
    return {"ray.io/node-id": node} if node else {}
