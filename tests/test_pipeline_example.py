"""A3: the README's map_batches example (examples/map_batches_example.py, included in
the README verbatim) runs as a script, here on the test's random tiny model."""
from __future__ import annotations

import os
import runpy
import sys

from conftest import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "map_batches_example.py")


def test_map_batches_example_runs(tiny_model_dir, ray_local, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [EXAMPLE, tiny_model_dir])
    env = runpy.run_path(EXAMPLE, run_name="__main__")  # Ray is up, so the script joins it
    rows = env["ROWS"]
    assert sorted(r["word"] for r in rows) == sorted(["ray", "block", "diffusion", "parquet", "mask", "engine"])
    for r in rows:
        assert set(r) == {"word", "reversed", "tokens", "error", "correct"}
        assert r["error"] is None and isinstance(r["reversed"], str) and 0 < r["tokens"] <= 24
        assert r["correct"] == (r["reversed"] == r["word"][::-1])
    assert capsys.readouterr().out.count("'word':") == len(rows)
