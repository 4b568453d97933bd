"""Engine stats per rank for tests and benches: Ray Data's actor pool does not expose its
actors, so each engine posts its stats to a sink actor after every batch."""
from __future__ import annotations

import logging
from typing import Any, Dict

import ray

from .engine_actor import DLLMEngineActor

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class EngineStatsSink:
    """Latest engine stats per rank, posted by the engine actors after every batch."""

    def __init__(self) -> None:
        self._stats: Dict[int, Dict[str, Any]] = {}

    def put(self, rank: int, stats: Dict[str, Any]) -> None:
        self._stats[int(rank)] = stats

    def get(self) -> Dict[int, Dict[str, Any]]:
        return dict(self._stats)


class StatsEngineActor(DLLMEngineActor):
    """DLLMEngineActor that posts its engine's stats to `stats_sink` after each batch."""

    def __init__(self, *args: Any, stats_sink: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._sink = stats_sink

    async def run_batch(self, batch):  # type: ignore[override]
        out = await super().run_batch(batch)
        if self._sink is not None:
            try:  # awaited: the pool may be torn down as soon as the last batch returns
                await self._sink.put.remote(self.rank, self.engine_stats())
            except Exception:  # noqa: BLE001 - stats are best effort
                logger.warning("engine stats not posted", exc_info=True)
        return out
