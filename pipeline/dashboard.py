"""The Ray dashboard of a run: whether a local Ray starts one, on which port, and where
to open it.

Off by default for a local Ray, by measurement on a 2-core machine (bench/dashboard_cost.py,
an idle local Ray of 2 CPUs with token auth, 4 runs each way; README "Watching a run"): the
dashboard adds 11 processes (21 instead of 10), 0.94 GB of memory (1.75 GB instead of
0.81), 1-4 CPU-seconds to the start (10.4-13.5 instead of 8.6-9.6) and 0.02-0.04 of a core
while idle; ray.init's wall time was dominated by the shared machine's load (8-39 s
without, 20-33 s with). Every local run would pay that for a page few of them open; a run
against a cluster (--address, `ray job submit`) uses the cluster's dashboard as before.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

DASHBOARD_PORT = 8265  # Ray's own default
DASHBOARD_HOST = "127.0.0.1"  # loopback only: reach it from elsewhere through an SSH tunnel
DEFAULT_ON = False
COST = ("on a 2-core machine it added 11 processes, 0.94 GB of memory, 1-4 CPU-s to the start "
        "and 0.02-0.04 of a core idle; bench/dashboard_cost.py")


def local_ray_options(dashboard: bool, port: Optional[int] = None) -> Dict[str, Any]:
    """ray.init keywords of a local Ray with (or without) its dashboard, on loopback."""
    if not dashboard:
        return {"include_dashboard": False}
    return {"include_dashboard": True, "dashboard_host": DASHBOARD_HOST, "dashboard_port": port or DASHBOARD_PORT}


def dashboard_url(context: Any) -> Optional[str]:
    """The dashboard's URL from ray.init's context (a local Ray's or the cluster's), or None."""
    url = getattr(context, "dashboard_url", None)
    if not url:
        return None
    return url if "://" in url else f"http://{url}"


def announce(context: Any, local: bool) -> None:
    """Print where to watch the run: the dashboard URL (jobs, actors, metrics), or how to get one."""
    url = dashboard_url(context)
    if url:
        print(f"Ray dashboard: {url}  (the run is a job there, its engines are actors; with token auth, "
              "log in with the token in ~/.ray/auth_token)", flush=True)
    elif local:
        print("Ray dashboard: off (--dashboard turns it on for a local run)", flush=True)


__all__ = ["DASHBOARD_PORT", "DEFAULT_ON", "local_ray_options", "dashboard_url", "announce"]
