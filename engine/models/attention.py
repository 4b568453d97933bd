"""The attention call of a layer, and which kernel it gets on each device (issue 51).

On the CPU a layer calls SDPA the way it always has. The boolean mask is made additive once
per forward, and GQA goes through `enable_gqa`. torch's CPU flash kernel takes both.

On CUDA, torch 2.13 picks a backend per call (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp).
The default order is flash, memory-efficient, math, cuDNN; where torch prefers cuDNN (a recent
cuDNN on Hopper), cuDNN goes first. Flash takes no mask at all. Memory-efficient takes a mask, but its 2.13 checks
want as many K/V heads as query heads. So a masked GQA call (Dream, SDAR, LLaDA2, Fast-dLLM v2)
would fall to math, which materialises the [T, K] scores in float32, unless cuDNN is preferred
and takes it. So on CUDA the call is shaped for the memory-efficient kernel, which every
family can use:

- **GQA folded into the query axis.** The g = H / H_kv query heads that share a K/V head become
  one head of g*T queries ([n, H, T, D] -> [n, H_kv, g*T, D]): the same keys per query, and no
  copy of K/V. Expanding K/V to H heads instead would copy the whole cache in every layer.
- **The additive mask folded the same way**, its rows repeated g times where rows differ. It is
  made once per forward, in storage whose rows are a multiple of `ALIGN` elements. That is the
  kernel's bias alignment; without it SDPA pads a copy of the mask at every call (preprocess_mask).
- **A run's first key rounded down to a multiple of `ALIGN`**, the bias pointer's alignment. The
  keys this adds are padding that every row of the run masks out (exp(-inf) = 0).

`efficient_refusals` transcribes the memory-efficient backend's checks: sdp_utils on sm80+ and
the kernel's own check_supported. A CPU test asserts every family's call meets them on fake
CUDA (tests/test_fake_cuda_step.py). bench/gpu/run.sh prints the backend torch actually picks on
the GPU.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

# Elements. This is the memory-efficient kernel's alignment for 16-bit inputs on sm80+ (128 bits;
# float32 needs 4), applied to the bias pointer and its row/head/batch strides. It is also
# SDPA's mask alignment (attention.cpp's preprocess_mask, torch/_inductor/lowering.py).
ALIGN = 8


def fused(device) -> bool:
    """Whether attention on `device` is shaped for a fused CUDA kernel (module docstring)."""
    return torch.device(device).type == "cuda"


def group(heads: int, kv_heads: int, device) -> int:
    """The number of query heads folded into one K/V head's query axis on `device` (1: not folded)."""
    return heads // kv_heads if fused(device) else 1


