"""The admission and preemption rules both engines share: the block engine's
BlockServeScheduler (engine.scheduler) and DiffusionGemma's CanvasEngine
(engine.canvas.engine) call these, each with its own cost of a row and its own prefix
cache (what differs, and why, is in CanvasEngine's docstring).

- Admission order: every admission (a re-admission after preemption too) is stamped with
  a rising `seq` (`AdmissionOrder`); preemption picks by it.
- The budget test: a row is admitted while the batch's cost, with it, plus the prefix
  cache's cells fit the token budget; a cached block never keeps a row out while it
  could be evicted (`fits`).
- Recompute preemption, as vLLM's: while the admitted rows (and the cache) outgrow the
  budget, cached blocks go first, then the most recently admitted row (`newest`) goes
  back to the queue with its tokens; the oldest row never goes (both engines refuse at
  intake a row that cannot fit alone), so the batch always makes progress (`preempt`).

Pure Python, no torch: the rows are whatever the engine admits (they carry `seq`)."""
from __future__ import annotations

import itertools
from typing import Any, Callable, List, Optional, Sequence, TypeVar

Row = TypeVar("Row")


class AdmissionOrder:
    """Stamps admitted rows with a rising `seq` (their admission order)."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def stamp(self, row: Any) -> None:
        row.seq = next(self._next)


def fits(need: int, budget: int, cached: Callable[[], int], evict: Optional[Callable[[], bool]] = None) -> bool:
    """Whether `need` cells of batch fit in `budget` beside the prefix cache's `cached()`
    cells; while they do not, the cache evicts (`evict`: False once it can evict nothing
    more that it may)."""
    while need + cached() > budget:
        if evict is None or not evict():
            return False
    return True


def newest(rows: Sequence[Row], movable: Callable[[Row], bool] = lambda r: True) -> Row:
    """The preemption victim among `rows`: the most recently admitted of those `movable`,
    else of all (it has the least work to redo, and the older rows finish first)."""
    return max([r for r in rows if movable(r)] or rows, key=lambda r: r.seq)  # type: ignore[attr-defined]


def preempt(active: List[Row], over: Callable[[], bool], evict: Callable[[], bool] = lambda: False,
            movable: Callable[[Row], bool] = lambda r: True) -> List[Row]:
    """While `over()`: a cached block goes (`evict`), else the newest admitted row but the
    oldest (`active[0]`; `newest`, those `movable` first) leaves `active`. Returns the rows
    that left, in the order they left; the caller queues them again."""
    out: List[Row] = []
    while over():
        if evict():
            continue
        if len(active) <= 1:
            break
        victim = newest(active[1:], movable)
        active.remove(victim)
        out.append(victim)
    return out


__all__ = ["AdmissionOrder", "fits", "newest", "preempt"]
