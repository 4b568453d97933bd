"""Who runs in the next block cycle. `blockserve` is the block-grained continuous
batcher; `static` (Fast-dLLM style fixed groups) and `sequential` are the baselines
every benchmark compares against."""
from __future__ import annotations

import bisect
import itertools
from collections import deque
from typing import Callable, List

from .admission import AdmissionOrder, fits, preempt
from .config import EngineConfig, SchedulerKind
from .sequence import Request, RowShape


def batch_cost(rows: List[Request], shape: RowShape) -> int:
    """Padded area of a left-padded batch: |A| * max_i(p_i + (b_i+1) L)."""
    return len(rows) * max((shape.width(r) for r in rows), default=0)


class Scheduler:
    def __init__(self, cfg: EngineConfig, shape: RowShape):
        self.cfg, self.shape = cfg, shape
        self.active: List[Request] = []
        self._order = AdmissionOrder()  # req.seq: LIFO preemption (engine.admission)
        self.preemptions = 0
        self.prefix = None  # engine.prefix_cache.PrefixCache: its cached blocks count in the budget

    def _cached(self) -> int:
        return self.prefix.cells if self.prefix is not None else 0

    def add(self, req: Request) -> None:
        raise NotImplementedError

    def schedule(self, can_preempt: Callable[[Request], bool] = lambda r: True) -> List[Request]:
        """Rows of the next forward, in admission order. Rows for which `can_preempt`
        holds (those at a block boundary) are sent back to the queue first."""
        raise NotImplementedError

    def finish(self, req: Request) -> None:
        self.active.remove(req)

    def remove(self, req: Request) -> None:
        """Drop a row at once (the engine failed it), whatever the batching policy."""
        self.active.remove(req)

    def num_pending(self) -> int:
        raise NotImplementedError

    def is_frozen(self, req: Request) -> bool:
        """A finished row kept in the batch (only the static baseline does this)."""
        return False

    def has_work(self) -> bool:
        return bool(self.active) or self.num_pending() > 0

    def _admit(self, req: Request) -> None:
        self._order.stamp(req)
        self.active.append(req)
        if self.prefix is not None:
            self.prefix.acquire(req)


class BlockServeScheduler(Scheduler):
    """Pending queue sorted by row width (= prompt length for new requests). Admission
    keeps Cost(A) <= token_budget and prefers the widest candidate that fits inside the
    current bounding box ("sand filling": it adds no padding). Rows grow by L each
    cycle; if that growth breaks the budget, the latest-admitted rows go back to the
    queue with their committed blocks (dLLM state is just tokens, so this is exact)."""

    def __init__(self, cfg: EngineConfig, shape: RowShape, max_active: int | None = None):
        super().__init__(cfg, shape)
        self.pending: list = []  # (width, arrival, request), sorted
        self._arrival = itertools.count()
        self.max_active = max_active or cfg.max_batch_size

    def add(self, req: Request) -> None:
        bisect.insort(self.pending, (self.shape.width(req), next(self._arrival), req))

    def num_pending(self) -> int:
        return len(self.pending)

    def schedule(self, can_preempt: Callable[[Request], bool] = lambda r: True) -> List[Request]:
        budget = self.cfg.token_budget
        if self.prefix is not None:  # the rows' growth first takes room from unreferenced cached blocks
            self.prefix.make_room(batch_cost(self.active, self.shape))
        # the newest rows go back (engine.admission.preempt), those at a block boundary first;
        # if growth still breaks the budget (step advance: the others are mid-block), a
        # mid-block row goes back too and redoes its block later (same tokens: a block is a
        # function of its prefix)
        for victim in preempt(self.active, lambda: batch_cost(self.active, self.shape) + self._cached() > budget,
                              movable=can_preempt):
            self.add(victim)
            self.preemptions += 1
        box = max((self.shape.width(r) for r in self.active), default=0)
        while self.pending and len(self.active) < self.max_active:
            i = bisect.bisect_right(self.pending, (box, float("inf"))) - 1
            width, _, cand = self.pending[max(i, 0)]
            new_box = max(box, width)
            need = (len(self.active) + 1) * new_box
            evict = None if self.prefix is None else (  # sparing its own blocks if it can
                lambda: self.prefix.make_room(need, keep=cand) or self.prefix.make_room(need))
            if not fits(need, budget, self._cached, evict):
                break
            self.pending.pop(max(i, 0))
            self._admit(cand)
            box = new_box
        return list(self.active)


class SequentialScheduler(BlockServeScheduler):
    """One request at a time, in arrival order."""

    def __init__(self, cfg: EngineConfig, shape: RowShape):
        super().__init__(cfg, shape, max_active=1)

    def add(self, req: Request) -> None:
        self.pending.append((self.shape.width(req), next(self._arrival), req))  # FIFO, not sorted


class StaticScheduler(Scheduler):
    """Fast-dLLM style: fixed groups of B requests in arrival order, run in lock step
    until the slowest finishes. Finished rows stay in the batch (computed, frozen) and
    nothing is refilled until the whole group is done."""

    def __init__(self, cfg: EngineConfig, shape: RowShape):
        super().__init__(cfg, shape)
        self.pending: deque = deque()
        self.done: set = set()

    def add(self, req: Request) -> None:
        self.pending.append(req)

    def num_pending(self) -> int:
        return len(self.pending)

    def finish(self, req: Request) -> None:
        self.done.add(req.request_id)
        if all(r.request_id in self.done for r in self.active):
            self.active.clear()
            self.done.clear()

    def is_frozen(self, req: Request) -> bool:
        return req.request_id in self.done

    def remove(self, req: Request) -> None:
        self.active.remove(req)
        self.done.discard(req.request_id)
        if not self.active:
            self.done.clear()

    def schedule(self, can_preempt: Callable[[Request], bool] = lambda r: True) -> List[Request]:
        if not self.active:
            while self.pending and len(self.active) < self.cfg.max_batch_size:
                self._admit(self.pending.popleft())
        return list(self.active)


SCHEDULERS = {SchedulerKind.BLOCKSERVE: BlockServeScheduler, SchedulerKind.STATIC: StaticScheduler,
              SchedulerKind.SEQUENTIAL: SequentialScheduler}


def make_scheduler(cfg: EngineConfig, shape: RowShape) -> Scheduler:
    return SCHEDULERS[cfg.scheduler](cfg, shape)