def aligned_empty(shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised tensor of `shape` whose strides, all but the last, are multiples of ALIGN:
    a view of storage whose rows are padded."""
    last = shape[-1]
    return torch.empty(*shape[:-1], -(-last // ALIGN) * ALIGN, dtype=dtype, device=device).narrow(-1, 0, last)


def is_aligned(t: torch.Tensor) -> bool:
    """Whether `t` meets the memory-efficient kernel's bias layout: last dim dense, other strides
    and the storage offset multiples of ALIGN (a dim of size 1 may have any stride)."""
    return t.stride(-1) == 1 and t.storage_offset() % ALIGN == 0 and all(
        s % ALIGN == 0 or n == 1 for s, n in zip(t.stride()[:-1], t.shape[:-1]))


def additive_mask(mask: torch.Tensor, dtype: torch.dtype, g: int = 1) -> torch.Tensor:
    """The boolean mask [B, 1, T|1, K] (True = may attend) as the additive mask attention reads
    (0 or -inf, in `dtype`). It is made once per forward; SDPA would convert a boolean mask at
    every call. On CUDA its storage is aligned, and its T rows are repeated for each of the `g`
    query heads folded together (`attend`), giving [B, 1, g*T, K]. A single row [B, 1, 1, K]
    broadcasts as it is."""
    if not fused(mask.device):
        return torch.full_like(mask, float("-inf"), dtype=dtype).masked_fill_(mask, 0.0)
    B, _, T, K = mask.shape
    g = g if T > 1 else 1
    out = aligned_empty((B, 1, g, T, K), dtype, mask.device)
    out.fill_(float("-inf")).masked_fill_(mask[:, :, None], 0.0)
    return out.view(B, 1, g * T, K)


def keep_rows(mask: torch.Tensor, keep: torch.Tensor, T: int, g: int) -> torch.Tensor:
    """The rows of `additive_mask`'s output (for a forward of T query columns, g heads folded)
    for the query columns `keep` [B, n], the last layer's. On CUDA the rows are copied into
    aligned storage, always: a test of the gather's strides would be a guard on the key
    width under torch.compile."""
    if mask.shape[2] == 1:
        return mask
    idx = keep if g == 1 else (keep[:, None, :] + T * torch.arange(g, device=keep.device)[None, :, None]).flatten(1)
    out = mask.gather(2, idx[:, None, :, None].expand(-1, 1, -1, mask.shape[-1]))
    return aligned_empty(out.shape, out.dtype, out.device).copy_(out) if fused(mask.device) else out


def key_aligned(runs: Optional[Sequence[Tuple[int, int, int]]], device) -> Optional[Sequence[Tuple[int, int, int]]]:
    """The cache runs (start, stop, first key) of a forward, each first key rounded down to a
    multiple of ALIGN on CUDA so that the run's slice of the mask starts aligned. The keys this
    adds lie before every row's first real column, so the mask gives them -inf."""
    if runs is None or not fused(device):
        return runs
    return [(a, b, k - k % ALIGN) for a, b, k in runs]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v. Takes q [n, H, T, D], k and v [n, H_kv, S, D], and the
    additive mask [n, 1, T'|1, S] (`additive_mask`'s, folded on CUDA). Returns [n, T, H, D],
    laid out as the o projection reads it. Query head h attends K/V head h // (H / H_kv), as
    `enable_gqa` defines it."""
    n, H, T, D = q.shape
    Hkv = k.shape[1]
    if H == Hkv or not fused(q.device):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv).transpose(1, 2)
    g = H // Hkv  # heads kv*g .. kv*g+g-1 share K/V head kv: one head of g*T queries (rows j*T + t)
    out = F.scaled_dot_product_attention(q.reshape(n, Hkv, g * T, D), k, v, attn_mask=mask)
    return out.view(n, Hkv, g, T, D).permute(0, 3, 1, 2, 4).flatten(2, 3)


# --- what a CUDA build would pick ------------------------------------------------------

def efficient_refusals(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                       enable_gqa: bool = False) -> List[str]:
    """Why torch 2.13's memory-efficient SDPA kernel would not run this call (nothing: it
    would), on an sm80+ GPU without autograd or dropout. Transcribed from sdp_utils.cpp's
    can_use_mem_efficient_attention and sdp_utils_cpp.h. It also includes what SDPA does to
    the mask before the kernel (attention.cpp: a boolean mask converted, a misaligned one padded:
    a copy at every call) and the kernel's check_supported (an error at run time). Only the
    tensors' metadata is read, so fake tensors can be checked."""
    out: List[str] = []
    if any(t.device.type != "cuda" for t in (q, k, v)):
        out.append("q, k and v must be on cuda")
    if not (q.dim() == k.dim() == v.dim() == 4):
        return out + [f"q, k and v must be 4-D, got {q.dim()}, {k.dim()}, {v.dim()}"]
    dtypes = {torch.float16, torch.bfloat16, torch.float32}
    if not (q.dtype == k.dtype == v.dtype and q.dtype in dtypes):
        out.append(f"q, k and v must share one of float16/bfloat16/float32, got {q.dtype}, {k.dtype}, {v.dtype}")
    align = 8 if q.dtype in (torch.float16, torch.bfloat16) else 4  # minimum_gemm_alignment, sm80+
    if q.shape[-1] != k.shape[-1] or q.shape[-1] % align or v.shape[-1] % align:
        out.append(f"head dims must be equal and multiples of {align}, got {q.shape[-1]}, {k.shape[-1]}, "
                   f"{v.shape[-1]}")
    if q.shape[2] == 0 or k.shape[2] == 0:
        out.append("sequence lengths must be nonzero")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            out.append(f"{name}'s last dim must be dense, stride {t.stride(-1)}")
        if t.storage_offset() % align:
            out.append(f"{name}'s storage offset {t.storage_offset()} is not a multiple of {align}")
    for name, t in (("q", q), ("k", k)):  # the kernel's strideM and strideH (v needs 1)
        if t.stride(2) % align or (t.shape[1] > 1 and t.stride(1) % align):
            out.append(f"{name}'s head and row strides {t.stride(1)}, {t.stride(2)} are not multiples of {align}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        out.append(f"batch sizes differ: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if not (q.shape[1] == k.shape[1] == v.shape[1]):  # 2.13: the memory-efficient kernel takes no GQA
        out.append(f"head counts differ (GQA, enable_gqa={enable_gqa}): q {q.shape[1]}, k {k.shape[1]}, "
                   f"v {v.shape[1]}")
    if mask is not None:
        if mask.dtype != q.dtype:
            out.append(f"mask dtype {mask.dtype} is not q's {q.dtype} (converted at every call, or refused)")
        want = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        n = mask.dim()
        if n not in (2, 4) or any(m not in (1, w) for m, w in zip(mask.shape[-n:], want[-n:])):
            out.append(f"mask {tuple(mask.shape)} does not broadcast to {want}")
        if not is_aligned(mask):
            out.append(f"mask strides {mask.stride()} / offset {mask.storage_offset()} are not aligned to {ALIGN} "
                       f"elements (padded into a copy at every call, or refused by the kernel)")
    return out


def backend(heads: int, kv_heads: int, device) -> str:
    """The SDPA backend a layer with these heads gets on `device`, with the inputs `attend`
    gives it: what the docs' table and bench/gpu/run.sh print."""
    if not fused(device):
        return "flash (CPU kernel), enable_gqa" if heads != kv_heads else "flash (CPU kernel)"
    g = heads // kv_heads
    return f"efficient, GQA folded x{g}" if g > 1 else "efficient"
