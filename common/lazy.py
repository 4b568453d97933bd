"""Lazy package exports (PEP 562): a package's names are imported from their modules on
first use, so that data-side workers importing `engine.config` (dataclasses only) or
`pipeline.sorting` do not pay for torch or Ray."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict


def lazy_exports(package: str, exports: Dict[str, str]) -> Callable[[str], Any]:
    """The module-level `__getattr__` for `package`: name -> module (relative to `package`
    when it starts with a dot)."""
    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name], package), name)

    return __getattr__
