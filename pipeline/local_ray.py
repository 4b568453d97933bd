"""Start the job's local Ray, once more when its node times out while it starts.

Ray waits a fixed 30 s (not configurable) for the raylet to register with the GCS; on a
loaded machine (a 2-core CI box running two suites' worth of Ray, a laptop compiling) that
wait can expire although nothing is wrong, and the run would fail before it began. The
half-started node's processes (the children this process gained during the attempt) are
killed, and the start is tried once more. Any other failure is raised at once."""
from __future__ import annotations

import sys
from typing import Any, Set

STARTUP_TIMEOUT = "timed out during startup"  # ray/_private/node.py's message for that wait
ATTEMPTS = 2


def _children() -> Set[Any]:
    import psutil

    return set(psutil.Process().children(recursive=True))


def kill_new_children(before: Set[Any], grace_s: float = 5.0) -> None:
    """SIGKILL the processes this one started since `before` (recursively) and reap them."""
    import psutil

    procs = [p for p in _children() if p not in before]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=grace_s)


def start_local_ray(ray: Any, **kwargs: Any) -> Any:
    """`ray.init(address="local", **kwargs)`, tried once more after a startup timeout."""
    for attempt in range(1, ATTEMPTS + 1):
        before = _children()
        try:
            return ray.init(address="local", **kwargs)
        except Exception as e:  # noqa: BLE001 - only the startup timeout is retried
            if attempt == ATTEMPTS or STARTUP_TIMEOUT not in str(e):
                raise
            ray.shutdown()  # whatever the failed start left initialised in this process
            kill_new_children(before)
            print("Ray's node timed out while it started (a loaded machine?); starting it once more", file=sys.stderr,
                  flush=True)


__all__ = ["start_local_ray", "kill_new_children", "STARTUP_TIMEOUT"]
