"""Where a model comes from: a local directory, an fsspec URL (s3://…) or a hub id.

Why a node-local cache: the engine (engine/loader.py) and the tokenizer read a local
Hugging Face style directory. A remote model is therefore copied once per node into
`$BLOCKRAY_MODEL_CACHE/<hash of the URL>` (default `~/.cache/blockray/models/…`), under
a file lock so that two actors of one node never download it twice, and verified
(every shard named by the safetensors index present, every file the size the remote
lists) before anyone loads it. The completion marker records each file's size and version
identity as the store lists it (S3's ETag), so a later start on the node checks the copy
against the remote listing (one LIST call) and fetches it again when any file changed,
even to content of the same size. Hub ids go through `huggingface_hub.snapshot_download`
(its own cache and locks, kept per commit). A hub id may name a `revision` (a branch, tag
or commit: vLLM's and transformers' `revision`), listed, read and downloaded at that
revision; the default is the repository's main branch. A revision applies to hub ids only:
a folder or an s3:// prefix has none, and one given with them is refused, not ignored.

`weights=False` fetches everything but the weights (config, tokenizer, settings): what
the driver's preflight and the tokenizer stages need, without gigabytes of weights.

Why `fingerprint` reads the source and never the cache: the driver holds a metadata-only
copy and an engine node the full one, and a record of what a run read must not differ
between the two, nor between the same files in a folder and under an s3:// prefix. The one
exception keeps that: `NodeCachedFiles` takes a small file's bytes from a node copy whose
marker records the size and store version (S3's ETag) the listing gives, the same bytes,
so that a remote model's metadata crosses the network once per run; `write_node_copy`
writes the metadata-only copy from the bytes the driver already read.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import fsspec
from filelock import FileLock

from .storage import StorageOptions, describe_error, get_filesystem, protocol_of

logger = logging.getLogger(__name__)

CACHE_ENV = "BLOCKRAY_MODEL_CACHE"
DEFAULT_CACHE = os.path.join("~", ".cache", "blockray", "models")
INDEX_FILE = "model.safetensors.index.json"
# Written last: {"files": {relative path: {"size": bytes, "version": identity}}} of the verified copy.
COMPLETE_MARKER = ".blockray-complete.json"
DOWNLOAD_LOG = "downloads.log"  # one line per download actually made (an audit trail of the cache)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_LOCK_TIMEOUT_S = 3600  # a multi-GB checkpoint on a slow link; a waiter gives up after this
_WHOLE_MAX = 2 << 20  # fingerprint: files up to this size are hashed whole…
_EDGE = 1 << 20  # …larger ones (weights) by their first and last MiB: a safetensors header and tensors at both ends


class ModelSourceError(ValueError):
    """The model cannot be found, fetched or verified; the message says what to give instead."""


class SourceKind(enum.StrEnum):
    """Where a model is read from. String values, so that JSON and `kind == "remote"` keep working."""

    LOCAL = "local"  # a directory on this machine
    REMOTE = "remote"  # an fsspec URL (s3://…), copied into the node cache
    HUB = "hub"  # a Hugging Face hub id (org/name)


@dataclass(frozen=True)
class ModelSource:
    """`spec`: the local path (file:// stripped), the URL or the hub id; `kind`: which of the three."""

    spec: str
    kind: SourceKind

    @property
    def is_local(self) -> bool:
        return self.kind is SourceKind.LOCAL


@dataclass(frozen=True)
class FileStat:
    """One file of a model as its store lists it. `version`: the store's identity of the
    content (see `_version`), "" when the listing offers none (then only the size is checked)."""

    size: int
    version: str


def classify(model: str) -> ModelSource:
    """A URL with a scheme other than file:// is remote; an existing path, or anything that
    looks like a path, is local; `org/name` that is not a local path is a hub id."""
    if "://" in model and protocol_of(model) != "file":
        return ModelSource(model, SourceKind.REMOTE)
    path = model.split("://", 1)[-1]
    if os.path.exists(path) or path.startswith(("/", ".", "~")) or not _HUB_ID.match(model):
        return ModelSource(path, SourceKind.LOCAL)
    return ModelSource(model, SourceKind.HUB)


def cache_root() -> str:
    return os.path.abspath(os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE))


