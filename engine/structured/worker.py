"""outlines-core's token-level index built in a child process, so that building it can be
bounded: outlines-core's `Index` walks every DFA state over every vocabulary token in
Rust, holding no lock the engine could wait on and taking no limit (measured: 69,492
states, 201 CPU-seconds, for a JSON schema with an email, a URI and a date-time field over
a 96-token vocabulary). The engine's thread waits at most `timeout_s` for the answer, then
kills the child (the next compile starts another); the child's address space is capped
(MEMORY_BYTES), so a constraint can cost the engine neither its memory nor more than that
time. The child imports only this file and outlines-core (no torch), and keeps the
vocabularies it was sent (one per engine tokenizer), so a compile sends only the regex.

Run as a script: `python worker.py READ_FD WRITE_FD`."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from multiprocessing.connection import Connection
from typing import Dict, List, Optional, Tuple

MEMORY_BYTES = 4 << 30  # the child's address space (RLIMIT_AS): outlines-core's index and the answer's lists


class CompileTimeout(TimeoutError):
    pass


class CompileFailed(ValueError):
    """outlines-core refused the regex, or the child died (its memory cap)."""


class IndexOverCap(CompileFailed):
    """The token-level index has more states than the cap."""


Result = Tuple[int, List[int], List[int], List[int], List[int]]  # initial, finals, src, token, dst


class IndexWorker:
    """One child process, started on first use and again after a timeout or a death."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._sent: set = set()
        self._lock = threading.Lock()

    def _start(self) -> None:
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(child_r), str(child_w)],
                                      pass_fds=(child_r, child_w), stdin=subprocess.DEVNULL)
        os.close(child_r), os.close(child_w)
        self._conn = _Duplex(parent_r, parent_w)
        self._sent = set()

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._conn.close()
        self._proc, self._conn = None, None

    def build(self, key: str, vocabulary: Tuple[int, Dict[bytes, List[int]]], regex: str, max_states: int,
              timeout_s: float) -> Result:
        """outlines-core's index of `regex` over `vocabulary` ((eos id, {bytes: ids}), kept
        by the child under `key`) as flat lists; CompileTimeout after `timeout_s`,
        CompileFailed with outlines-core's message or when the index has more than
        `max_states` states."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self.stop()
                self._start()
            try:
                self._conn.send((key, None if key in self._sent else vocabulary, regex, max_states))
                self._sent.add(key)
                answered = self._conn.poll(timeout_s)
                if answered:
                    status, value = self._conn.recv()
            except (EOFError, OSError):  # the child died: its memory cap, or killed
                code = self._proc.poll()
                self.stop()
                raise CompileFailed(f"the compiler process died (exit {code}; its memory is capped at "
                                    f"{MEMORY_BYTES >> 30} GiB)") from None
            if not answered:
                self.stop()
                raise CompileTimeout(f"compiling it took over {timeout_s:g} s")
            if status != "ok":
                raise (IndexOverCap if status == "over" else CompileFailed)(value)
            return value


class _Duplex:
    """A Connection pair over two pipes (read from one, write to the other)."""

    def __init__(self, r: int, w: int):
        self.r, self.w = Connection(r), Connection(w)

    def send(self, obj) -> None:
        self.w.send(obj)

    def poll(self, timeout: float) -> bool:
        return self.r.poll(timeout)

    def recv(self):
        return self.r.recv()

    def close(self) -> None:
        self.r.close(), self.w.close()


_WORKER: Optional[IndexWorker] = None
_WORKER_LOCK = threading.Lock()


def worker() -> IndexWorker:
    """The process's one IndexWorker (engines of one process share it)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = IndexWorker()
        return _WORKER


def new_key() -> str:
    return uuid.uuid4().hex


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent goes (an engine killed mid-compile
    leaves no index being built behind it)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(r: int, w: int) -> None:
    import resource

    _die_with_parent()
    from outlines_core import Index, Vocabulary

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    conn = _Duplex(r, w)
    vocabularies: Dict[str, Vocabulary] = {}
    while True:
        try:
            key, vocab, regex, max_states = conn.recv()
        except EOFError:
            return
        try:
            if vocab is not None:
                vocabularies[key] = Vocabulary(*vocab)
            index = Index(regex, vocabularies[key])
            trans = index.get_transitions()
            finals = index.get_final_states()
            n = len(set(trans) | set(finals) | {index.get_initial_state()})
            if n > max_states:
                conn.send(("over", f"its token-level index has {n:,} states"))
                continue
            src, tok, dst = [], [], []
            for s, row in trans.items():
                src.extend([s] * len(row)), tok.extend(row.keys()), dst.extend(row.values())
            conn.send(("ok", (index.get_initial_state(), list(finals), src, tok, dst)))
        except MemoryError:
            conn.send(("error", f"outlines-core ran out of its {MEMORY_BYTES >> 30} GiB"))
        except Exception as e:  # noqa: BLE001 - outlines-core's refusal, sent back as the row's
            conn.send(("error", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
