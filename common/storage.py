"""Where data lives: one fsspec filesystem for any URL (local path, file://, s3://, gs://…).

Why explicit options instead of leaving it to botocore: the filesystem object is pickled
to Ray read/write tasks on other nodes, so endpoint and credentials resolved once on the
driver (from arguments, then the usual AWS_* environment variables) travel with it and
every task talks to the same endpoint, whatever its own environment says.
"""
from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import fsspec

_S3_PROTOCOLS = ("s3", "s3a", "s3n")
# The one retry layer for object storage: botocore's "standard" mode retries every S3
# call on throttling, 5xx answers and connection errors, with exponential backoff and
# jitter (sleep before attempt k+1: random * 2**(k-1) s). 5 attempts ride out a burst of
# 500/503s (AWS's own default is 3) and give up on a dead endpoint after at most
# 1+2+4+8 = 15 s of sleeps. s3fs's own retry loop is off (SingleLayerS3FileSystem) and
# the writer does not retry on top, so a call costs at most 5 attempts, each bounded by
# s3fs's timeouts (connect 5 s, read 15 s). `extra={"config_kwargs": …}` overrides.
S3_RETRIES = {"max_attempts": 5, "mode": "standard"}


@dataclass
class StorageOptions:
    """Object-storage settings; None fields fall back to the environment
    (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    AWS_SESSION_TOKEN, AWS_DEFAULT_REGION / AWS_REGION). `extra` goes to the fsspec
    filesystem constructor unchanged (e.g. gcsfs `token=`)."""

    endpoint_url: Optional[str] = None
    key: Optional[str] = None
    secret: Optional[str] = None
    token: Optional[str] = None
    region: Optional[str] = None
    anon: bool = False
    extra: Dict[str, Any] = field(default_factory=dict)
    # Set by resolved(): the environment was read into this copy, so resolving it again
    # (a run's preflight, then its processor) returns it as it is, reading nothing.
    from_environment: bool = field(default=False, repr=False, compare=False)

    def __repr__(self) -> str:
        """Credentials never reach logs or error messages: only whether they are set."""
        def hide(v: Optional[str]) -> Optional[str]:
            return None if v is None else "***"

        extra = {k: ("***" if any(w in k.lower() for w in ("secret", "token", "key", "password", "cred")) else v)
                 for k, v in self.extra.items()}
        return (f"StorageOptions(endpoint_url={self.endpoint_url!r}, key={hide(self.key)!r}, "
                f"secret={hide(self.secret)!r}, token={hide(self.token)!r}, region={self.region!r}, "
                f"anon={self.anon!r}, extra={extra!r})")

    __str__ = __repr__

    def resolved(self, environ: Optional[Mapping[str, str]] = None) -> "StorageOptions":
        """A copy with every unset field filled from the environment (`environ`, else
        os.environ); itself when it is such a copy already and no `environ` is given:
        a run resolves its options once (pipeline/run_spec.py)."""
        if self.from_environment and environ is None:
            return self
        return self._filled(os.environ if environ is None else environ)

    def _filled(self, env: Mapping[str, str]) -> "StorageOptions":
        return StorageOptions(
            endpoint_url=self.endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
            key=self.key or env.get("AWS_ACCESS_KEY_ID"),
            secret=self.secret or env.get("AWS_SECRET_ACCESS_KEY"),
            token=self.token or env.get("AWS_SESSION_TOKEN"),
            region=self.region or env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION"),
            anon=self.anon,
            extra=dict(self.extra),
            from_environment=True,
        )

    def fsspec_kwargs(self, protocol: str) -> Dict[str, Any]:
        """Constructor kwargs for the fsspec filesystem of `protocol`."""
        if protocol not in _S3_PROTOCOLS:
            return dict(self.extra)
        opts = self._filled(os.environ)  # this process's environment fills what is still unset
        kw: Dict[str, Any] = {}
        if opts.anon:
            kw["anon"] = True
        else:
            if opts.key:
                kw["key"] = opts.key
            if opts.secret:
                kw["secret"] = opts.secret
            if opts.token:
                kw["token"] = opts.token
        if opts.endpoint_url:
            kw["endpoint_url"] = opts.endpoint_url
        if opts.region:
            kw["client_kwargs"] = {"region_name": opts.region}
        kw["config_kwargs"] = {"retries": dict(S3_RETRIES)}
        kw.update(opts.extra)
        return kw


class StorageWriteError(OSError):
    """A write to the output failed for good (after the storage client's retries, or at
    once for a permission or missing-bucket error): the message names the step, the file
    and the store's answer. An OSError, so pipeline/failures.py counts it as the user's to fix."""