def cache_dir(url: str) -> str:
    """The node-local directory a remote model is copied to: the last path component (for
    people reading the disk) and a hash of the whole URL (for uniqueness)."""
    name = re.sub(r"[^\w.-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[:40]
    return os.path.join(cache_root(), f"{name}-{hashlib.sha256(url.rstrip('/').encode()).hexdigest()[:16]}")


def _is_weight(rel: str) -> bool:
    return rel.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf"))


def _is_model_file(rel: str) -> bool:
    """Hidden files and folders (our marker, `.cache/` of `huggingface-cli download --local-dir`,
    `.gitattributes`) and lock files belong to whoever copied the model, not to the model."""
    return not any(part.startswith(".") for part in rel.split("/")) and not rel.endswith(".lock")


# Where fsspec listings put a file's version: S3 (s3fs) and Azure an ETag (S3's is the MD5 of
# a single-part upload), GCS an etag / md5Hash / generation, the hub a git blob id; times last.
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "md5", "generation", "blob_id", "mtime", "LastModified", "last_modified")


def _version(info: Mapping[str, Any]) -> str:
    """The identity of a file's content as its store reports it: the hub's LFS sha256 first,
    else the first of _VERSION_KEYS present (quotes stripped: S3 lists ETags quoted)."""
    lfs = info.get("lfs")
    if isinstance(lfs, Mapping) and lfs.get("sha256"):
        return str(lfs["sha256"])
    for key in _VERSION_KEYS:
        if info.get(key) not in (None, ""):
            return str(info[key]).strip('"')
    return ""


def _is_file(fs: fsspec.AbstractFileSystem, path: str, info: Mapping[str, Any]) -> bool:
    """A file, or a link to one (a hub snapshot folder is links to blobs; fsspec lists them as "other")."""
    return info.get("type", "file") == "file" or (bool(info.get("islink")) and fs.isfile(path))


def _hub_error(repo_id: str, doing: str, e: BaseException, revision: Optional[str] = None) -> ModelSourceError:
    at, rev = (f" at revision {revision!r}", f" --revision {revision}") if revision else ("", "")
    return ModelSourceError(
        f"model {repo_id!r} is not a local directory, and as a hub id it cannot be {doing}{at} here "
        f"({describe_error(e, limit=300)}). Download it where the hub is reachable "
        f"(`huggingface-cli download {repo_id}{rev} --local-dir DIR`) and pass --model DIR (a directory present "
        "on every engine node) or an object-storage URL (--model s3://bucket/prefix/)")


def check_revision(model: str, revision: Optional[str]) -> None:
    """A revision is a hub id's (a branch, tag or commit); with a folder or a URL it would be
    ignored, so it is refused naming both."""
    if revision is not None and classify(model).kind is not SourceKind.HUB:
        raise ModelSourceError(f"revision {revision!r} applies to hub ids only, and model {model} is "
                               f"{'a local folder' if classify(model).is_local else 'an object-storage URL'}: "
                               "it would be ignored; drop --revision (or give the hub id)")


def hub_url(repo_id: str, revision: Optional[str] = None) -> str:
    """The hf:// URL of a hub repository at `revision` (huggingface_hub's fsspec syntax,
    org/name@rev, a revision holding "/" quoted as it expects)."""
    if not revision:
        return f"hf://{repo_id}"
    from huggingface_hub.hf_file_system import safe_revision

    return f"hf://{repo_id}@{safe_revision(revision)}"


