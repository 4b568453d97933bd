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
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
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
    (select, slice, unsqueeze, index, index_put_, copy_). A boolean index (data-dependent)
    is refused."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and args[0].device.type == "cuda":
            with torch._C.DisableTorchFunction():
                view, adv = _basic_index(args[0], args[1])
                if func is torch.Tensor.__getitem__:
                    return view if adv is None else torch.ops.aten.index.Tensor(view, adv)
                value = args[2]  # aten ops, not Tensor methods: their bindings take a device guard too
                if adv is not None:
                    value = value if torch.is_tensor(value) else aten._to_copy.default(
                        torch.tensor(value, dtype=view.dtype), device=view.device)
                    torch.ops.aten.index_put_(view, adv, value.to(view.dtype))
                elif torch.is_tensor(value):
                    aten.copy_.default(view, value)
                else:
                    aten.fill_.Scalar(view, value)
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
        else:  # an advanced index (a tensor or a list); several index as aten.index does (numpy's rules)
            i = i if torch.is_tensor(i) else torch.tensor(i, device=out.device)
            adv = adv or []
            adv, dim = adv + [None] * (dim - len(adv)) + [i], dim + 1
    return out, adv


def fake_cuda(model: torch.nn.Module, mode) -> torch.nn.Module:
    """`model` (built on the meta device) with every parameter and buffer a FakeTensor of
    `mode` on device cuda (its `.to` would ask a build without CUDA for a CUDA device guard)."""
    cuda = torch.device("cuda")
    return on_device(model, lambda t: FakeTensor(mode, t, cuda), mode)


def on_device(module: torch.nn.Module, make, mode) -> torch.nn.Module:
    """Every parameter (frozen: inference) and buffer of `module` replaced by `make(t)` in
    place, then its weights fused again under `mode` (DLLM.fuse_), where its fused tensors
    are made from the new parameters."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(make(p.detach()), requires_grad=False)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = make(b)
    if hasattr(module, "fuse_"):
        with mode:
            module.fuse_()
    return module


# --- StandInCuda ------------------------------------------------------------------------

class _Wrapper(torch.Tensor):
    """A tensor that holds its values in `elem`, a CPU tensor, and says it is on `DEVICE`.
    Ops on it run only inside StandInCuda (which unwraps, runs and re-wraps them)."""

    DEVICE = "cuda"
    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=torch.device(cls.DEVICE), requires_grad=elem.requires_grad)

    def __init__(self, elem: torch.Tensor):
        self.elem = elem

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a stand-in cuda tensor outside StandInCuda")


class StandInTensor(_Wrapper):
    """A tensor on the stand-in CUDA device."""

    def __repr__(self) -> str:
        return f"StandInTensor({self.elem!r})"


class _Shadow(_Wrapper):
    """A StandInTensor as a cpu-device tensor for the length of one torch function call,
    whose Python binding may take a CUDA device guard (indexing, copy_) a CPU-only build
    lacks; StandInCuda treats it as a device tensor."""

    DEVICE = "cpu"


def _histc_range(a, k):
    """histc's (min, max): equal, the data's own range (read by the host)."""
    lo = k.get("min", a[2] if len(a) > 2 else 0)
    return lo, k.get("max", a[3] if len(a) > 3 else 0)


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _where(root: str = "engine") -> str:
    """The innermost frame in the project's `root` package: where a wait is made."""
    import traceback

    for f in reversed(traceback.extract_stack()[:-3]):
        path = f.filename.replace("\\", "/")
        if f"/{root}/" in path and "/torch/" not in path:
            return f"{root}/{path.rsplit(f'/{root}/', 1)[1]}:{f.lineno} {f.name}"
    return "?"


class _StandInEvent:
    """torch.cuda.Event on the stand-in: complete as soon as recorded (ForwardTimer reads
    it at a later forward), timed by the host clock."""

    def __init__(self, enable_timing: bool = False, **_):
        self.t = 0.0

    def record(self, stream=None) -> None:
        import time

        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_StandInEvent") -> float:
        return 1e3 * (end.t - self.t)


