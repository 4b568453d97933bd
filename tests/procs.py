"""Process-tree helpers for the fault tests: they find the processes of *their own* Ray
(children of its raylets), never processes by name across the machine."""
from __future__ import annotations

import os
from typing import List


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