class SourceFiles:
    """A model's (or adapter's) files at its source, listed once, each file read at most
    once: the Checkpoint (engine.checkpoint) parses its small files, checks its shards'
    headers by byte range and fingerprints it from this one object. A hub id is read
    through huggingface_hub's fsspec filesystem (hf://), with its own credentials
    (HF_TOKEN), not `storage`'s. It also serves engine.models.headers' file operations
    (read a range, size, isfile, names) on paths under `root`. `revision`: a hub id's
    branch, tag or commit (see `check_revision`)."""

    def __init__(self, model: str, storage: Optional[StorageOptions] = None, revision: Optional[str] = None):
        check_revision(model, revision)
        self.model, self.source, self.revision = model, classify(model), revision
        self._whole: Dict[str, bytes] = {}
        try:
            if self.source.kind is SourceKind.HUB:
                self.fs, root = get_filesystem(hub_url(self.source.spec, revision))
            else:
                spec = os.path.expanduser(self.source.spec) if self.source.is_local else self.source.spec
                self.fs, root = get_filesystem(spec, storage)
            self.root = root.rstrip("/")
            found = self.fs.find(self.root, detail=True)
            self.files: Dict[str, FileStat] = {
                p[len(self.root) + 1:]: FileStat(int(info.get("size") or 0), _version(info))
                for p, info in found.items() if p.startswith(self.root + "/")
                and _is_model_file(p[len(self.root) + 1:]) and _is_file(self.fs, p, info)}
        except Exception as e:  # noqa: BLE001
            raise self._error("listed", e) from e

    def _error(self, doing: str, e: BaseException) -> ModelSourceError:
        if self.source.kind is SourceKind.HUB:
            return _hub_error(self.source.spec, doing, e, self.revision)
        return ModelSourceError(f"model {self.model} cannot be {doing}: {describe_error(e)}")

    def bytes(self, rel: str) -> Optional[bytes]:
        """The whole content of file `rel` (read once), or None when the model has no such file."""
        if rel not in self.files:
            return None
        if rel not in self._whole:
            try:
                self._whole[rel] = self.fs.cat_file(f"{self.root}/{rel}")
            except Exception as e:  # noqa: BLE001
                raise self._error("read", e) from e
        return self._whole[rel]

    def json(self, rel: str) -> Optional[Any]:
        """File `rel` parsed as JSON, None when absent; ValueError naming it when it is not JSON."""
        data = self.bytes(rel)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as e:
            raise ValueError(f"{rel} of model {self.model} is not valid JSON: {e}") from e

    def digest(self, rel: str) -> str:
        """sha256 of the whole file up to _WHOLE_MAX, else of its first and last _EDGE bytes,
        read as byte ranges: a multi-GB shard costs two small reads wherever it lives."""
        size = self.files[rel].size
        if size <= _WHOLE_MAX:
            return hashlib.sha256(self.bytes(rel)).hexdigest()
        h = hashlib.sha256(self.read(f"{self.root}/{rel}", 0, _EDGE))
        h.update(self.read(f"{self.root}/{rel}", size - _EDGE, size))
        return h.hexdigest()

    def fingerprint(self) -> str:
        """See `fingerprint`."""
        if not self.files:
            raise ModelSourceError(f"model {self.model} does not exist or is empty: nothing to fingerprint")
        h = hashlib.sha256()
        for rel in sorted(self.files):
            h.update(f"{rel}\0{self.files[rel].size}\0{self.digest(rel)}\n".encode())
        return h.hexdigest()

    # --- engine.models.headers' file operations, on full paths under `root` ---------------
    def read(self, path: str, start: int, end: int) -> bytes:
        rel = path[len(self.root) + 1:]
        if rel in self._whole:
            return self._whole[rel][start:end]
        try:
            return self.fs.cat_file(path, start=start, end=end)
        except Exception as e:  # noqa: BLE001
            raise self._error("read", e) from e

    def size(self, path: str) -> int:
        return self.files[path[len(self.root) + 1:]].size

    def isfile(self, path: str) -> bool:
        return path[len(self.root) + 1:] in self.files

    def names(self, path: str) -> list:
        prefix = "" if path.rstrip("/") == self.root else path[len(self.root) + 1:].rstrip("/") + "/"
        return sorted({r[len(prefix):].split("/", 1)[0] for r in self.files if r.startswith(prefix)})


def listing(model: str, storage: Optional[StorageOptions] = None, revision: Optional[str] = None
            ) -> Dict[str, FileStat]:
    """{path relative to the model folder ("/"-separated): FileStat} of every file of `model`
    (a local directory, an fsspec URL or a hub id), hidden and lock files left out; {} when
    there is nothing there. One listing call: no file is read."""
    return SourceFiles(model, storage, revision).files


