"""Where a model comes from: a local directory, an fsspec URL (s3://…) or a hub id.

Why a node-local cache: the engine (engine/loader.py) and the tokenizer read a local
Hugging Face style directory. A remote model is therefore copied once per node into
`$BLOCKRAY_MODEL_CACHE/<hash of the URL>` (default `~/.cache/blockray/models/…`), under
a file lock so that two actors of one node never download it twice, and verified
(every shard named by the safetensors index present, every file the size the remote
lists) before anyone loads it. A later start on the node finds the copy, checks it
against the remote listing (one LIST call) and reuses it; a changed remote is fetched
again. Hub ids go through `huggingface_hub.snapshot_download` (its own cache and locks).

`weights=False` fetches everything but the weights (config, tokenizer, settings): what
the driver's preflight and the tokenizer stages need, without gigabytes of weights.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Dict, Optional

from filelock import FileLock

from .storage import StorageOptions, describe_error, get_filesystem, protocol_of

logger = logging.getLogger(__name__)

CACHE_ENV = "BLOCKRAY_MODEL_CACHE"
DEFAULT_CACHE = os.path.join("~", ".cache", "blockray", "models")
INDEX_FILE = "model.safetensors.index.json"
COMPLETE_MARKER = ".blockray-complete.json"  # written last: {relative path: size} of the verified copy
DOWNLOAD_LOG = "downloads.log"  # one line per download actually made (an audit trail of the cache)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_LOCK_TIMEOUT_S = 3600  # a multi-GB checkpoint on a slow link; a waiter gives up after this


class ModelSourceError(ValueError):
    """The model cannot be found, fetched or verified; the message says what to give instead."""


@dataclass(frozen=True)
class ModelSource:
    """`kind`: "local" (a directory), "remote" (an fsspec URL) or "hub" (a hub id)."""

    spec: str
    kind: str

    @property
    def is_local(self) -> bool:
        return self.kind == "local"


def classify(model: str) -> ModelSource:
    """A URL with a scheme other than file:// is remote; an existing path, or anything that
    looks like a path, is local; `org/name` that is not a local path is a hub id."""
    if "://" in model and protocol_of(model) != "file":
        return ModelSource(model, "remote")
    path = model.split("://", 1)[-1]
    if os.path.exists(path) or path.startswith(("/", ".", "~")) or not _HUB_ID.match(model):
        return ModelSource(path, "local")
    return ModelSource(model, "hub")


def cache_root() -> str:
    return os.path.abspath(os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE))


def cache_dir(url: str) -> str:
    """The node-local directory a remote model is copied to: the last path component (for
    people reading the disk) and a hash of the whole URL (for uniqueness)."""
    name = re.sub(r"[^\w.-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[:40]
    return os.path.join(cache_root(), f"{name}-{hashlib.sha256(url.rstrip('/').encode()).hexdigest()[:16]}")


def _is_weight(rel: str) -> bool:
    return rel.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf"))


def remote_listing(url: str, storage: Optional[StorageOptions] = None) -> Dict[str, int]:
    """{path relative to the model folder: size in bytes} of every file under `url`."""
    try:
        fs, root = get_filesystem(url, storage)
        found = fs.find(root, detail=True)
    except Exception as e:  # noqa: BLE001
        raise ModelSourceError(f"model {url} cannot be listed: {describe_error(e)}") from e
    root = root.rstrip("/")
    return {p[len(root) + 1:]: int(info.get("size") or 0) for p, info in found.items()
            if info.get("type", "file") == "file" and p.startswith(root + "/")}


# What each kind of folder must hold: a model its config.json, a PEFT adapter its adapter_config.json.
REQUIRED_FILE = {"model": "config.json", "adapter": "adapter_config.json"}


def check_listing(url: str, files: Dict[str, int], index: Optional[dict] = None, kind: str = "model") -> None:
    """config.json (an adapter: adapter_config.json) and weights present; with a shard
    index, every shard it names present."""
    if not files:
        raise ModelSourceError(f"{kind} {url} does not exist or is empty")
    if REQUIRED_FILE[kind] not in files:
        raise ModelSourceError(f"{kind} {url} has no {REQUIRED_FILE[kind]}")
    if not any(f.endswith(".safetensors") for f in files):
        raise ModelSourceError(f"{kind} {url} holds no weights (*.safetensors)")
    if index is not None:
        missing = sorted(set(index.get("weight_map", {}).values()) - set(files))
        if missing:
            raise ModelSourceError(f"model {url}: {INDEX_FILE} names shard(s) that are missing: {missing[:5]}")


def _read_index(url: str, files: Dict[str, int], storage: Optional[StorageOptions]) -> Optional[dict]:
    if INDEX_FILE not in files:
        return None
    fs, root = get_filesystem(url, storage)
    with fs.open(f"{root.rstrip('/')}/{INDEX_FILE}", "rb") as f:
        return json.load(f)


def _complete(local: str, wanted: Dict[str, int]) -> bool:
    """The copy at `local` was verified against exactly this listing (and is still there)."""
    try:
        with open(os.path.join(local, COMPLETE_MARKER)) as f:
            recorded = json.load(f)["files"]
    except (OSError, ValueError, KeyError):
        return False
    return all(recorded.get(rel) == size and os.path.isfile(os.path.join(local, rel))
               and os.path.getsize(os.path.join(local, rel)) == size for rel, size in wanted.items())


def _download(url: str, wanted: Dict[str, int], local: str, storage: Optional[StorageOptions]) -> None:
    """Copy `wanted` into a fresh temporary folder beside `local`, check every size, then
    swap it in: a reader never sees a half-written model."""
    fs, root = get_filesystem(url, storage)
    tmp = f"{local}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0, total = time.time(), sum(wanted.values())
    logger.info("downloading model %s (%d files, %.1f MB) to %s", url, len(wanted), total / 1e6, local)
    try:
        for rel in sorted(wanted):
            dest = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fs.get_file(f"{root.rstrip('/')}/{rel}", dest)
            if os.path.getsize(dest) != wanted[rel]:
                raise ModelSourceError(f"model {url}: {rel} is {os.path.getsize(dest)} bytes after download, "
                                       f"{wanted[rel]} remotely")
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            json.dump({"url": url, "files": wanted, "downloaded_at": time.time()}, f)
        shutil.rmtree(local, ignore_errors=True)
        os.replace(tmp, local)
    except ModelSourceError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ModelSourceError(f"model {url} could not be downloaded to {local}: {describe_error(e)}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with open(os.path.join(cache_root(), DOWNLOAD_LOG), "a") as f:
        f.write(json.dumps({"url": url, "dir": local, "files": len(wanted), "bytes": total, "pid": os.getpid(),
                            "seconds": round(time.time() - t0, 3)}) + "\n")
    logger.info("model %s downloaded in %.1f s", url, time.time() - t0)


def fetch_remote(url: str, storage: Optional[StorageOptions] = None, *, weights: bool = True,
                 kind: str = "model") -> str:
    """The node-local verified copy of the model at `url` (without weights: a metadata-only
    copy, unless the full copy is already there), downloading it under the node's lock."""
    url = url.rstrip("/")
    files = remote_listing(url, storage)
    check_listing(url, files, _read_index(url, files, storage), kind)
    full = cache_dir(url)
    wanted = files if weights else {r: s for r, s in files.items() if not _is_weight(r)}
    os.makedirs(cache_root(), exist_ok=True)
    with FileLock(full + ".lock", timeout=_LOCK_TIMEOUT_S):
        if _complete(full, files):
            return full
        local = full if weights else full + "-meta"
        if not _complete(local, wanted):
            _download(url, wanted, local, storage)
        return local