def put_whole(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a small file that readers see whole or not at all, in as few requests as
    possible: one PUT on an object store (atomic there), a write then a rename on a local
    disk. For the output's bookkeeping files (the lease, the part manifest)."""
    if protocol_of(fs.unstrip_protocol(path)) != "file":
        fs.pipe_file(path, data)
        return
    os.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_whole(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """The current bytes of a small file that another writer may replace at any moment (the
    lease, the part manifest). One GET: `fs.open` would look the file up first and then read
    it on the condition that it is still that version (s3fs sends the looked-up ETag as
    If-Match), so a rewrite in between fails the read with 412 PreconditionFailed."""
    return fs.cat_file(path)


def protocol_of(url: str) -> str:
    """'s3' for s3://bucket/key, 'file' for plain paths."""
    return url.split("://", 1)[0] if "://" in url else "file"


def get_filesystem(url: str, options: Optional[StorageOptions] = None) -> Tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for `url`. Instances are not cached so that
    a test which restarts its S3 endpoint never gets a stale client."""
    options = options or StorageOptions()
    protocol = protocol_of(url)
    kwargs = options.fsspec_kwargs(protocol)
    if protocol == "file":
        url = os.path.abspath(url.split("://", 1)[-1])
    if protocol in _S3_PROTOCOLS:
        from .s3_filesystem import SingleLayerS3FileSystem  # s3fs only where S3 is used (0.4 CPU-s to import)

        fs = SingleLayerS3FileSystem(skip_instance_cache=True, **kwargs)
        return fs, fs._strip_protocol(url)
    fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **kwargs)
    return fs, path


def one_attempt(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """A client for the same store that tries each call once (S3: botocore's retries off;
    other filesystems as they are). For the bookkeeping after a run failed, when the store
    has just spent its retries: three more calls with 15 s of backoff each would turn a
    dead endpoint into a minute-long exit."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if not set(protocols) & set(_S3_PROTOCOLS):
        return fs
    options = dict(fs.storage_options)
    options["config_kwargs"] = {**options.get("config_kwargs", {}), "retries": {**S3_RETRIES, "max_attempts": 1}}
    return type(fs)(skip_instance_cache=True, **options)


def join(base: str, *parts: str) -> str:
    """Join path parts with '/', the separator of every fsspec filesystem."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def describe_error(e: BaseException, limit: int = 1500) -> str:
    """One line for an error raised inside Ray: the chain of causes under Ray's wrappers
    (RayTaskError.cause, then __cause__), each as `Type: first line`, outermost first, e.g.
    `PermissionError: Access Denied <- AccessDenied: An error occurred (AccessDenied) when
    calling the CopyObject operation: Access Denied`. Ray's own frames and tracebacks are
    left out (Ray Data logs them)."""
    parts: List[str] = []
    seen = set()
    cur: Optional[BaseException] = e
    remote, last = "", e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        inner = getattr(cur, "cause", None)
        from_ray = type(cur).__module__.startswith("ray")
        if isinstance(inner, BaseException) and from_ray:
            remote = _ANSI.sub("", str(cur))  # the remote traceback, causes included, as text
            cur = inner  # RayTaskError(X) -> X
            continue
        lines = [line.strip() for line in _ANSI.sub("", str(cur)).splitlines() if line.strip()]
        last, cur = cur, cur.__cause__
        if from_ray and not lines:
            continue  # an empty wrapper of Ray Data's (SystemException)
        for text in [f"{type(last).__name__}: {lines[0]}" if lines else type(last).__name__] + (
                # Ray's errors (ActorDiedError) end their text with the remote error's line
                [x for x in lines[1:] if _EXCEPTION_LINE.match(x)][-1:] if from_ray else []):
            if not parts or parts[-1] != text:
                parts.append(text)
    if remote and type(last).__module__.startswith("ray"):
        # Ray's own wrapper (UserCodeException: "UDF failed to process a data block.") came
        # back without its cause (a pickled exception loses __cause__): take it from the text.
        parts += [p for p in _remote_causes(remote) if p not in parts]
    return " <- ".join(parts)[:limit]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")
_CHAINED = "The above exception was the direct cause of the following exception:"


def _remote_causes(traceback_text: str) -> List[str]:
    """The exception lines (`Type: message`) of the causes in a remote traceback's text,
    outermost first (the text lists the innermost first)."""
    out = []
    for section in traceback_text.split(_CHAINED)[:-1]:
        lines = [line for line in section.splitlines() if line.strip() and not line.startswith((" ", "\t"))]
        if lines:
            out.append(lines[-1].strip())
    return out[::-1]
