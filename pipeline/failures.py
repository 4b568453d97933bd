"""Whose failure stopped a run: the user's to fix, or a bug in blockray.

The CLI exits 2 with one line for the first (a JobError: storage, the model's source, the
input, an option, the user's own preprocess/postprocess, an engine that cannot be placed
or started for such a reason) and 1 for the second, with the traceback in a log file
(pipeline/cli.py). `users_to_fix` decides, from the exception the run raised.

Why by name, and from text: Ray hands the driver a wrapper (`RayTaskError`, whose `.cause`
is the original; Ray Data's `UserCodeException` around a stage's error; `ActorDiedError`
around a constructor's), and a pickled exception loses its `__cause__`, so past one hop
the original survives only in the remote traceback's text (`KeyError: 'x'`,
`botocore.exceptions.EndpointConnectionError: …`). The classes are therefore collected
from the exception chain and from the exception lines of Ray's errors' text, and compared
by qualified name, with their bases: a named class is looked up in the modules this
process has loaded, or imported when it is blockray's own or botocore's (never torch, which
the driver does not load: `torch.OutOfMemoryError` is compared by the name written there).
"""
from __future__ import annotations

import builtins
import importlib
import re
import sys
from typing import Iterator, Set, Union

# Failures of the job's environment or data, or of the user's own code: a class of the
# chain that is one of these, or derives from one, makes the failure the user's to fix.
USERS_TO_FIX = frozenset({
    # storage and files: FileNotFoundError, PermissionError, ConnectionError, TimeoutError, …
    # (s3fs raises S3's errors as these), common.storage.StorageWriteError (any write to the
    # output: part files, report.html, summary.json, the lease), EnginesNotReady
    "builtins.OSError",
    "builtins.MemoryError",  # the machine ran out of memory
    "botocore.exceptions.BotoCoreError",  # S3: endpoints, credentials, retries spent
    "botocore.exceptions.ClientError",  # S3's answer: AccessDenied, NoSuchBucket, …
    "torch.OutOfMemoryError",  # an engine that does not fit its device
    "common.model_source.ModelSourceError",  # the model cannot be found, fetched or verified
    "pipeline.errors.OptionError",  # JobError, CheckpointRefused: an option to change
    "pipeline.errors.UserFunctionError",  # the user's preprocess / postprocess raised
    "pipeline.reader.InputError",  # the input cannot be read
    "pipeline.output_lock.OutputLocked",  # another run holds the output, or took it over (LeaseLost)
    # a --tensor-parallel-size the model does not split into (compared by name: it imports torch);
    # the preflight refuses it first, an engine's load (DiffusionGemma's shards) can still raise it
    "engine.models.sharding.ShardingRefused",
})

Link = Union[type, str]  # a class of the chain, or a class name read from a remote traceback

_IMPORTABLE = ("common", "actors", "pipeline", "botocore")  # packages whose errors are imported to resolve them
# `KeyError: 'x'`, `botocore.exceptions.ClientError: …`, `ray.exceptions.RayTaskError(KeyError): …`,
# or a bare `SystemException`: a line of a traceback's text that names an exception.
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\([\w.]*\))?(?::\s|:?$)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def users_to_fix(error: BaseException) -> bool:
    """True when the failure is the user's to fix: a class of its chain (under Ray's
    wrappers, in their remote tracebacks too) is in USERS_TO_FIX, or only Ray speaks in it
    (an actor or node lost, nothing schedulable, a timeout: no other code raised). Else
    it is a bug in blockray."""
    links = list(_links(error))
    if any(_bases(link) & USERS_TO_FIX for link in links):
        return True
    return all(_name(link).startswith("ray.") for link in links)


def _links(error: BaseException) -> Iterator[Link]:
    """The classes of `error`'s chain (`__cause__`, and Ray's `.cause`), outermost first,
    with the exception classes named in the text of Ray's errors."""
    seen: Set[int] = set()
    todo = [error]
    while todo:
        cur = todo.pop(0)
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        yield type(cur)
        if _name(type(cur)).startswith("ray."):
            yield from _named_in(str(cur))
        todo += [e for e in (getattr(cur, "cause", None), cur.__cause__) if isinstance(e, BaseException)]


def _named_in(text: str) -> Iterator[str]:
    """Exception class names on the lines of a traceback's text (source lines are indented)."""
    for line in _ANSI.sub("", text).splitlines():
        m = _EXCEPTION_LINE.match(line)
        if m and (m.group(1).endswith(("Error", "Exception", "Exit", "Interrupt")) or _resolve(m.group(1))):
            yield m.group(1)


def _name(link: Link) -> str:
    if isinstance(link, str):
        return link if "." in link else f"builtins.{link}"
    return f"{link.__module__}.{link.__qualname__}"


def _bases(link: Link) -> Set[str]:
    """Qualified names of the class and its bases (only its own name when it cannot be resolved)."""
    cls = _resolve(link) if isinstance(link, str) else link
    return {_name(c) for c in cls.__mro__} if cls is not None else {_name(link)}


def _resolve(name: str) -> "type | None":
    """The exception class a traceback names: from a module this process has loaded, or
    imports cheaply (blockray's torch-free layers, botocore); None when unknown."""
    module, _, attr = name.rpartition(".")
    owner = sys.modules.get(module) if module else builtins
    if owner is None and module.split(".")[0] in _IMPORTABLE:
        try:
            owner = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - not resolvable here: compared by its name
            owner = None
    cls = getattr(owner, attr, None) if owner is not None else None
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None


__all__ = ["USERS_TO_FIX", "users_to_fix"]
