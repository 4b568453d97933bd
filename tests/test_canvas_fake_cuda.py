"""DiffusionGemma on fake CUDA in bfloat16 (issue 51, acceptance 4): the canvas engine's
step, its encoder work and its decoder forward included, runs under FakeTensorMode on
device cuda up to its designed read (the stopped canvases' `.tolist()` in `_denoise`),
which a fake tensor cannot answer: no CPU tensor mixed into a device op, no
data-dependent op before the read. The masked-diffusion families' forwards are checked in
tests/test_gpu_shape.py."""
from __future__ import annotations

import tempfile
import traceback

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from bench.counting import CudaIndexing, fake_cuda
from engine.canvas import CanvasEngine, CanvasParams


class _HostOnFake(TorchFunctionMode):
    """What the fake cannot hold about host memory: pinning (a page-locked copy: the same
    fake), and the host draws' generators (the rows' own CPU generators: a fake draw's
    values do not exist anyway). And the tensor methods whose Python bindings take a CUDA
    device guard, which a build without CUDA lacks (as CudaIndexing does for indexing):
    spelled with the aten op a CUDA build runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.exponential_:
            kwargs.pop("generator", None)
        if func in _GUARDED and args[0].device.type == "cuda":
            with torch._C.DisableTorchFunction():
                return _GUARDED[func](*args, **kwargs)
        return func(*args, **kwargs)


_GUARDED = {
    torch.Tensor.__invert__: torch.ops.aten.bitwise_not.default,
    torch.Tensor.copy_: torch.ops.aten.copy_.default,
    torch.Tensor.contiguous: lambda t, memory_format=torch.contiguous_format: t if t.is_contiguous(
        memory_format=memory_format) else torch.ops.aten.clone.default(t, memory_format=memory_format),
}


@pytest.fixture(scope="module")
def ckpt():
    from tiny.diffusion_gemma import build
    return build(tempfile.mkdtemp(prefix="dgemma_fake"), layers=2)


@pytest.mark.parametrize("fuse,hand", [(True, True), (False, True), (False, False)],
                         ids=["fused-pass", "encoder-then-denoiser", "transformers-modules"])
def test_canvas_step_runs_on_fake_cuda_in_bfloat16_up_to_its_read(ckpt, fuse, hand, monkeypatch):
    """Rows joining with prompts of three lengths: the step's encoder work (a fused pass, or
    an encoder call), the decoder forward (the hand-written denoiser attending the K/V
    buffer in place, or transformers' modules) and the sampling all run on fake cuda; the
    first host read is the designed one."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # transformers asks
    cfg = DiffusionGemmaConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(cfg).to(torch.bfloat16).eval()
    mode = FakeTensorMode()
    fake_cuda(model, mode)
    seen = {}
    with mode, CudaIndexing(), _HostOnFake(), torch.inference_mode():
        eng = CanvasEngine(model, CanvasParams.from_generation_config(ckpt), max_batch_size=4, fuse_encoder=fuse,
                           hand_denoiser=hand)
        assert (eng.denoiser is not None) == hand and eng.device.type == "cuda"
        denoise = eng._denoise

        def spy(raw):
            seen["logits"] = raw
            return denoise(raw)

        eng._denoise = spy
        for i in range(3):
            eng.add_request(i, [2] + list(range(5, 10 + 4 * i)), 24, 1000 + i)
        with pytest.raises(Exception) as err:  # the read: a fake holds no values
            eng.step()
    frame = traceback.extract_tb(err.value.__traceback__)
    ours = [f for f in frame if "/engine/" in f.filename.replace("\\", "/")]
    assert ours[-1].name == "_denoise" and ".tolist()" in ours[-1].line, ours[-1]
    logits = seen["logits"]
    assert logits.device.type == "cuda" and tuple(logits.shape) == (3, eng.L, eng.V)
    assert eng.encoder_forwards == 1 and eng.fused_forwards == int(fuse) and eng.row_forwards == 3
    assert all(k.device.type == "cuda" and k.dtype == torch.bfloat16 for k in eng.kv.keys)
