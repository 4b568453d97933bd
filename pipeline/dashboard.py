"""The Ray dashboard of a run: whether a local Ray starts one, on which port, and where
to open it.

Off by default for a local Ray, by measurement on a 2-core machine (idle, 2 CPUs, token
auth on; README "Watching a run"): the dashboard adds 11 processes, about 0.9 GB of
memory, 3-4 CPU-seconds and 8-18 s of wall time to a local Ray's start, and about 0.035
of a core while idle. Every local run would pay that for a page few of them open; a run
against a cluster (--address, `ray job submit`) uses the cluster's dashboard as before.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

DASHBOARD_PORT = 8265  # Ray's own default
DASHBOARD_HOST = "127.0.0.1"  # loopback only: reach it from elsewhere through an SSH tunnel
DEFAULT_ON = False
COST = ("a 2-core machine measured +0.9 GB memory, +3-4 CPU-s and +8-18 s at start-up, "
        "+0.035 core idle")


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