def fingerprint(model: str, storage: Optional[StorageOptions] = None, revision: Optional[str] = None) -> str:
    """A sha256 (hex) naming the files of a model or adapter, read from its source (never
    from the node cache): over the files of `listing`, sorted by relative path, each one's
    path, size and digest (the sha256 of its content up to 2 MiB, else of its first and last
    MiB). The same files give the same value in a local folder, under an s3:// prefix or as
    a hub id (through hf://), and a cached copy of any extent does not change it. A change
    in the middle of a file larger than 2 MiB that keeps its size is not seen (the price of
    never reading a whole shard). A hub id needs the hub: offline or unknown,
    ModelSourceError saying how to give a local path instead. Cost: one listing, then each
    small file read whole and two 1 MiB ranges of each larger one. `revision`: a hub id's."""
    return SourceFiles(model, storage, revision).fingerprint()


# What each kind of folder must hold: a model its config.json, a PEFT adapter its adapter_config.json.
REQUIRED_FILE = {"model": "config.json", "adapter": "adapter_config.json"}


def check_listing(url: str, files: Mapping[str, FileStat], index: Optional[dict] = None, kind: str = "model") -> None:
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


def _read_index(url: str, files: Mapping[str, FileStat], storage: Optional[StorageOptions]) -> Optional[dict]:
    if INDEX_FILE not in files:
        return None
    fs, root = get_filesystem(url, storage)
    with fs.open(f"{root.rstrip('/')}/{INDEX_FILE}", "rb") as f:
        return json.load(f)


def _complete(local: str, wanted: Mapping[str, FileStat]) -> bool:
    """The copy at `local` was verified against exactly this listing: the same files, sizes and
    versions (a marker of older code, sizes only, never matches), all still there."""
    try:
        with open(os.path.join(local, COMPLETE_MARKER)) as f:
            recorded = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return isinstance(recorded, dict) and set(recorded) == set(wanted) and all(
        recorded.get(rel) == dataclasses.asdict(stat) and os.path.isfile(os.path.join(local, rel))
        and os.path.getsize(os.path.join(local, rel)) == stat.size for rel, stat in wanted.items())


def _download(url: str, wanted: Mapping[str, FileStat], local: str, storage: Optional[StorageOptions]) -> None:
    """Copy `wanted` into a fresh temporary folder beside `local`, check every size, then
    swap it in: a reader never sees a half-written model. The marker records the versions
    listed before the copy: a file replaced meanwhile is fetched again next time, never trusted."""
    fs, root = get_filesystem(url, storage)
    tmp = f"{local}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0, total = time.time(), sum(s.size for s in wanted.values())
    logger.info("downloading model %s (%d files, %.1f MB) to %s", url, len(wanted), total / 1e6, local)
    try:
        for rel in sorted(wanted):
            dest = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fs.get_file(f"{root.rstrip('/')}/{rel}", dest)
            if os.path.getsize(dest) != wanted[rel].size:
                raise ModelSourceError(f"model {url}: {rel} is {os.path.getsize(dest)} bytes after download, "
                                       f"{wanted[rel].size} remotely")
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            json.dump({"url": url, "files": {r: dataclasses.asdict(s) for r, s in wanted.items()},
                       "downloaded_at": time.time()}, f)
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
    files = listing(url, storage)
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


class NodeCachedFiles(SourceFiles):
    """SourceFiles that reads a remote model's small file from this node's verified copy
    (common.model_source.fetch_remote's, or write_node_copy's) when the copy's marker records
    the size and version the listing gives: the CLI fetches the copy (blockray.json) before
    the preflight opens the Checkpoint, and each file then crosses the network once. The
    bytes are the same (same store version), so the fingerprint is too."""

    def __init__(self, model: str, storage: Optional[StorageOptions] = None, revision: Optional[str] = None):
        super().__init__(model, storage, revision)
        self._copied = _verified_copies(self) if self.source.kind is SourceKind.REMOTE else {}

    def bytes(self, rel: str) -> Optional[bytes]:
        if rel in self._copied and rel not in self._whole:
            try:
                with open(self._copied[rel], "rb") as f:
                    data = f.read()
            except OSError:
                data = None  # the copy changed under us: read the source
            if data is not None and len(data) == self.files[rel].size:
                self._whole[rel] = data
        return super().bytes(rel)


def _copy_dirs(files: SourceFiles) -> Tuple[str, str]:
    """(the full copy, the metadata-only copy) fetch_remote keeps of this remote model."""
    full = cache_dir(files.source.spec.rstrip("/"))
    return full, full + "-meta"