HUB_METADATA = ["*.json", "*.txt", "*.model", "*.jinja", "tokenizer*"]


def fetch_hub(repo_id: str, *, weights: bool = True) -> str:
    """snapshot_download of a hub id; offline or unknown, the error says how to give a local path."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=None if weights else HUB_METADATA)
    except Exception as e:  # noqa: BLE001
        raise ModelSourceError(
            f"model {repo_id!r} is not a local directory, and as a hub id it cannot be downloaded here "
            f"({describe_error(e, limit=300)}). Download it where the hub is reachable "
            f"(`huggingface-cli download {repo_id} --local-dir DIR`) and pass --model DIR (a directory present "
            "on every engine node) or an object-storage URL (--model s3://bucket/prefix/)") from e


def model_name(model: str) -> str:
    """A short name for tags and logs: the last path component of the path, URL or hub id."""
    return model.rstrip("/").rsplit("/", 1)[-1] or model


def resolve_model(model: str, storage: Optional[StorageOptions] = None, *, weights: bool = True,
                  kind: str = "model") -> str:
    """A local directory holding `model` (weights=False: at least its config, tokenizer and
    settings). Local directories are returned unchanged, without any check. `kind`
    "adapter": a PEFT adapter folder (--adapter), fetched and cached by the same rules."""
    src = classify(model)
    if src.kind == "remote":
        return fetch_remote(src.spec, storage, weights=weights, kind=kind)
    if src.kind == "hub":
        return fetch_hub(src.spec, weights=weights)
    return src.spec


__all__ = ["ModelSource", "ModelSourceError", "classify", "cache_dir", "cache_root", "resolve_model",
           "fetch_remote", "fetch_hub", "model_name", "remote_listing", "check_listing", "CACHE_ENV", "DOWNLOAD_LOG"]
