"""The job's preflight checks settings without torch (~3 CPU-s and 250 MB per preflight):
a fresh interpreter that imports the preflight's modules has no torch loaded."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT

PREFLIGHT_MODULES = ("pipeline.preflight", "pipeline.checkpoint_check", "engine.checkpoint", "engine.decoders",
                     "engine.rules", "engine.layout", "engine.subblocks", "engine.editing", "engine.d2f")


def test_the_preflights_modules_load_no_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in PREFLIGHT_MODULES)
            + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
