"""bench/gpu/run.sh's default run, the first GPU run in one command (issue 51 items 6 and 7),
on fake CUDA on the CPU: every part's code path runs (bench/gpu/first_run.py on fake CUDA,
then bench/gpu/diffusion_gemma_gpu.py's CPU smoke), so that a lent GPU's minutes are not
spent on a crash in it."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_run_sh_runs_its_whole_path_on_fake_cuda(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(["bash", "bench/gpu/run.sh", "--fake-cuda", "--families", "llada,llada2"], env=env,
                          capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads((tmp_path / "first_run.json").read_text())
    assert got["done"] is True and got["fake_cuda"] is True and "failed" not in got
    assert got["attention"]["llada"]["predicted"] == "efficient"
    assert got["attention"]["llada2"]["predicted"] == "efficient, GQA folded x4"
    assert all(a["calls"] > 0 and a["refusals"] == [] and a["torch_chose"] == {} for a in got["attention"].values())
    for shape in ("llada-8b", "llada2-mini"):
        (r,) = got["throughput"][shape]  # B=4 eager; the compiled run needs a GPU to compile for
        assert r["label"] == f"{shape}@B4" and r["error"] is None and r["requests"] == 4 and r["tokens"] == 4 * 32
        assert r["syncs_per_step"] == 1.0 and r["sync_warnings"] == 0 and r["graph_replays"] == 0
        assert r["tokens_per_s"] is None  # nothing is timed on fake CUDA
    assert {s["label"] for s in got["skipped"]} == {"llada-8b@B4+compile", "llada2-mini@B4+compile"}
    dg = json.loads((tmp_path / "diffusion_gemma_gpu.json").read_text())
    assert {r["scheduler"] for r in dg["runs"]} == {"blockserve", "transformers_generate"}
    assert "attention llada2" in done.stdout and "efficient, GQA folded x4" in done.stdout
