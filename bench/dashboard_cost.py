"""What the Ray dashboard costs a local run (the reason --dashboard is off by default,
pipeline/dashboard.py): ray.init time, CPU-seconds and memory of the local Ray's processes
at start, and their CPU while idle, with and without it, each in a fresh process.

    python -m bench.dashboard_cost --repeats 2 --idle-s 30   # -> bench/results/dashboard_cost.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

HZ = os.sysconf("SC_CLK_TCK")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "dashboard_cost.json")


def _stat(pid: int) -> "tuple[int, float]":
    """(parent pid, CPU seconds of the process and its reaped children) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[1]), sum(int(x) for x in rest[11:15]) / HZ


def descendants(root: int) -> list:
    kids: dict = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            kids.setdefault(_stat(int(d))[0], []).append(int(d))
        except (OSError, ValueError):
            pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def cpu_s(pids) -> float:
    total = 0.0
    for p in pids:
        try:
            total += _stat(p)[1]
        except (OSError, ValueError):
            pass
    return total


def rss_bytes(pids) -> int:
    total = 0
    for p in pids:
        try:
            total += int(open(f"/proc/{p}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            pass
    return total


def measure(dashboard: bool, idle_s: float) -> dict:
    """One local Ray (2 CPUs), in this process: its start and its idle cost."""
    import ray

    me = os.getpid()
    before = cpu_s([me])
    t0 = time.perf_counter()
    ctx = ray.init(address="local", num_cpus=2, include_dashboard=dashboard, log_to_driver=False)
    init_s = time.perf_counter() - t0
    if dashboard:  # answering (401 with token auth counts)
        while True:
            try:
                urllib.request.urlopen(f"http://{ctx.dashboard_url}/api/version", timeout=1)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                time.sleep(0.1)
    ready_s = time.perf_counter() - t0
    time.sleep(3)
    pids = descendants(me)
    c0, mem = cpu_s(pids), rss_bytes(pids)
    time.sleep(idle_s)
    c1 = cpu_s(pids)
    ray.shutdown()
    return {"dashboard": dashboard, "init_s": round(init_s, 2), "ready_s": round(ready_s, 2),
            "start_cpu_s": round(c0 - before, 2), "idle_cores": round((c1 - c0) / idle_s, 3),
            "rss_mb": round(mem / 2 ** 20), "processes": len(pids)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--idle-s", type=float, default=30.0)
    p.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)  # a child process's measurement
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(a.one == "on", a.idle_s)))
        return
    runs = []
    for _ in range(a.repeats):
        for mode in ("off", "on"):
            out = subprocess.run([sys.executable, "-m", "bench.dashboard_cost", "--one", mode, "--idle-s",
                                  str(a.idle_s)], capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(runs[-1], flush=True)
    with open(OUT, "w") as f:
        json.dump({"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "runs": runs}, f, indent=2)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