def _verified_copies(files: SourceFiles) -> Dict[str, str]:
    """{relative path: local path} of the files of a node copy whose marker records the
    same FileStat as `files`' listing (a copy of an older version is left alone)."""
    found: Dict[str, str] = {}
    for folder in _copy_dirs(files):
        try:
            with open(os.path.join(folder, COMPLETE_MARKER), encoding="utf-8") as f:
                recorded = json.load(f)["files"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for rel, stat in (recorded.items() if isinstance(recorded, dict) else ()):
            if rel in files.files and stat == dataclasses.asdict(files.files[rel]):
                found.setdefault(rel, os.path.join(folder, rel))
    return found


def write_node_copy(files: SourceFiles) -> str:
    """This node's metadata-only copy of a remote model (where fetch_remote keeps it, with
    its marker, under its lock), written from the bytes `files` read (the few not read yet
    are read once here): fetch_remote finds it complete and fetches nothing. A full or
    metadata copy already verified against this listing is used as it is."""
    full, meta = _copy_dirs(files)
    wanted = {r: s for r, s in files.files.items() if not _is_weight(r)}
    os.makedirs(cache_root(), exist_ok=True)
    with FileLock(full + ".lock", timeout=_LOCK_TIMEOUT_S):
        if _complete(full, files.files):
            return full
        if _complete(meta, wanted):
            return meta
        tmp = f"{meta}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for rel in sorted(wanted):
                data, dest = files.bytes(rel) or b"", os.path.join(tmp, rel)
                if len(data) != wanted[rel].size:  # changed since it was listed: the next look-up fetches it
                    raise ModelSourceError(f"model {files.model}: {rel} is {len(data)} bytes as read, "
                                           f"{wanted[rel].size} as listed; run again")
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with open(dest, "wb") as f:
                    f.write(data)
            with open(os.path.join(tmp, COMPLETE_MARKER), "w", encoding="utf-8") as f:
                json.dump({"url": files.source.spec.rstrip("/"), "from": "the preflight's reads",
                           "files": {r: dataclasses.asdict(s) for r, s in wanted.items()}}, f)
            shutil.rmtree(meta, ignore_errors=True)
            os.replace(tmp, meta)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return meta


def fetch_hub(repo_id: str, *, weights: bool = True, revision: Optional[str] = None) -> str:
    """snapshot_download of a hub id at `revision` (None: its main branch; huggingface_hub
    keeps one snapshot folder per commit, so two revisions never share a copy); offline or
    unknown, the error says how to give a local path."""
    try:
        import huggingface_hub

        return huggingface_hub.snapshot_download(repo_id, revision=revision,
                                                 allow_patterns=None if weights else HUB_METADATA)
    except Exception as e:  # noqa: BLE001
        raise _hub_error(repo_id, "downloaded", e, revision) from e


def model_name(model: str) -> str:
    """A short name for tags and logs: the last path component of the path, URL or hub id."""
    return model.rstrip("/").rsplit("/", 1)[-1] or model


def resolve_model(model: str, storage: Optional[StorageOptions] = None, *, weights: bool = True,
                  kind: str = "model", revision: Optional[str] = None) -> str:
    """A local directory holding `model` (weights=False: at least its config, tokenizer and
    settings). Local directories are returned unchanged, without any check. `kind`
    "adapter": a PEFT adapter folder (--adapter), fetched and cached by the same rules.
    `revision`: a hub id's branch, tag or commit (refused with anything else)."""
    check_revision(model, revision)
    src = classify(model)
    if src.kind is SourceKind.REMOTE:
        return fetch_remote(src.spec, storage, weights=weights, kind=kind)
    if src.kind is SourceKind.HUB:
        return fetch_hub(src.spec, weights=weights, revision=revision)
    return src.spec


__all__ = ["ModelSource", "SourceKind", "SourceFiles", "FileStat", "ModelSourceError", "classify", "cache_dir", "cache_root",
           "resolve_model", "fetch_remote", "fetch_hub", "check_revision", "hub_url", "model_name", "listing",
           "fingerprint", "check_listing",
           "CACHE_ENV", "DOWNLOAD_LOG"]
