"""The engines of one processor run: ranks 0..n-1, the engine actors, and how long they live.

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
- counts the batches each dispatcher has in flight, and stops an engine once its
  dispatcher is gone and no dispatcher of the run has a batch in flight (the engine asks,
  every couple of seconds, once it sees its dispatcher gone).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import ray


@ray.remote(num_cpus=0)
class _EngineGroup:
    def __init__(self) -> None:
        self._next = 0
        self._engines: Dict[str, Any] = {}  # dispatcher key -> its engine (an EngineHost handle)
        self._busy: Dict[str, int] = {}  # dispatcher key -> batches it has in flight

    def next(self) -> int:
        rank, self._next = self._next, self._next + 1
        return rank

    def start_engine(self, key: str, engine_cls: str, kwargs: Dict[str, Any], options: Dict[str, Any],
                     dispatcher: Any) -> Any:
        """Dispatcher `key`'s engine: started (owned by this actor) at its first call,
        the same engine when the dispatcher was restarted."""
        if key not in self._engines:
            from .engine_router import EngineHost

            self._engines[key] = ray.remote(EngineHost).options(
                max_restarts=-1, max_task_retries=0, **options).remote(
                engine_cls, kwargs, group=ray.get_runtime_context().current_actor, key=key, dispatcher=dispatcher)
        self._busy[key] = 0  # a restarted dispatcher's batches come back through Ray Data
        return self._engines[key]

    def engines(self) -> Dict[str, Any]:
        """{dispatcher key: its engine}: live, restarting and lost ones (callers find out)."""
        return dict(self._engines)

    def track(self, key: str, delta: int) -> None:
        self._busy[key] = self._busy.get(key, 0) + delta

    def release(self, key: str) -> bool:
        """Called by an engine whose dispatcher is gone: stop it unless a batch of the run
        is in flight (it may be sent there). True when stopped."""
        self._busy.pop(key, None)  # a gone dispatcher has nothing in flight
        if any(self._busy.values()) or key not in self._engines:
            return False
        ray.kill(self._engines.pop(key), no_restart=True)
        return True


def rank_counter(group: str) -> "ray.actor.ActorHandle":
    """The group actor of `group` (a named actor), created if absent. The processor creates
    it on the driver, on the driver's node: it owns the run's engines, so it must outlive
    any worker node, and an engine that dies cannot take it (and rank 0) with it."""
    return _EngineGroup.options(name=group_actor_name(group), get_if_exists=True,
                                label_selector=_this_node(), fallback_strategy=[{"label_selector": {}}]).remote()


def group_actor_name(group: str) -> str:
    return f"blockray-ranks-{group}"


def _this_node() -> Dict[str, str]:
    if not ray.is_initialized():
        ray.init()  # what the actor's .remote() would do first
    node: Optional[str] = ray.get_runtime_context().get_node_id()
    return {"ray.io/node-id": node} if node else {}


def assign_rank(group: str) -> Tuple[int, "ray.actor.ActorHandle"]:
    """(the next free rank of `group`, the counter's handle). Callers keep the handle,
    since Ray removes an actor once no handle to it is left."""
    counter = rank_counter(group)
    return ray.get(counter.next.remote()), counter
