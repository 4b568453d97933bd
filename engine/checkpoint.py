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

import hashlib
import os
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional

from common.model_source import (ModelSource, ModelSourceError, NodeCachedFiles, SourceFiles, SourceKind,
                                 resolve_model, write_node_copy)
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
        found = stop_ids(hf, generation, tok)
        stops = dict(found)
        if ids["eos_token_id"] != CONFIG and generation.get("eos_token_id") is None:  # the eos no file names
            stops.setdefault(cfg.eos_token_id, ids["eos_token_id"])
        cfg.stop_ids = list(stops) if found else None  # None: the config's eos (ModelConfig.stop_token_ids)
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


def _override(family: Family, attention: Attention) -> Attention:
    """The attention --attention asks for, where the family lets a run choose it."""
    refusal = family.serving.attention_refusal(family, attention)
    if refusal:
        raise ConfigRefused(refusal)
    return attention


__all__ = ["Checkpoint", "CheckpointError", "ModelSourceError", "SourceKind"]
