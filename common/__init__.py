"""What every layer shares, with neither torch nor Ray: storage (fsspec, S3 options),
model sources (local / s3 / hub, the node cache), the column schema between stages,
the tokenizer loader and lazy package exports. engine/, actors/ and pipeline/ import
it; it imports none of them."""
from __future__ import annotations

from .lazy import lazy_exports

_EXPORTS = {
    "StorageOptions": ".storage",
    "get_filesystem": ".storage",
    "resolve_model": ".model_source",
    "load_tokenizer": ".tokenizer",
    "OUTPUT_SCHEMA": ".schema",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
