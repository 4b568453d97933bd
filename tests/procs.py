"""Process-tree helpers for the fault tests: they find the processes of *their own* Ray
(children of its raylets), never processes by name across the machine; and the short
private temp dir each Ray those tests start gets."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple


@contextlib.contextmanager
def ray_temp_dir(prefix: str = "br-") -> Iterator[str]:
    """A fresh directory directly under /tmp (short: Ray's unix sockets live under it),
    removed with everything in it when the block ends, however it ends."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def private_ray(temp_dir: str) -> List[str]:
    """The job CLI's flags for a local Ray of its own: 2 CPUs, its session in `temp_dir`."""
    return ["--num-cpus", "2", "--temp-dir", temp_dir]


@contextlib.contextmanager
def job_ray(address: Optional[str] = None) -> Iterator[List[str]]:
    """The job CLI's Ray flags: join the Ray at `address` (conftest.ray_address), or, without
    one, a private Ray in a fresh temp dir (removed when the block ends)."""
    if address:
        yield ["--address", address]
        return
    with ray_temp_dir() as temp_dir:
        yield private_ray(temp_dir)


def children(pid: int) -> List[int]:
    """The pids whose parent is `pid` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def titles(parent: int) -> Dict[int, str]:
    """{pid: process title} of `parent`'s children; a Ray worker's title is its actor's
    class (`ray::DLLMEngineActor`, `.run_batch` appended while it runs that method)."""
    out = {}
    for pid in children(parent):
        try:
            out[pid] = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")[0]
        except OSError:
            pass
    return out


def ray_workers(*prefixes: str) -> Dict[int, str]:
    """{pid: process title} of the workers of this test's Ray (children of its raylets,
    themselves children of this process) whose title starts with one of `prefixes`."""
    return {pid: t for raylet in children(os.getpid()) for pid, t in titles(raylet).items() if t.startswith(prefixes)}


def kill_mid_run(pick: Callable[[Dict[int, str]], Optional[int]], parts: Callable[[], int],
                 prefixes: Tuple[str, ...], timeout: float = 240) -> Tuple[threading.Thread, Dict[str, float]]:
    """A thread that SIGKILLs the worker `pick` names among `ray_workers(*prefixes)` as soon
    as it names one; `killed` gets its pid, the time and `parts()` then (the part files written)."""
    killed: Dict[str, float] = {}

    def killer():
        deadline = time.time() + timeout
        while time.time() < deadline:
            pid = pick(ray_workers(*prefixes))
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed.update(pid=pid, t=time.time(), parts_before=parts())
                return
            time.sleep(0.02)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    return t, killed


def stop_group(proc: subprocess.Popen, term_grace: float) -> None:
    """Stop the process group `proc` leads (started with start_new_session) and nothing
    else: SIGTERM, then SIGKILL for whatever is left after `term_grace` seconds."""
    for sig, grace in ((signal.SIGTERM, term_grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        end = time.time() + grace
        while time.time() < end:
            proc.poll()  # reap the leader: an unreaped zombie keeps killpg(pgid, 0) succeeding
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
