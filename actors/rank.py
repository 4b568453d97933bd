"""Engine ranks 0..n-1 for the actors of one processor run.

Why: Ray Data's actor pool does not number its actors, but metrics, logs and output
rows are tagged by engine rank. A tiny named actor (no resources) hands out the next
integer; every engine actor of a run asks the one named after the run's group id.
"""
from __future__ import annotations

from typing import Tuple

import ray


@ray.remote(num_cpus=0)
class _RankCounter:
    def __init__(self) -> None:
        self._next = 0

    def next(self) -> int:
        rank, self._next = self._next, self._next + 1
        return rank


def rank_counter(group: str) -> "ray.actor.ActorHandle":
    """The counter of `group`, created if absent. Its creator owns it: the processor
    creates it on the driver, so an engine that dies (and is restarted) cannot take the
    counter with it and hand out rank 0 again."""
    return _RankCounter.options(name=f"blockray-ranks-{group}", get_if_exists=True).remote()


def assign_rank(group: str) -> Tuple[int, "ray.actor.ActorHandle"]:
    """(the next free rank of `group`, the counter's handle). Callers keep the handle,
    since Ray removes an actor once no handle to it is left."""
    counter = rank_counter(group)
    return ray.get(counter.next.remote()), counter