class _Functions(torch.overrides.TorchFunctionMode):
    """What a CPU-only build refuses before dispatch: `torch.tensor(..., device="cuda")`,
    `Tensor.to("cuda")`/`.cuda()` (its device check), `.tolist()` of a subclass."""

    def __init__(self, owner: "StandInCuda"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.tensor, torch.as_tensor) and _is_cuda(kwargs.get("device")):
            kwargs.pop("device")
            return aten._to_copy.default(func(*args, **kwargs), device=torch.device("cuda"))
        if func is torch.Tensor.tolist and isinstance(args[0], StandInTensor):
            self.owner.count("tolist")
            return args[0].elem.tolist()
        if func is torch.Tensor.cpu and isinstance(args[0], StandInTensor):
            return self.to(torch.Tensor.to, (args[0], "cpu"), kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            return self.to(func, args, kwargs)
        if getattr(func, "__name__", "") == "__get__":  # .device, .shape, ...: the stand-in's own
            return func(*args, **kwargs)
        shadows = {}

        def shadow(x):
            if isinstance(x, StandInTensor):
                sh = _Shadow(x.elem)
                shadows[id(sh)] = x
                return sh
            return x
        args, kwargs = tree_map(shadow, (args, kwargs))
        out = func(*args, **kwargs)
        if not shadows:
            return out
        # in place: the caller's own tensor; new: a stand-in cuda tensor
        back = lambda x: shadows.get(id(x), StandInTensor(x.elem)) if isinstance(x, _Shadow) else x  # noqa: E731
        return tree_map(back, out)

    @staticmethod
    def to(func, args, kwargs):
        src, rest = args[0], list(args[1:])
        device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
        if func is torch.Tensor.cuda:
            device = "cuda"
            rest = []
        for a in list(rest):
            if isinstance(a, (str, torch.device)):
                device = a
                rest.remove(a)
            elif isinstance(a, torch.dtype):
                dtype = a
                rest.remove(a)
            elif isinstance(a, torch.Tensor):  # .to(other)
                device, dtype = a.device, a.dtype
                rest.remove(a)
        non_blocking = bool(kwargs.pop("non_blocking", rest[0] if rest else False))
        if not _is_cuda(device):
            return func(src, *([device] if device is not None else []), *([dtype] if dtype is not None else []),
                        non_blocking=non_blocking, **kwargs)
        if isinstance(src, StandInTensor) and (dtype is None or dtype == src.dtype) and not kwargs.get("copy"):
            return src
        return aten._to_copy.default(src, device=torch.device("cuda"), dtype=dtype or src.dtype,
                                     non_blocking=non_blocking)


@contextlib.contextmanager
def cuda_runtime(synchronize):
    """torch.cuda's runtime on a CPU-only build, as far as the engine uses it: no lazy init
    (factories' device check), an H100's capability (transformers picks its kernels by it),
    host-timed events that are complete once recorded, and `synchronize` (the caller's)."""
    cuda = torch.cuda
    saved = {"Event": cuda.Event, "synchronize": cuda.synchronize, "_lazy_init": cuda._lazy_init,
             "get_device_capability": cuda.get_device_capability}
    cuda.get_device_capability = lambda device=None: (9, 0)
    cuda.Event = _StandInEvent
    cuda._lazy_init = lambda: None
    cuda.synchronize = synchronize
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(cuda, k, v)


REPEATS = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}  # data-dependent without output_size
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class StandInCuda(TorchDispatchMode):
    """A stand-in CUDA device on a CPU-only build (issue 51): tensors made for `cuda` inside
    it are StandInTensors (CPU values, device cuda), so the engine takes its CUDA paths and
    computes what it computes on the CPU, and every host wait is counted (`waits`, and
    `where`: a Counter of (kind, the engine's line) so a failing test names it):

    - `d2h`: a device tensor copied to the host (`.cpu()`, `.to("cpu")`, `.tolist()`);
    - `item`: `.item()`, `bool()`, `int()` of a device tensor (`_local_scalar_dense`);
    - `h2d`: a blocking upload: `.to("cuda")` of host memory that is not pinned or without
      `non_blocking=True` (`pin_memory()` works here and marks its result pinned);
      `torch.tensor(..., device="cuda")`; host index tensors into a device tensor;
    - `data-dependent`: ops whose output size the host learns from the device (`nonzero`,
      boolean-mask indexing, `bincount`, `unique`, `masked_select`, `repeat_interleave`
      without output_size).

    A CPU tensor (not 0-dim) in an op on device tensors raises, as on CUDA. Patched while
    active: `torch.cuda._lazy_init` (a no-op), `get_device_capability` (an H100's, (9, 0)),
    `torch.cuda.Event` (complete once recorded, host-timed) and
    `torch.cuda.synchronize` (counted as a wait); `torch.Generator(device="cuda")` is not
    stood in (rows that draw noise cannot run on it). Ops run with the CPU's kernels, so an
    op CUDA has for a dtype the CPU lacks is run in one it has (`histc` of ints, as float).
    `move(module)` puts a model on it."""

    def __init__(self, root: str = "engine"):
        super().__init__()
        self.root = root
        self.waits = 0
        self.where: Counter = Counter()
        self._pinned: List[torch.Tensor] = []  # kept alive: their storage pointers are never reused
        self._pinned_ptrs: set = set()
        self._functions = _Functions(self)
        self._runtimes: List[Any] = []

    # --- counting ---------------------------------------------------------------------
    def count(self, kind: str) -> None:
        self.waits += 1
        self.where[(kind, _where(self.root))] += 1

    def reset(self) -> None:
        self.waits = 0
        self.where = Counter()

    @contextlib.contextmanager
    def counting(self):
        """Yields a fresh Counter of the waits made inside the block (the totals go on)."""
        before = Counter(self.where)
        got: Counter = Counter()
        try:
            yield got
        finally:
            got.update(self.where - before)

    # --- entering -----------------------------------------------------------------------
    def __enter__(self):  # re-entered (on_device fuses under it): one runtime patch per entry, undone in turn
        runtime = cuda_runtime(lambda device=None: self.count("synchronize"))
        runtime.__enter__()
        self._runtimes.append(runtime)
        super().__enter__()
        self._functions.__enter__()
        return self

    def __exit__(self, *exc):
        self._functions.__exit__(*exc)
        out = super().__exit__(*exc)
        self._runtimes.pop().__exit__(*exc)
        return out

    def move(self, module: torch.nn.Module) -> torch.nn.Module:
        """`module`'s parameters (frozen: inference) and buffers on the stand-in device, in
        place, its weights fused again there (DLLM.fuse_)."""
        return on_device(module, lambda t: t if isinstance(t, StandInTensor) else StandInTensor(t), self)

    @staticmethod
    def host(t):
        """The values of a stand-in tensor (or a pytree of them), without counting."""
        return tree_map(lambda x: x.elem if isinstance(x, StandInTensor) else x, t)

    # --- dispatch -----------------------------------------------------------------------
    def _is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._pinned_ptrs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.is_pinned.default:
            return not isinstance(args[0], (StandInTensor, _Shadow)) and self._is_pinned(args[0])
        if func in (aten._pin_memory.default, aten.pin_memory.default):  # (under inference mode: undecomposed)
            out = args[0].clone()
            self._pinned.append(out)
            self._pinned_ptrs.add(out.untyped_storage().data_ptr())
            return out
        wrapped = {}
        host_tensors = []

        def unwrap(x):
            if isinstance(x, (StandInTensor, _Shadow)):
                wrapped[id(x.elem)] = x
                return x.elem
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                host_tensors.append(x)
            return x

        a, k = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        if func.overloadpacket is aten.to:  # under inference mode `to` arrives undecomposed: as _to_copy
            src = args[0]
            device = k.get("device", a[1] if func is aten.to.device else (
                a[1].device if func is aten.to.other else None))
            dtype = k.get("dtype", a[1].dtype if func is aten.to.other else next(
                (x for x in a[1:] if isinstance(x, torch.dtype)), None))
            non_blocking = k.get("non_blocking", next((x for x in a[2:] if isinstance(x, bool)), False))
            device = torch.device(device) if device is not None else src.device
            if device == src.device and (dtype is None or dtype == src.dtype) and not k.get("copy"):
                return src
            func, args, kwargs = aten._to_copy.default, (src,), dict(
                device=device, dtype=dtype or src.dtype, non_blocking=non_blocking)
            wrapped.clear()
            host_tensors.clear()
            a, k = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        to_cuda = _is_cuda(k.get("device"))
        if to_cuda:
            k["device"] = torch.device("cpu")
        on_device = bool(wrapped) or to_cuda
        if func is aten._to_copy.default and not wrapped and to_cuda:  # an upload
            if not (k.get("non_blocking") and self._is_pinned(a[0])):
                self.count("h2d")
            return StandInTensor(func(*a, **k))
        if func is aten._to_copy.default and wrapped and "device" in kwargs and not to_cuda \
                and not isinstance(args[0], _Shadow):  # a download
            self.count("d2h")
            return func(*a, **k)
        if func is aten.copy_.default and (wrapped or to_cuda):
            dst, src = args[0], args[1]
            dev = (StandInTensor, _Shadow)
            if not isinstance(dst, dev):
                self.count("d2h")
            elif isinstance(src, torch.Tensor) and not isinstance(src, dev) and src.dim() > 0:
                if not (kwargs.get("non_blocking") or (len(args) > 2 and args[2])) or not self._is_pinned(src):
                    self.count("h2d")
            func(*a, **k)
            return dst
        if wrapped:
            if func is aten._local_scalar_dense.default:
                self.count("item")
                return func(*a, **k)
            if func in DATA_DEPENDENT or (func in REPEATS and k.get("output_size") is None) or (
                    func is aten.histc.default and _histc_range(a, k)[0] == _histc_range(a, k)[1]):
                self.count(f"data-dependent {func.overloadpacket.__name__}")
            elif func in INDEXING:
                idx = a[1] if len(a) > 1 else k.get("indices")
                if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in idx):
                    self.count(f"data-dependent {func.overloadpacket.__name__} by a mask")
                if any(t is not None and id(t) in {id(h) for h in host_tensors} for t in idx):
                    self.count("h2d index")
                host_tensors = [h for h in host_tensors if all(h is not t for t in idx)]
            if host_tensors:
                raise RuntimeError(f"{func}: a host tensor {tuple(host_tensors[0].shape)} among cuda tensors "
                                   f"(at {_where(self.root)})")
        cast = None
        if wrapped and func is aten.histc.default and not a[0].is_floating_point():  # CUDA's int histc: the CPU's float
            cast, a = a[0].dtype, (a[0].float(), *a[1:])
        out = func(*a, **k)
        if cast is not None:
            out = out.to(cast)
        if not on_device:
            return out

        def wrap(x):
            if not isinstance(x, torch.Tensor) or isinstance(x, StandInTensor):
                return x
            w = wrapped.get(id(x))
            if w is not None:
                return w
            return _Shadow(x) if any(isinstance(t, _Shadow) for t in wrapped.values()) else StandInTensor(x)

        return tree_map(wrap, out)
