"""Whose failure stopped a run (pipeline/failures.py): the user's to fix (the CLI's exit 2)
or a bug in blockray (exit 1), decided by the exceptions under Ray's wrappers, which past
one hop survive only as a remote traceback's text. Real Ray Data failures are classified
in tests/test_hostile_inputs.py (test_stage_failures_name_their_cause, and the CLI runs of
case 9); here the rule's edges, on exceptions built in process, no Ray started."""
from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, GetTimeoutError, RayTaskError, UserCodeException

from actors.engine_router import EngineStartError, EnginesNotReady
from common.model_source import ModelSourceError
from pipeline.errors import JobError, UserFunctionError
from pipeline.failures import users_to_fix
from pipeline.reader import InputError

UDF_FAILED = "UDF failed to process a data block."
CHAINED = "\n\nThe above exception was the direct cause of the following exception:\n\n"


def remote(*sections: str) -> RayTaskError:
    """What the driver gets from a failed Ray Data task: RayTaskError(UserCodeException)
    whose cause lost its own cause, the remote traceback (innermost first) in its text."""
    frames = "\x1b[36mray::ReadRange->MapBatches(X)()\x1b[39m (pid=1, ip=127.0.0.1)\n" \
             "  File \"/x/stages.py\", line 3, in f\n    raise Boom()\n"
    text = CHAINED.join([frames + s for s in sections] + [f"ray.exceptions.UserCodeException: {UDF_FAILED}"])
    err = RayTaskError("submit", text, UserCodeException(UDF_FAILED), proctitle="ray::X", pid=1, ip="127.0.0.1")
    return err.as_instanceof_cause()


def _id(error: BaseException) -> str:
    """A test id: the innermost remote exception line, else the class and message."""
    if isinstance(error, RayTaskError):
        return "remote " + str(error).split(CHAINED)[0].splitlines()[-1][:50]
    return f"{type(error).__name__}({str(error)[:30]})" + (f" from {type(error.__cause__).__name__}"
                                                           if error.__cause__ else "")


def chained(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize("error", [
    OSError("disk full"), FileNotFoundError("weights gone"), PermissionError("denied"), ConnectionError("reset"),
    JobError("no prompt column", "prompt_column"), InputError("not Parquet"), ModelSourceError("not found"),
    UserFunctionError("your preprocess function raised KeyError: 'word'"),
    EnginesNotReady("an engine did not load its model within 3 s"),
    chained(RuntimeError("upload failed"), TimeoutError("read timed out")),  # the chain decides, not the wrapper
    chained(EngineStartError("this dispatcher's engine failed to start"), MemoryError()),
    GetTimeoutError("Timed out while starting actors."),
    ActorDiedError(),  # Ray alone: the actor's process or node was lost, nothing raised in it
    remote("FileNotFoundError: No such file or directory: /m/model.safetensors"),
    remote("pipeline.writer.StorageWriteError: upload of s3://b/part-0.parquet failed"),
    remote("OSError: inner", "Wrapper: outer"),  # a class the driver cannot resolve, raised from an OSError
    remote("ray.exceptions.ActorDiedError: The actor died because of an error raised in its creation task\n"
           "Traceback (most recent call last):\n  File \"x.py\", line 1, in __init__\n"
           "torch.OutOfMemoryError: CUDA out of memory.", "actors.engine_router.EngineStartError: failed to start"),
], ids=lambda e: _id(e))
def test_the_users_to_fix(error):
    assert users_to_fix(error)


@pytest.mark.parametrize("error", [
    AttributeError("'NoneType' object has no attribute 'decode'"), KeyError("shard 3"), ValueError("bad"),
    chained(RuntimeError("oops"), ZeroDivisionError()),
    chained(EngineStartError("this dispatcher's engine failed to start"), AttributeError("no attribute 'float17'")),
    remote("KeyError: 'shard 3'"),
    remote("ray.exceptions.RayTaskError(AttributeError): \x1b[36mray::Eng.run()\x1b[39m (pid=2)\n"
           "  File \"x.py\", line 9, in run\n    x.y\nAttributeError: eng attr"),
    remote("ray.exceptions.ActorDiedError: The actor died because of an error raised in its creation task\n"
           "TypeError: __init__() missing 1 required positional argument",
           "actors.engine_router.EngineStartError: this dispatcher's engine failed to start"),
    # an OSError mentioned in a message or in source lines is not a class of the chain
    remote("IndexError: list index out of range (after an OSError: retried)"),
], ids=lambda e: _id(e))
def test_bugs(error):
    assert not users_to_fix(error)
