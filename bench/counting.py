"""Counting what a GPU would see, on a CPU (issue 51): kernel launches per layer and host
waits per step, as tested properties rather than guesses.

- `LaunchCounter`: a dispatch mode that sees every aten op below autograd (composite ops
  already decomposed) and counts those that launch a kernel on a GPU: views, metadata
  and allocation ops launch none; a D2H read is a copy and a wait, counted as a wait by
  `StandInCuda`. With `layers` (the model's Layer modules) the ops are booked to the
  layer that issued them (`per_layer`).
- `StandInCuda`: a stand-in CUDA device. Tensors made for `cuda` are CPU tensors with real
  values wrapped in a subclass whose `.device` says cuda, so the engine takes its CUDA
  paths (pinned non-blocking uploads, overlap) and computes the same tokens; every host
  wait is counted: a D2H copy, `.item()`/`.tolist()` (`_local_scalar_dense`), a blocking
  H2D copy (from memory not pinned, or without non_blocking), and the data-dependent ops
  whose output size the host must learn (`nonzero`, boolean-mask indexing, `bincount`,
  `unique`, `masked_select`, `repeat_interleave` without output_size).
"""
from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from typing import Any, Dict, Iterable, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing
from torch.utils._pytree import tree_map

aten = torch.ops.aten

# ops that launch no kernel on a GPU: allocations, metadata, aliasing
NO_KERNEL = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.detach.default, aten.lift_fresh.default, aten.alias.default,
    aten._local_scalar_dense.default, aten.is_pinned.default, aten._pin_memory.default, aten.set_.source_Storage,
    aten.set_.source_Storage_storage_offset, aten.resize_.default, aten.sym_size.int, aten.sym_stride.int,
    aten.sym_numel.default, aten.sym_storage_offset.default, aten.is_same_size.default, aten._unsafe_view.default,
}

# ops that one CUDA kernel runs whole, composite on a CPU (where they decompose)
FUSED_ON_CUDA = {aten._fused_rms_norm.default}

# data-dependent ops: the host learns an output size from the device (a wait on a GPU)
DATA_DEPENDENT = {
    aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default, aten.bincount.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten.histc.default,
    aten.nonzero_numpy.default,
}
DATA_DEPENDENT.discard(aten.nonzero_static.default)  # static output size: no wait


def composite(func) -> bool:
    """An op with a CompositeImplicitAutograd kernel: a decomposition into other aten ops,
    which under inference mode reaches a dispatch mode undecomposed."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def launches_kernel(func) -> bool:
    """Whether aten op `func` launches a kernel on a GPU."""
    return not (func.is_view or func in NO_KERNEL)


class LaunchCounter(TorchDispatchMode):
    """Counts the kernel-launching aten ops run inside it (`total`, `ops` by name); with
    `layers`, books each to the layer module that issued it (`per_layer`, one list per
    call of each layer)."""

    def __init__(self, layers: Iterable[torch.nn.Module] = ()):
        super().__init__()
        self.total = 0
        self.ops: Counter = Counter()
        self.calls: List[Dict[str, Any]] = []  # one per layer call: {"layer": i, "launches": n, "ops": Counter}
        self._open: Optional[Dict[str, Any]] = None
        self._hooks = []
        for i, m in enumerate(layers):
            self._hooks.append(m.register_forward_pre_hook(lambda _m, _a, i=i: self._enter(i)))
            self._hooks.append(m.register_forward_hook(lambda _m, _a, _o: self._leave()))

    def _enter(self, i: int) -> None:
        self._open = {"layer": i, "launches": 0, "ops": Counter()}

    def _leave(self) -> None:
        self.calls.append(self._open)
        self._open = None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self):
        self._depth = getattr(self, "_depth", 0) + 1  # re-entered to count a composite op's parts
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if not self._depth:
            self.close()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if composite(func) and func not in FUSED_ON_CUDA:  # what it runs is what a GPU launches: count its parts
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if launches_kernel(func):
            name = str(func.overloadpacket.__name__)
            self.total += 1
            self.ops[name] += 1
            if self._open is not None:
                self._open["launches"] += 1
                self._open["ops"][name] += 1
        return out

    def per_layer(self, last: Optional[int] = None) -> List[int]:
        """Launches of each layer call, in call order (the last `last` calls when given)."""
        got = [c["launches"] for c in self.calls]
        return got if last is None else got[-last:]
