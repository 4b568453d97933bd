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
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
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

    def __init__(self, layers: Iterable[torch.nn.Module] = (), model: Optional[torch.nn.Module] = None):
        super().__init__()
        self.total = 0
        self.ops: Counter = Counter()
        self.calls: List[Dict[str, Any]] = []  # one per layer call: {"layer": i, "launches": n, "ops": Counter}
        self.forwards: List[int] = []  # launches of each call of `model` (the whole forward)
        self._open: Optional[Dict[str, Any]] = None
        self._in_model = False
        self._hooks = []
        for i, m in enumerate(layers):
            self._hooks.append(m.register_forward_pre_hook(lambda _m, _a, i=i: self._enter(i)))
            self._hooks.append(m.register_forward_hook(lambda _m, _a, _o: self._leave()))
        if model is not None:
            self._hooks.append(model.register_forward_pre_hook(lambda _m, _a: self._model(True)))
            self._hooks.append(model.register_forward_hook(lambda _m, _a, _o: self._model(False)))

    def _model(self, entering: bool) -> None:
        self._in_model = entering
        if entering:
            self.forwards.append(0)

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
            if self._in_model:
                self.forwards[-1] += 1
            if self._open is not None:
                self._open["launches"] += 1
                self._open["ops"][name] += 1
        return out

    def per_layer(self, last: Optional[int] = None) -> List[int]:
        """Launches of each layer call, in call order (the last `last` calls when given)."""
        got = [c["launches"] for c in self.calls]
        return got if last is None else got[-last:]


class CudaIndexing(TorchFunctionMode):
    """Python indexing (`t[...]`, `t[...] = v`) of tensors on a CUDA device, on a build
    without CUDA: torch's C++ indexing enters a CUDA device guard, which such a build
    cannot, so the indexing is spelled here with the aten ops a CUDA build runs for it
    (select, slice, unsqueeze, index, index_put_, copy_). What it does not handle (a
    boolean index: data-dependent; several advanced indices) is refused."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and args[0].device.type == "cuda":
            with torch._C.DisableTorchFunction():
                view, adv = _basic_index(args[0], args[1])
                if func is torch.Tensor.__getitem__:
                    return view if adv is None else torch.ops.aten.index.Tensor(view, adv)
                value = args[2]
                if adv is not None:
                    value = value if torch.is_tensor(value) else torch.tensor(value, dtype=view.dtype,
                                                                            device=view.device)
                    torch.ops.aten.index_put_(view, adv, value.to(view.dtype))
                elif torch.is_tensor(value):
                    view.copy_(value)
                else:
                    view.fill_(value)
                return None
        return func(*args, **kwargs)


def _basic_index(t: torch.Tensor, idx):
    """(the view of t's basic indexing, the advanced index list for aten.index or None)."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    out, dim, adv = t, 0, None
    for i in idx:
        if i is None:
            out, dim = out.unsqueeze(dim), dim + 1
        elif i is Ellipsis:
            dim += out.dim() - dim - (n_real - sum(1 for j in idx[:idx.index(Ellipsis)] if j is not None))
        elif isinstance(i, bool) or (torch.is_tensor(i) and i.dtype == torch.bool):
            raise NotImplementedError("boolean-mask indexing is data-dependent (a host wait on a GPU)")
        elif isinstance(i, int):
            out = out.select(dim, i)
        elif isinstance(i, slice):
            start, stop, step = i.indices(out.shape[dim])
            out, dim = torch.ops.aten.slice.Tensor(out, dim, start, max(start, stop), step), dim + 1
        else:  # an advanced index (a tensor or a list): one, as the engine uses them
            if adv is not None:
                raise NotImplementedError("several advanced indices")
            i = i if torch.is_tensor(i) else torch.tensor(i, device=out.device)
            adv, dim = [None] * dim + [i], dim + 1
    return out, adv


def fake_cuda(model: torch.nn.Module, mode) -> torch.nn.Module:
    """`model` (built on the meta device) with every parameter and buffer a FakeTensor of
    `mode` on device cuda, refused where it is not done on a build without CUDA (its
    `_apply` would ask for a CUDA device guard); fused again under the mode (DLLM.fuse_)."""
    cuda = torch.device("cuda")
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(FakeTensor(mode, p, cuda), requires_grad=False)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = FakeTensor(mode, b, cuda)
    with mode:
        model.fuse_()
    return model
