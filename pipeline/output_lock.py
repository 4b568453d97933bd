"""One writer per output: a lease object, `_lock.json`, in the output folder.

Two jobs writing one output would both skip the same done ids and both write the rest:
every id twice. The lease works wherever the output does (a local disk, S3 through
s3fs): a job writes it with a fresh token, waits `settle_s` for a racing writer's put to
land (S3 reads are strongly consistent since 2020), reads it back and goes on only if it
still holds its own token; a second job finds it and is refused, naming the holder. The
holder refreshes it every `ttl_s / 4` while it runs and removes it at the end. A holder
that is gone (killed, its node lost) stops refreshing: its lease counts as expired
`ttl_s` after the last refresh, at once when it was on this host and its process is
dead. A lease held by this very process (an earlier preflight) is taken over.

Losing it: a holder whose lease another run took over (it looked gone: its driver killed,
its node cut off), or that could not refresh it for `ttl_s` (so another run may take it),
has lost it (`OutputLock.lost`). It stops writing there: its write tasks check the lease
right before they commit a part (`LeaseGuard`, raising `LeaseLost`), the driver before
report.html and summary.json (`verify`), and the job fails naming the run that took it or
the cause. A check and a commit are two steps, so a dying run can still commit a part
just after a takeover: the part manifest (pipeline/writer.py) keeps such late parts out of
the output, so that no row is counted twice.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Optional

import fsspec

from common.storage import StorageWriteError, describe_error, one_attempt, put_whole, read_whole

logger = logging.getLogger(__name__)

LOCK_FILE = "_lock.json"
TTL_S = float(os.environ.get("BLOCKRAY_LOCK_TTL_S", "120"))


class OutputLocked(RuntimeError):
    """Another live run holds the output's lease; the message names it."""


class LeaseLost(OutputLocked):
    """This run no longer holds its output's lease (see the module docstring); the message
    names the run that took it over, or why it could not be refreshed."""


def read_lease(fs: fsspec.AbstractFileSystem, path: str) -> Optional[Dict[str, Any]]:
    """The lease at `path`, or None when there is none (or only a half-written one)."""
    fs.invalidate_cache()
    try:
        value = json.loads(read_whole(fs, path))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except ValueError:  # half-written by a local writer that died: nobody's
        return None
    return value if isinstance(value, dict) else None


def describe_holder(lease: Dict[str, Any]) -> str:
    age = time.time() - float(lease.get("heartbeat_at", 0))
    return (f"run {lease.get('run_id') or '?'} (pid {lease.get('pid')} on {lease.get('host')}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(lease.get('acquired_at', 0))))}, "
            f"last seen {age:.0f} s ago)")


def _output_url(fs: fsspec.AbstractFileSystem, lock_path: str) -> str:
    return fs.unstrip_protocol(lock_path.rsplit("/", 1)[0])


def taken_over(fs: fsspec.AbstractFileSystem, lock_path: str, lease: Dict[str, Any]) -> str:
    return (f"output {_output_url(fs, lock_path)} was taken over by {describe_holder(lease)}: this run lost its "
            f"lease ({LOCK_FILE}) and stopped writing there (two runs on one output would write its rows twice)")


