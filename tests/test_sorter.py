"""Tests for pipeline.sorting's cost side: cells per cache mode and canvas as the engine
forwards them, the roofline built from the engine's ModelConfig with the engine's dtype,
and that none of it imports torch into a data worker."""
from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from pipeline.sorting import (CACHE_MODES, CPU, H200, CostModel, ModelProfile, Roofline, blocks, dtype_bytes,
                              model_config_class, read_model_config, work)

LLADA_CFG = dict(model_type="llada", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                 mlp_hidden_size=12288, vocab_size=126464, embedding_size=126464)
DREAM_CFG = dict(model_type="Dream", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, torch_dtype="bfloat16")
LLADA = ModelProfile.from_config(LLADA_CFG, device="cuda")


def test_sorting_package_imports_no_torch():
    """Every name of the package, the roofline built from a config and a pickled profile
    unpickled in a fresh process: no torch (data workers must not pay for it)."""
    code = ("import pickle, sys; import pipeline.sorting as s\n"
            "[getattr(s, n) for n in s.__all__]\n"
            f"m = s.ModelProfile.from_config({DREAM_CFG!r})\n"
            "pickle.loads(pickle.dumps(m)).kv_bytes_per_token()\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_one_model_config_class_and_kv_formula():
    """The sorter reads the engine's ModelConfig (the same class once the engine is
    imported) and its K/V-size formula, with the dtype the engine actor loads."""
    from engine.models import ModelConfig

    assert model_config_class() is ModelConfig
    cfg = ModelConfig.from_hf(DREAM_CFG)
    dream = ModelProfile.from_config(DREAM_CFG, dtype="auto", device="cuda")
    assert dream.config == cfg and dream.bytes_per_element == 2
    assert dream.kv_bytes_per_token() == cfg.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2
    assert ModelProfile.from_config(DREAM_CFG, dtype="auto", device="cpu").bytes_per_element == 4
    assert ModelProfile.from_config(DREAM_CFG, dtype="float16", device="cpu").bytes_per_element == 2
    assert pickle.loads(pickle.dumps(dream)).kv_bytes_per_token() == dream.kv_bytes_per_token()


def test_dtype_bytes_match_the_engine_actor():
    import torch

    from actors.engine_build import resolve_dtype

    for dtype in ("auto", "float32", "bfloat16", "float16"):
        for device in ("cpu", "cuda"):
            assert dtype_bytes(dtype, device) == resolve_dtype(dtype, torch.device(device)).itemsize
    with pytest.raises(ValueError):
        dtype_bytes("int3")


def test_read_model_config_from_dir_dict_and_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLADA_CFG))
    a, b = read_model_config(str(tmp_path)), read_model_config(LLADA_CFG)
    assert a == b and read_model_config(a) is a
    assert (a.hidden_size, a.n_layers, a.n_kv_heads, a.head_dim) == (4096, 32, 32, 128)
    with pytest.raises(ValueError, match="not a directory"):  # engine.checkpoint's ModelSourceError
        read_model_config(str(tmp_path / "missing"))


# --------------------------------------------------------------------------- cells per cache mode


def _closed_form(p, K, L, S, cache, full):
    """Cells in closed form (the engine's account, written out by hand)."""
    if full:
        w = p + K * L
        if cache == "none":
            return K * S * w
        if cache == "dual":
            return K * w + K * (S - 1) * L
        return K * w + (S - 1) * L * K * (K + 1) / 2
    sum_w = K * p + L * K * (K + 1) / 2
    if cache == "none":
        return S * sum_w
    if cache == "persistent":
        return p + K * S * L + (K - 1) * L
    return sum_w + K * (S - 1) * L


@pytest.mark.parametrize("cache", CACHE_MODES)
@pytest.mark.parametrize("full", [False, True])
def test_work_cells_match_closed_forms(cache, full):
    p, K = np.array([0.0, 5, 17, 100, 3]), np.array([1.0, 2, 3, 7, 12])
    got = work(p, K, 8, 4, cache, full)
    assert np.allclose(got.cells, _closed_form(p, K, 8, 4, cache, full))
    assert (got.pairs >= got.cells).all() and (got.kv_columns > 0).all()


def _engine_cells(cache: str, canvas: str, prompt_len: int, max_new: int, L: int, S: int) -> int:
    """Cells the real engine forwards for one request alone (no padding, no early stop)."""
    import torch

    from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model

    torch.set_num_threads(1)
    mc = ModelConfig.tiny("llada", dllm_attention="block_causal" if cache == "persistent" else "bidirectional")
    eng = Engine(build_model(mc, dtype=torch.float32, seed=0),
                 EngineConfig(block_length=L, steps_per_block=S, cache=cache, canvas=canvas, max_batch_size=4))
    out = eng.generate([[5 + i % 40 for i in range(prompt_len)]],
                       SamplingParams(max_new_tokens=max_new, policy="fixed", stop_token_ids=[]))
    assert out[0].error is None and out[0].num_blocks == math.ceil(max_new / L)
    assert eng.stats.padded_cells == 0
    return eng.stats.computed_cells


