"""Host -> device uploads that do not stall the host (issue 51): on CUDA a copy from
pageable memory, or one without non_blocking, waits for the device to drain."""
from __future__ import annotations

from typing import List

import torch


def indices(values, device, dtype=torch.long) -> torch.Tensor:
    """A host list (of ints, floats, bools) as a tensor on `device`, uploaded without a wait."""
    return to_device([torch.tensor(values, dtype=dtype)], device)[0]


def to_device(parts: List[torch.Tensor], device) -> List[torch.Tensor]:
    """Host tensors of one dtype on `device` in one copy, pinned and non-blocking on CUDA
    (pin_memory copies, so the host tensors may be reused at once)."""
    host = torch.cat([t.reshape(-1) for t in parts]) if len(parts) > 1 else parts[0].reshape(-1)
    if torch.device(device).type == "cuda":
        up = host.pin_memory().to(device, non_blocking=True)
    else:
        up = host.to(device)
    return [u.view(t.shape) for u, t in zip(up.split([t.numel() for t in parts]), parts)]
