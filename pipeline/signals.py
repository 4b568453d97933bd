"""Ctrl-C (SIGINT) and SIGTERM stop a job promptly and cleanly.

Python's default SIGINT (KeyboardInterrupt) can be swallowed by the libraries a run
spends its time in, and `ray.init` replaces SIGTERM's handler with one that exits through
Ray's C++ teardown (SIGABRT and a crash dump). The job installs its own handlers instead,
again after Ray has started: the first signal raises `Interrupted` in the main thread,
which unwinds the run (part files already committed are complete and kept), and the CLI
then removes the temporaries, shuts Ray down and exits 128 + the signal (130, 143). Should
the main thread not get there within `grace_s` (blocked in a call that never returns to
Python), a watchdog thread runs the same cleanup and exits; a second signal exits at once.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The job was asked to stop (a BaseException, as KeyboardInterrupt: an `except
    Exception` on the way does not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopOnSignal:
    """Install with `install()` (again after ray.init); `cleanup` is what the watchdog runs
    before it exits, when the main thread did not unwind in time."""

    def __init__(self, cleanup: Optional[Callable[[int], None]] = None, grace_s: float = 30.0):
        self.cleanup, self.grace_s = cleanup, grace_s
        self.signum: Optional[int] = None
        self.done = threading.Event()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            signal.signal(s, self._handle)

    def _handle(self, signum: int, frame) -> None:  # noqa: ARG002
        if self.signum is not None:  # a second signal: no more waiting
            os._exit(128 + signum)
        self.signum = signum
        threading.Thread(target=self._watchdog, name="blockray-stop", daemon=True).start()
        raise Interrupted(signum)

    def _watchdog(self) -> None:
        if self.done.wait(self.grace_s):
            return
        print(f"error: interrupted ({signal.Signals(self.signum).name}); the run did not stop within "
              f"{self.grace_s:g} s, exiting", file=sys.stderr, flush=True)
        try:
            if self.cleanup is not None:
                self.cleanup(self.signum)
        finally:
            os._exit(128 + self.signum)


def stop_cleanly(checked: Any) -> None:
    """After a stop: Ray shut down (its workers stop writing), then the temporaries under
    the output's `_tmp/` removed and the output's lease released (`checked`: the run's
    Preflight, None before it). Part files are committed whole, so those there are kept."""
    import ray

    try:
        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 - stopping anyway
        pass
    if checked is None:
        return
    from .writer import TMP_DIR, remove_empty_tmp

    tmp = f"{checked.out_path.rstrip('/')}/{TMP_DIR}"
    try:
        if checked.out_fs.exists(tmp):
            checked.out_fs.rm(tmp, recursive=True)
        remove_empty_tmp(checked.out_fs, checked.out_path)
    except Exception:  # noqa: BLE001 - the next run's preflight removes them too
        pass
    checked.release()


__all__ = ["Interrupted", "StopOnSignal", "SIGNALS", "stop_cleanly"]
