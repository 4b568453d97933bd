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
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Dict, Optional

import fsspec

from common.storage import protocol_of

logger = logging.getLogger(__name__)

LOCK_FILE = "_lock.json"
TTL_S = float(os.environ.get("BLOCKRAY_LOCK_TTL_S", "120"))


class OutputLocked(RuntimeError):
    """Another live run holds the output's lease; the message names it."""


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

    # --- reading -------------------------------------------------------------------
    def read(self) -> Optional[Dict[str, Any]]:
        self.fs.invalidate_cache()
        try:
            with self.fs.open(self.path, "rb") as fh:
                value = json.loads(fh.read())
        except (FileNotFoundError, NotADirectoryError):
            return None
        except ValueError:  # half-written by a local writer that died: nobody's
            return None
        return value if isinstance(value, dict) else None

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

    def describe(self, lease: Dict[str, Any]) -> str:
        age = time.time() - float(lease.get("heartbeat_at", 0))
        return (f"run {lease.get('run_id') or '?'} (pid {lease.get('pid')} on {lease.get('host')}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(lease.get('acquired_at', 0))))}, "
                f"last seen {age:.0f} s ago)")

    def refusal(self, lease: Dict[str, Any]) -> str:
        return (f"output {self.fs.unstrip_protocol(self.path.rsplit('/', 1)[0])} is being written by "
                f"{self.describe(lease)}: two runs on one output would write its rows twice. Wait for it to end, "
                f"choose another --output, or, if that run is gone, wait {lease.get('ttl_s', self.ttl_s):g} s for "
                f"its lease to expire (or remove {LOCK_FILE} there)")

    # --- holding ---------------------------------------------------------------------
    def check(self) -> None:
        """Raise OutputLocked when a live run holds the output (changes nothing)."""
        lease = self.read()
        if self.live_holder(lease):
            raise OutputLocked(self.refusal(lease))

    def _write(self) -> None:
        data = json.dumps({**self.info, "heartbeat_at": time.time(), "ttl_s": self.ttl_s}).encode()
        if protocol_of(self.fs.unstrip_protocol(self.path)) == "file":  # a rename: readers see all or nothing
            parent = self.path.rsplit("/", 1)[0]
            os.makedirs(parent, exist_ok=True)
            tmp = f"{self.path}.{self.token}"
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, self.path)
        else:  # one PUT: atomic on an object store
            self.fs.pipe_file(self.path, data)

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
                    logger.error("the lease on %s was taken over by %s", self.path, self.describe(lease))
                    return
                self._write()
            except Exception as e:  # noqa: BLE001 - retried at the next beat, well before it expires
                logger.warning("could not refresh the output lease %s: %s", self.path, e)

    def release(self) -> None:
        """Stop refreshing and remove the lease if it is still this run's (idempotent)."""
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
            logger.warning("could not remove the output lease %s: %s", self.path, e)


__all__ = ["OutputLock", "OutputLocked", "LOCK_FILE", "TTL_S"]
