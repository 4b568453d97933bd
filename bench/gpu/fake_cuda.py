"""Engine steps on fake CUDA, on a CPU (issue 51, acceptance 4; what CI runs so that a lent
GPU's minutes are not spent on a crash).

`FakeCuda` runs whole `Engine.step`s of a model whose weights are FakeTensors on device
`cuda`. Device work is faked (FakeTensorMode: shapes, dtypes and devices only). Host work
runs for real, so the engine's host bookkeeping keeps its values. The step's designed read,
`Engine._fetch`, returns tokens the harness chooses and records what it was asked to read.

Anything a GPU would stall on or refuse raises instead:
- a host tensor mixed into a device op (FakeTensorMode's device check);
- a data-dependent op or `.item()`/`.tolist()` of a device tensor before the read;
- a device -> host copy other than the read.

`SdpaCalls` records every attention call's inputs, so a test can check them against the
memory-efficient kernel's constraints (engine.models.attention.efficient_refusals).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence
from unittest import mock

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from bench.counting import CudaIndexing, _Functions, cuda_runtime, fake_cuda
from engine import Engine, EngineConfig, ModelConfig, SamplingParams
from engine.models import DLLM
from engine.models.attention import efficient_refusals

aten = torch.ops.aten


class HostWait(RuntimeError):
    """The step made the host wait on the device somewhere other than its designed read."""


def _on_device(flat: Sequence[Any]) -> bool:
    return any(isinstance(x, FakeTensor) for x in flat) or any(
        isinstance(x, torch.device) and x.type == "cuda" for x in flat)


class _HostReal(TorchDispatchMode):
    """Ops on host tensors only run for real, outside FakeTensorMode, so host values stay
    values. Ops that touch a device tensor, or make one, go on to FakeTensorMode. A device
    -> host copy raises HostWait. Pinning becomes a copy, since a CPU-only build cannot pin."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._pin_memory.default, aten.pin_memory.default):
            with _disable_current_modes():
                return args[0].clone()
        flat, _ = tree_flatten((args, kwargs))
        if not _on_device(flat):
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func is aten._to_copy.default and isinstance(args[0], FakeTensor) and args[0].device.type == "cuda" \
                and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
            raise HostWait(f"a device -> host copy of {tuple(args[0].shape)} before the step's read")
        if func is aten.copy_.default and not isinstance(args[0], FakeTensor) and isinstance(args[1], FakeTensor):
            raise HostWait(f"a device -> host copy of {tuple(args[1].shape)} before the step's read")
        return func(*args, **kwargs)


class _DeviceGuards(TorchFunctionMode):
    """Tensor methods whose Python binding takes a CUDA device guard, which a CPU-only build
    cannot take, called as their aten ops (what the binding dispatches to)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and _on_device(args[:2]):
            return aten.copy_.default(args[0], args[1], bool(kwargs.get("non_blocking", args[2:3] and args[2])))
        return func(*args, **kwargs)


@dataclass
class Call:
    """One attention call's inputs, and what would keep the memory-efficient kernel off it;
    on a real GPU the backend torch picks for it (`chosen`, SDPBackend's name)."""

    q: torch.Size
    k: torch.Size
    mask: Optional[torch.Size]
    dtype: torch.dtype
    enable_gqa: bool
    refusals: List[str]
    chosen: Optional[str] = None


class SdpaCalls(TorchFunctionMode):
    """Records every F.scaled_dot_product_attention call made inside it (`calls`)."""

    def __init__(self):
        super().__init__()
        self.calls: List[Call] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            gqa = bool(kwargs.get("enable_gqa", False))
            chosen = None
            if q.device.type == "cuda" and not isinstance(q, FakeTensor):  # a CUDA build's own dispatch
                chosen = torch.nn.attention.SDPBackend(torch._fused_sdp_choice(
                    q, k, v, mask, 0.0, False, enable_gqa=gqa)).name
            self.calls.append(Call(q.shape, k.shape, None if mask is None else mask.shape, q.dtype, gqa,
                                   efficient_refusals(q, k, v, mask, gqa), chosen))
        return func(*args, **kwargs)


@dataclass
class Read:
    """The step's designed read: what it asked for (a device tensor's metadata)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


@dataclass
class FakeRun:
    """What `FakeCuda.serve` saw: the engine, every read, every attention call."""

    engine: Engine
    reads: List[Read] = field(default_factory=list)
    attention: List[Call] = field(default_factory=list)


def published_layout(family: str, layers: int = 2) -> ModelConfig:
    """`family`'s published config.json, every size as published (heads, K/V heads, head_dim,
    widths, experts, vocabulary), only `layers` layers deep. On fake CUDA the sizes cost no
    memory, and the attention inputs' shapes and strides are what a GPU gets."""
    from bench.gpu_shape import published_config

    hf = dict(published_config(family))
    hf["n_layers" if "n_layers" in hf else "num_hidden_layers"] = layers
    for k in ("layer_types", "moe_layer_freq"):  # per-layer lists
        if isinstance(hf.get(k), list):
            hf[k] = hf[k][:layers]
    return ModelConfig.from_hf(hf)