@dataclass(frozen=True)
class LeaseGuard:
    """What a write task checks right before it commits a part (pickled to the Ray
    workers): the lease still holds this run's token and has not expired."""

    fs: Any
    path: str
    token: str

    def __call__(self) -> None:
        lease = read_lease(self.fs, self.path)
        if lease is None:  # removed by hand: the holder's next refresh writes it again
            return
        if lease.get("token") != self.token:
            raise LeaseLost(taken_over(self.fs, self.path, lease))
        age, ttl = time.time() - float(lease.get("heartbeat_at", 0)), float(lease.get("ttl_s", TTL_S))
        if age > ttl:
            raise LeaseLost(f"the lease on output {_output_url(self.fs, self.path)} ({LOCK_FILE}) was not refreshed "
                            f"for {age:.0f} s (it expires after {ttl:g} s): another run may take the output over, so "
                            "this run stopped writing there")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLock:
    """The lease on one output (see the module docstring)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, out_path: str, run_id: str = "", ttl_s: float = TTL_S,
                 settle_s: float = 1.0):
        self.fs, self.path = fs, f"{out_path.rstrip('/')}/{LOCK_FILE}"
        self.ttl_s, self.settle_s = ttl_s, settle_s
        self.token = uuid.uuid4().hex
        self.info = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id,
                     "acquired_at": time.time()}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.held = False
        self.lost: Optional[str] = None  # why this run no longer holds it (see the module docstring)
        self._refreshed_at = 0.0

    @property
    def writer_id(self) -> str:
        """The id the part files of this lease's run carry in their names (pipeline/writer.py)."""
        return self.token[:12]

    def guard(self) -> LeaseGuard:
        return LeaseGuard(self.fs, self.path, self.token)

    # --- reading -------------------------------------------------------------------
    def read(self) -> Optional[Dict[str, Any]]:
        return read_lease(self.fs, self.path)

    def live_holder(self, lease: Optional[Dict[str, Any]]) -> bool:
        """Whether `lease` belongs to a run that is still there (and not to this process)."""
        if not lease or lease.get("token") == self.token:
            return False
        same_host = lease.get("host") == self.info["host"]
        if same_host and lease.get("pid") == self.info["pid"]:
            return False  # this process's earlier lease: superseded
        if same_host and isinstance(lease.get("pid"), int) and not _alive(lease["pid"]):
            return False
        return time.time() - float(lease.get("heartbeat_at", 0)) <= float(lease.get("ttl_s", self.ttl_s))

    def refusal(self, lease: Dict[str, Any]) -> str:
        return (f"output {_output_url(self.fs, self.path)} is being written by "
                f"{describe_holder(lease)}: two runs on one output would write its rows twice. Wait for it to end, "
                f"choose another --output, or, if that run is gone, wait {lease.get('ttl_s', self.ttl_s):g} s for "
                f"its lease to expire (or remove {LOCK_FILE} there)")

    # --- holding ---------------------------------------------------------------------
    def check(self) -> None:
        """Raise OutputLocked when a live run holds the output (changes nothing)."""
        lease = self.read()
        if self.live_holder(lease):
            raise OutputLocked(self.refusal(lease))

    def _write(self) -> None:
        now = time.time()
        put_whole(self.fs, self.path, json.dumps({**self.info, "heartbeat_at": now, "ttl_s": self.ttl_s}).encode())
        self._refreshed_at = now

    def acquire(self) -> "OutputLock":
        """Take the lease, or raise OutputLocked naming the live holder; then keep it fresh."""
        self.check()
        self._write()
        time.sleep(self.settle_s)  # a racing writer's put lands within this
        lease = self.read()
        if not lease or lease.get("token") != self.token:
            if lease and self.live_holder(lease):
                raise OutputLocked(self.refusal(lease))
            raise OutputLocked(f"output lease {self.fs.unstrip_protocol(self.path)} was taken by another run "
                               "while this one started; choose another --output or retry")
        self.held = True
        self._thread = threading.Thread(target=self._heartbeat, name="blockray-output-lease", daemon=True)
        self._thread.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                lease = self.read()
                if lease and lease.get("token") != self.token:
                    self.lost = taken_over(self.fs, self.path, lease)
                    logger.error("%s", self.lost)
                    return
                self._write()
            except Exception as e:  # noqa: BLE001 - retried at the next beat, until the lease would expire
                if time.time() - self._refreshed_at < self.ttl_s:
                    logger.warning("could not refresh the output lease %s: %s", self.path, describe_error(e))
                    continue
                self.lost = (f"the lease on output {_output_url(self.fs, self.path)} ({LOCK_FILE}) could not be "
                             f"refreshed for {self.ttl_s:g} s, so another run may take the output over: "
                             f"{describe_error(e)}. This run stopped writing there")
                logger.error("%s", self.lost)
                return

    def after_failure(self) -> None:
        """The run failed: its last reads of the lease and the lease's removal try once each
        (common.storage.one_attempt), so a store that is gone does not hold the exit back. A
        lease left behind expires by itself, and a rerun on this host takes it at once."""
        self.fs = one_attempt(self.fs)

    def verify(self) -> None:
        """Raise LeaseLost when this run no longer holds the lease: taken over (read now) or
        not refreshed in time (found by the heartbeat). What the store raises when the lease
        cannot be read propagates."""
        if self.lost is None:
            lease = self.read()
            if lease and lease.get("token") != self.token:
                self.lost = taken_over(self.fs, self.path, lease)
        if self.lost is not None:
            raise LeaseLost(self.lost)

    def release(self, check: bool = False) -> None:
        """Stop refreshing and remove the lease if it is still this run's (idempotent). A
        removal the store refuses is logged (the lease expires by itself), or with `check`
        raised as StorageWriteError naming the lease and the store's answer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if not self.held:
            return
        self.held = False
        try:
            lease = self.read()
            if lease and lease.get("token") == self.token:
                self.fs.rm(self.path)
        except Exception as e:  # noqa: BLE001 - it expires by itself
            if check:
                raise StorageWriteError(f"removal of the output's lease {self.fs.unstrip_protocol(self.path)} "
                                        f"failed: {describe_error(e)}") from e
            logger.warning("could not remove the output lease %s: %s", self.path, e)


__all__ = ["OutputLock", "OutputLocked", "LeaseLost", "LeaseGuard", "LOCK_FILE", "TTL_S", "read_lease"]
