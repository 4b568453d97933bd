"""The Checkpoint: everything a run knows about its model, read once.

Why one object: a model travels from `--model` to the engines through the preflight,
the tokenize stages, the sorter, the run record, the summary and the engine actors. Each
used to open config.json on its own (about 14 times in a tiny run, three parsers that
disagreed), a remote model lost what only its files say (the sorter fell back to a crude
cost model), and the run record hashed whichever copy happened to be local. Now the
job's preflight opens the Checkpoint once, from the model source (a folder, s3://… or a
hub id: common.model_source.SourceFiles lists it and reads each small file once), and
hands it on; it is torch-free and picklable (the processor puts it in every stage's and
engine's arguments).

It holds: the source and a fingerprint of its files that does not depend on which copy
is local; config.json and generation_config.json as read; the family; the fully resolved
ModelConfig (mask, EOS, pad and stop ids with where each came from, the attention, the
--attention override applied); what the tokenizer files say; the shard headers (names,
dtypes, shapes, checked against what config.json implies); the adapter's plan. The
engine actor loads weights from it (engine.loader.load_model), the canvas engine its
generation defaults.

The tokenizer files are read once per process too: the Checkpoint parses them
(TokenizerFacts) from the same SourceFiles that fingerprints them, `load_tokenizer` hands
that parse to common.tokenizer so that only transformers' own load reads the folder again,
and a remote model's node copy (what transformers loads from) is written from the bytes
already fetched, or those bytes are read from a verified copy already on the node, so its
files cross the network once (tests/test_tokenizer_once.py counts both)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Tuple

from filelock import FileLock

from common.model_source import (COMPLETE_MARKER, ModelSource, ModelSourceError, SourceFiles, SourceKind, cache_dir,
                                 cache_root, resolve_model)
from common.model_source import _LOCK_TIMEOUT_S, _complete, _is_weight  # fetch_remote's rules for its node copies
from common.storage import StorageOptions
from common.tokenizer import load_tokenizer

from .config import Attention, enum_value
from .models.config import ModelConfig
from .models.families import Family, family_for
from .models.families.base import ConfigRefused
from .models.headers import CheckpointError, TensorInfo, check_weights
from .models.lora import AdapterError, AdapterPlan, plan_adapter
from .serving import Serving
from .models.stops import TokenizerFacts, stop_ids

CONFIG = "config.json"
GENERATION = "generation_config.json"


@dataclass
class Checkpoint:
    """See the module docstring; `Checkpoint.open` builds one."""

    model: str  # as given: a local directory, an fsspec URL or a hub id
    source: ModelSource
    storage: Optional[StorageOptions]  # of a remote model (and adapter)
    fingerprint: str  # common.model_source.fingerprint of its files
    config_sha256: str  # of config.json's bytes
    hf: Dict[str, Any]  # config.json
    generation: Dict[str, Any]  # generation_config.json ({} when it has none)
    family: Family
    config: ModelConfig  # resolved: ids, stops and attention applied
    ids: Dict[str, str]  # where mask_token_id, eos_token_id and pad_token_id came from
    stops: Dict[int, str]  # stop id -> where it came from
    tokenizer: TokenizerFacts
    tensors: Dict[str, TensorInfo] = field(default_factory=dict)  # TensorInfo.file: the shard's name
    adapter: Optional[AdapterPlan] = None
    attention: Attention = Attention.AUTO  # the override asked for (--attention)
    local_dir: Optional[str] = None  # a local model's folder, absolute
    revision: Optional[str] = None  # a hub id's branch, tag or commit (--revision); its files are read at it
    # This process's own, never pickled: the files read by `open` (a remote model's node copy
    # is written from them) and the folder metadata_dir found (another node has its own).
    _files: Optional[SourceFiles] = field(default=None, repr=False, compare=False)
    _metadata: Optional[str] = field(default=None, repr=False, compare=False)

    @classmethod
    def open(cls, model: str, *, adapter: Optional[str] = None, attention: Any = Attention.AUTO,
             storage: Optional[StorageOptions] = None, weights: bool = True,
             revision: Optional[str] = None) -> "Checkpoint":
        """Read `model`'s files once and check them; `weights=False` skips the shard headers
        (tools that need only the config). Raises ModelSourceError (cannot be listed or
        read), ConfigRefused (config.json asks for what the engine does not compute, names
        the key), CheckpointError (shards), AdapterError (the adapter does not fit)."""
        attention = enum_value("attention", attention, Attention)
        files = NodeCachedFiles(model, storage, revision)
        if files.source.is_local and not os.path.isdir(files.root):
            raise ModelSourceError(f"model {model} is not a directory")
        if not files.files:
            raise ModelSourceError(f"model {model} does not exist or is empty")
        raw = files.bytes(CONFIG)
        if raw is None:
            raise ModelSourceError(f"model {model} has no {CONFIG}")
        hf = files.json(CONFIG)
        if not isinstance(hf, dict):
            raise ConfigRefused(f"{CONFIG} of model {model} is not a JSON object")
        family = family_for(hf)
        family.check_config(hf)
        try:
            cfg = ModelConfig.parse(hf, family)
        except KeyError as e:
            raise ConfigRefused(f"{CONFIG} lacks {e}") from e
        if attention != Attention.AUTO:
            cfg = replace(cfg, dllm_attention=_override(family, attention))
        tok = TokenizerFacts.read(files)
        ids = {k: CONFIG if k in hf else f"{family.name}'s published default" for k in ("mask_token_id", "eos_token_id")}
        ids["pad_token_id"] = CONFIG if hf.get("pad_token_id") is not None else "eos_token_id (config.json names none)"
        for key, value in family.tokenizer_ids(hf, tok.tokens, tok.eos).items():
            setattr(cfg, key, value)
            ids[key] = "the tokenizer files"
        generation = files.json(GENERATION) or {}
        stops = stop_ids(hf, generation, tok)
        cfg.stop_ids = list(stops) or None
        tensors: Dict[str, TensorInfo] = {}
        if weights and family.serving.own_weights:  # else transformers' own class reads them (engine.canvas)
            found = check_weights(files.root, cfg, files)
            tensors = {k: replace(v, file=v.file[len(files.root) + 1:]) for k, v in found.items()}
        plan = None
        if adapter:
            refusal = family.serving.adapter_refusal(family, model)
            if refusal:
                raise AdapterError(refusal)
            try:
                adapter_files = SourceFiles(adapter, storage)
            except ModelSourceError as e:
                raise AdapterError(f"adapter {adapter}: {e}") from e
            plan = plan_adapter(adapter_files, cfg, family.param_shapes(cfg))
        return cls(model=model, source=files.source, storage=storage, fingerprint=files.fingerprint(),
                   config_sha256=hashlib.sha256(raw).hexdigest(), hf=hf, generation=generation, family=family,
                   config=cfg, ids=ids, stops=stops, tokenizer=tok, tensors=tensors, adapter=plan,
                   attention=attention, local_dir=files.root if files.source.is_local else None, revision=revision,
                   _files=files)

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "_files": None, "_metadata": None}

    # --- where its files are on this node ------------------------------------------------
    def metadata_dir(self) -> str:
        """A local folder holding its config and tokenizer files on this node: the model's
        own folder (as an absolute path: workers' working directories differ), or the node
        cache's copy without weights (fetched once per node; where this process opened the
        Checkpoint, written from the files it read: not fetched again)."""
        if self.local_dir:
            return self.local_dir
        if self._metadata is None:
            if self._files is not None and self.source.kind is SourceKind.REMOTE:
                self._metadata = write_node_copy(self._files)
            else:
                self._metadata = resolve_model(self.model, self.storage, weights=False, revision=self.revision)
        return self._metadata

    def load_tokenizer(self) -> Any:
        """The model's tokenizer (None: it has none), loaded from metadata_dir once per
        process (common.tokenizer.load_tokenizer) with config.json and tokenizer_config.json
        as this Checkpoint parsed them: blockray reads neither again (transformers' own load
        reads the tokenizer files, once)."""
        return load_tokenizer(self.metadata_dir(), self.hf, self.tokenizer.config)

    def weights_dir(self) -> str:
        """A local folder holding its weights on this node (a remote one downloaded once per
        node, under the node's lock, and verified)."""
        return self.local_dir or resolve_model(self.model, self.storage, revision=self.revision)

    def adapter_dir(self) -> Optional[str]:
        return None if self.adapter is None else resolve_model(self.adapter.source, self.storage, kind="adapter")

    @property
    def serving(self) -> Serving:
        return self.family.serving

    def prefix_caching(self, engine: Any) -> bool:
        """engine.enable_prefix_caching (an EngineConfig) resolved for this model as its
        engine resolves it: auto (None) is on where the cache is exact
        (engine.prefix_cache.enabled; DiffusionGemma's causal encoder: always)."""
        if self.serving.exact_prefix_cache:
            return engine.enable_prefix_caching is not False
        from .prefix_cache import enabled

        return enabled(self.family, self.config.block_causal, engine, engine.full_canvas(self.config.block_causal))

    def token_ids(self) -> Dict[str, Dict[str, Any]]:
        """{mask/eos/pad: {"id", "from"}}: the special ids the engine uses and where each came from."""
        return {k: {"id": getattr(self.config, k), "from": src} for k, src in self.ids.items()}

    def __repr__(self) -> str:
        return f"Checkpoint({self.model!r}, {self.family.name}, fingerprint {self.fingerprint[:12]})"


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


def _override(family: Family, attention: Attention) -> Attention:
    """The attention --attention asks for, where the family lets a run choose it."""
    refusal = family.serving.attention_refusal(family, attention)
    if refusal:
        raise ConfigRefused(refusal)
    return attention


__all__ = ["Checkpoint", "CheckpointError", "ModelSourceError", "SourceKind"]
