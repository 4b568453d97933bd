"""bench/cache_bench.py runs end to end (--quick) and writes the JSON it promises:
machine info, the command, every config's throughput and engine stats, the ratios,
block/step advance giving identical tokens, and the bidirectional agreement numbers.
No wall-clock thresholds: timings are noise on a shared CI machine."""
import json

import pytest

from bench import cache_bench

RUN_KEYS = {"tokens_per_s", "tokens_per_cpu_s", "wall_s", "cpu_s", "generated_tokens", "forward_tokens",
            "computed_cells", "padded_cells", "padding_fraction", "forward_s", "steps", "cycles", "requests",
            "mean_busy_steps_per_block", "outputs_identical_across_rounds"}
RATIO_KEYS = {"tokens_per_s", "tokens_per_cpu_s", "forward_tokens_per_token_inverse",
              "computed_cells_per_token_inverse", "steps_inverse", "cells_per_forward_s"}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("cache_bench") / "cache_quick.json"
    returned = cache_bench.main(["--quick", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["summary"] == json.loads(json.dumps(returned["summary"]))
    return written


def test_header(result):
    assert result["quick"] is True
    assert result["command"].startswith("python bench/cache_bench.py --quick --out ")
    assert {"cpu_count", "platform", "torch", "torch_threads"} <= set(result["machine"])
    assert result["model"]["dllm_attention"] == "block_causal"
    assert {"block_length", "steps_per_block", "policy"} <= set(result["engine"])
    assert result["total_wall_s"] > 0 and len(result["notes"]) >= 5


def test_cache_modes(result):
    per = result["caches"]["per_prompt"]
    assert list(per) == ["32", "128", "512"]
    for P, v in per.items():
        assert 0 < v["threshold"] < 1
        assert set(v["runs"]) == {"refresh/all", "persistent/all", "none/subset", "refresh/subset",
                                  "persistent/subset"}
        for m in v["runs"].values():
            assert RUN_KEYS <= set(m)
            assert m["generated_tokens"] > 0 and 0 <= m["padding_fraction"] < 1
            assert m["outputs_identical_across_rounds"]
        assert set(v["ratios"]) == {"persistent_over_refresh", "persistent_over_refresh_subset",
                                    "refresh_over_none", "persistent_over_none"}
        for r in v["ratios"].values():
            assert RATIO_KEYS <= set(r)
        # caches re-forward less: a property of the engine's accounting, not of timing
        assert v["runs"]["none/subset"]["forward_tokens_per_token"] > v["runs"]["refresh/subset"][
            "forward_tokens_per_token"] > v["runs"]["persistent/subset"]["forward_tokens_per_token"]
        # block-causal model: caches do not change tokens
        for c in ("refresh", "persistent"):
            assert v["exactness_vs_none"][c]["requests"] == 1.0
    refill = result["caches"]["refill"]
    assert set(refill["runs"]) == {"refresh", "persistent"} and refill["outputs_identical"]
    h = result["caches"]["headline"]
    assert {"persistent_over_refresh", "refresh_over_none", "persistent_over_refresh_with_refill", "expected",
            "met_wall", "met_cpu"} <= set(h)


def test_block_and_step_advance_give_identical_tokens(result):
    adv = result["advance"]
    assert set(adv["runs"]) == {"persistent/block", "persistent/step", "refresh/block", "refresh/step"}
    assert adv["outputs_identical"] == {"persistent": True, "refresh": True}
    assert result["summary"]["block_step_outputs_identical"] == {"persistent": True, "refresh": True}
    for c in ("persistent", "refresh"):
        r = adv["ratios"][f"{c}_step_over_block"]
        assert RATIO_KEYS <= set(r)
        assert r["steps_inverse"] > 1  # blocks end unevenly: step advance needs fewer denoising steps
    assert {"met_wall", "met_cpu", "expected"} <= set(adv)
    mem = result["summary"]["memory"]
    assert set(mem) == {f"advance/{k}" for k in adv["runs"]}
    assert all(m["syncs_per_step"] == 1.0 and m["peak_kv_over_budget"] > 0 for m in mem.values())


def test_agreement_on_bidirectional_models(result):
    agr = result["agreement"]
    assert set(agr) == {"llada-bidirectional", "Dream-bidirectional"}
    assert agr["Dream-bidirectional"]["model"]["model_type"] == "Dream"
    for v in agr.values():
        assert v["model"]["dllm_attention"] == "bidirectional"
        for k in ("persistent_vs_none", "refresh_vs_none", "chance_agreement"):
            assert 0.0 <= v[k]["positions"] <= 1.0 and 0.0 <= v[k]["requests"] <= 1.0
            assert v[k]["n_positions"] > 0
