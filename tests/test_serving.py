"""Serving modes as objects (engine.serving, issue 52 item 5): the loaders, the actor, the
preflight, the sorter and resources ask a mode rather than compare it; a mode survives
pickling as itself (a Checkpoint travels to every engine); a family declares its weights
only where blockray's transformer holds them. Torch-free, no Ray."""
from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from engine.engines import BlockEngine, CanvasEngines, engine_for
from engine.models.families import FAMILIES, ConfigRefused, Family
from engine.models.families.diffusion_gemma import DIFFUSION_GEMMA
from engine.reads import CANVAS as CANVAS_READS, MASKED as MASKED_READS
from engine.serving import CANVAS, MASKED, Serving, serving_named

COMPARISON = re.compile(r"serving\b.*[!=]=|Serving\.(MASKED|CANVAS)")
# the two engines' own modules (and engine.serving, which defines the modes)
OWN = ("engine/canvas/", "engine/engine.py", "engine/core.py", "engine/serving.py")


def test_every_family_declares_a_mode_and_each_mode_its_engine():
    for family in FAMILIES.values():
        assert family.serving in (MASKED, CANVAS)
        assert engine_for(family.serving) is not None
    assert DIFFUSION_GEMMA.serving is CANVAS and Serving.CANVAS is CANVAS and Serving.MASKED is MASKED
    assert isinstance(engine_for(MASKED), BlockEngine) and isinstance(engine_for(CANVAS), CanvasEngines)
    assert MASKED.reads is MASKED_READS and CANVAS.reads is CANVAS_READS
    assert serving_named("canvas") is CANVAS


def test_a_mode_unpickles_as_itself():
    assert pickle.loads(pickle.dumps(MASKED)) is MASKED
    family = pickle.loads(pickle.dumps(DIFFUSION_GEMMA))
    assert family.serving is CANVAS and engine_for(family.serving) is engine_for(CANVAS)


def test_the_canvas_mode_refuses_weights_adapters_and_attention():
    with pytest.raises(ConfigRefused, match="transformers' own class"):
        DIFFUSION_GEMMA.param_shapes(None)
    assert "drop --adapter" in CANVAS.adapter_refusal(DIFFUSION_GEMMA, "m")
    assert "masked-diffusion models only" in CANVAS.attention_refusal(DIFFUSION_GEMMA, "block_causal")
    assert MASKED.adapter_refusal(DIFFUSION_GEMMA, "m") is None
    assert not CANVAS.own_weights and not CANVAS.plans_memory and not CANVAS.warms_up and CANVAS.exact_prefix_cache


def test_a_masked_family_must_name_its_weights():
    with pytest.raises(ValueError, match="names its checkpoint's weights"):
        Family(name="X", model_type="x_test", examples="", honoured=frozenset(), fixed={})


def test_few_serving_comparisons_outside_the_engines():
    """Acceptance 5 of issue 52: at most 3 (pipeline/preflight.py's one is left to its owner)."""
    found = []
    for pkg in ("engine", "actors", "pipeline", "common"):
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                path = os.path.join(d, f)
                rel = os.path.relpath(path, ROOT)
                if not f.endswith(".py") or rel.startswith(OWN):
                    continue
                for i, line in enumerate(open(path, encoding="utf-8"), 1):
                    if COMPARISON.search(line):
                        found.append(f"{rel}:{i}")
    assert len(found) <= 3, found


def test_the_serving_modules_import_no_torch():
    code = ("import sys, engine.serving, engine.engines, engine.checkpoint, pipeline.checkpoint_check; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, check=True)
    assert out.stdout.strip() == "False", out.stderr
