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


def assign_rank(group: str) -> Tuple[int, "ray.actor.ActorHandle"]:
    """(the next free rank of `group`, the counter's handle). The first caller creates
    and owns the counter; callers keep the handle, since Ray removes an actor once no
    handle to it is left, and nothing of it outlives the run's engines."""
    counter = _RankCounter.options(name=f"blockray-ranks-{group}", get_if_exists=True).remote()
    return ray.get(counter.next.remote()), counter