def fake_model(cfg: ModelConfig, mode: FakeTensorMode, dtype: torch.dtype = torch.bfloat16) -> DLLM:
    """A DLLM of `cfg` in `dtype` whose weights are FakeTensors of `mode` on cuda (no memory, no init)."""
    with torch.device("meta"):
        model = DLLM(cfg).to(dtype)
    return fake_cuda(model, mode)


@contextlib.contextmanager
def fake_cuda_mode(mode: FakeTensorMode, synchronize: Optional[Callable[..., None]] = None):
    """Inside it, device work is faked on `cuda` and host work is real (module docstring).
    `torch.cuda.synchronize()` raises HostWait unless `synchronize` is given (a bench's own)."""

    def stall(device=None):
        raise HostWait("torch.cuda.synchronize() before the step's read")

    with cuda_runtime(synchronize or stall), mode, _HostReal(), CudaIndexing(), _Functions(None), _DeviceGuards():
        yield


def default_tokens(read_no: int, shape: torch.Size, mask_id: int) -> torch.Tensor:
    """The read's values, standing in for what the model decodes. Every other read leaves the
    window masked (so the next step is a mid-block, cached one); the others fill it."""
    return torch.full(tuple(shape), mask_id if read_no % 2 == 0 else 7, dtype=torch.long)


@contextlib.contextmanager
def fake_engines(mode: FakeTensorMode, synchronize: Optional[Callable[..., None]] = None,
                 tokens: Callable[[int, torch.Size, int], torch.Tensor] = default_tokens):
    """A fake CUDA session for models of `mode` (`fake_model`, made before it: faster outside
    it). Yields the list of reads. Every Engine made inside runs its device work on fake CUDA.
    Its designed read (`Engine._fetch`) returns `tokens(read number, shape, mask id)` and is
    recorded, and a failing step raises rather than failing its rows. torch.cuda's memory and
    sync-debug queries answer as an idle 80 GiB device would."""
    reads: List[Read] = []

    def read(self: Engine, t: torch.Tensor) -> torch.Tensor:
        if not (isinstance(t, FakeTensor) and t.device.type == "cuda"):
            raise HostWait(f"the step's read is of a host tensor ({type(t).__name__} on {t.device})")
        self.stats.syncs += 1
        reads.append(Read(t.shape, t.dtype, t.device))
        with _disable_current_modes():
            return tokens(len(reads) - 1, t.shape, self.mcfg.mask_token_id)

    def raise_it(self: Engine, exc: Exception) -> None:  # the engine fails a step's rows and goes on: here it raises
        raise exc

    free = 80 << 30
    queries = dict(reset_peak_memory_stats=lambda device=None: None, max_memory_allocated=lambda device=None: 0,
                   mem_get_info=lambda device=None: (free, free), get_device_name=lambda device=None: "fake cuda",
                   set_sync_debug_mode=lambda mode: None, get_sync_debug_mode=lambda: 0)
    with mock.patch.multiple(torch.cuda, **queries), \
            mock.patch.multiple(Engine, _fetch=read, _log_failure=raise_it), fake_cuda_mode(mode, synchronize):
        yield reads


class FakeCuda:
    """Serve requests with `cfg`'s fake model on fake CUDA in bfloat16 (module docstring)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16):
        self.cfg, self.dtype = cfg, dtype

    def serve(self, engine_cfg: EngineConfig, prompts: Sequence[Sequence[int]], params: SamplingParams,
              max_steps: int = 64) -> FakeRun:
        """Add `prompts`, then step the engine until it is done or `max_steps` steps have run."""
        calls = SdpaCalls()
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = fake_model(self.cfg, mode, self.dtype)
        with fake_engines(mode) as reads, calls:
            run = FakeRun(Engine(model, engine_cfg), reads)
            for p in prompts:
                run.engine.add_request(list(p), params)
            for _ in range(max_steps):
                if not run.engine.has_unfinished():
                    break
                run.engine.step()
        run.attention = calls.calls
        return run


def fake_step_summary(run: FakeRun) -> Dict[str, Any]:
    """A FakeRun as JSON: steps, reads, attention calls and their refusals."""
    return {"steps": run.engine.stats.steps, "reads": len(run.reads), "syncs": run.engine.stats.syncs,
            "attention_calls": len(run.attention),
            "attention_refusals": sorted({r for c in run.attention for r in c.refusals}),
            "read_shapes": sorted({tuple(r.shape) for r in run.reads})}