@pytest.mark.parametrize("cache,canvas", [("none", "block"), ("refresh", "block"), ("dual", "block"),
                                          ("persistent", "block"), ("none", "full"), ("refresh", "full"),
                                          ("dual", "full")])
def test_cost_model_counts_the_cells_the_engine_forwards(cache, canvas):
    """CostModel's cells are the engine's computed_cells, per cache mode and canvas."""
    p, g, L, S = 11, 24, 8, 4
    cm = CostModel(a=0.0, b=1.0, block_length=L, steps_per_block=S, cache=cache, full_canvas=canvas == "full")
    assert float(cm.times(np.array([p]), np.array([g]))[0]) == _engine_cells(cache, canvas, p, g, L, S)


# --------------------------------------------------------------------------- roofline


def _brute_force(p, g, m: ModelProfile, L, S):
    """Cycle-by-cycle FLOPs and K/V bytes, refresh cache, block canvas."""
    flops = kv = 0.0
    for b in range(math.ceil(g / L)):
        w = p + (b + 1) * L
        flops += m.linear_flops_per_token() * w + m.attention_flops_per_pair() * w * w
        kv += m.kv_bytes_per_token() * w
        for _ in range(S - 1):
            flops += m.linear_flops_per_token() * L + m.attention_flops_per_pair() * L * w
            kv += m.kv_bytes_per_token() * (w + L)
        flops += m.head_flops_per_token() * S * L
    return flops, kv


@pytest.mark.parametrize("p,g,L,S", [(1, 1, 32, 32), (100, 64, 32, 8), (777, 300, 16, 4), (5, 33, 32, 1)])
def test_roofline_matches_cycle_by_cycle_sum(p, g, L, S):
    est = Roofline(LLADA, H200, L, S).estimate(np.array([p]), np.array([g]))
    flops, kv = _brute_force(p, g, LLADA, L, S)
    assert est["blocks"][0] == math.ceil(g / L)
    assert est["flops"][0] == pytest.approx(flops, rel=1e-12)
    assert est["kv_bytes"][0] == pytest.approx(kv, rel=1e-12)
    assert est["time_s"][0] == max(est["compute_s"][0], est["memory_s"][0])


def test_roofline_honours_the_cache_mode_and_device():
    p, g = np.array([64.0, 4096.0]), np.array([256, 256])
    est = {c: Roofline(LLADA, H200, 32, 32, cache=c).estimate(p, g) for c in CACHE_MODES}
    # no cache forwards the whole row at every step: the most FLOPs; the caches cut them
    assert (est["none"]["flops"] > est["refresh"]["flops"]).all()
    assert (est["refresh"]["flops"] > est["persistent"]["flops"]).all()
    full = {c: Roofline(LLADA, H200, 32, 32, cache=c, full_canvas=True).estimate(p, g) for c in ("refresh", "dual")}
    assert (full["refresh"]["cells"] > full["dual"]["cells"]).all()  # dual drops the masked suffix
    assert not math.isclose(est["refresh"]["density"][0], est["refresh"]["density"][1], rel_tol=0.05)
    cpu = Roofline(LLADA, CPU, 32, 32).estimate(p, g)
    ratio = (CPU.mem_bandwidth / CPU.peak_flops) / (H200.mem_bandwidth / H200.peak_flops)
    assert cpu["density"][0] / est["refresh"]["density"][0] == pytest.approx(ratio)
    # GQA (Dream: 4 kv heads) moves far fewer K/V bytes per token than MHA (LLaDA)
    dream = Roofline(ModelProfile.from_config(DREAM_CFG, device="cuda"), H200, 32, 32).estimate(p, g)
    assert (dream["density"] > est["refresh"]["density"]).all()


def test_cost_model_times_and_blocks():
    cm = CostModel(a=0.01, b=1e-6, block_length=32, concurrency=4, steps_per_block=1)
    assert float(cm.times(np.array([100]), np.array([64]))[0]) == pytest.approx(2 * 0.01 / 4 + 1e-6 * (132 + 164))
    assert blocks(np.array([1, 32, 33]), 32).tolist() == [1, 1, 2]
    with pytest.raises(ValueError):
        work(np.array([1]), np.array([1]), 8, 4, cache="bogus")


def test_row_budget_is_the_engines_sampling_params():
    """The ordering reads a row's generation budget as the engine builds it
    (SamplingParams.from_dict over the config's): vLLM's `max_tokens`, nulls dropped (an
    Arrow struct column gives every row every key), the config's for no or a bad override."""
    from engine import SamplingParams
    from pipeline.sorting.order import _budget

    base = SamplingParams(max_new_tokens=32)
    assert _budget(None, base) == _budget({}, base) == 32
    assert _budget({"max_tokens": 64}, base) == _budget({"max_new_tokens": 64, "max_tokens": None}, base) == 64
    assert _budget({"temperature": 0.5, "max_tokens": None}, base) == 32
    for bad in ({"max_tokens": 0}, {"max_tokens": "many"}, {"no_such_key": 1}, "max_tokens=8"):
        assert _budget(bad, base) == 32, bad
