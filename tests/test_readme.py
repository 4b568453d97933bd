"""The README is a map that stays true: every command in it is run by a named test or by
CI, its Python examples run (the engine's here, the map_batches one is a verbatim excerpt
of the example tests/test_pipeline_example.py runs), and no link leaves the repository."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

README = os.path.join(ROOT, "README.md")
DOCS = [README, *(os.path.join(ROOT, "docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                  if f.endswith(".md"))]
# Each command of the README's shell blocks (its first line, up to the first option) and what runs it.
COVERED = {
    "make run": "tests/test_readme.py::test_make_targets_run_what_the_tests_run (jobs/offline_eval.py, "
                "run by tests/test_job.py::test_ray_job_submit)",
    "make test": ".ci/run",
    "RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/offline_eval.py":
        "tests/test_job.py::test_ray_job_submit",
}


def _blocks(lang: str):
    text = open(README, encoding="utf-8").read()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _commands():
    """Shell commands of the README, continuation lines joined, comments dropped."""
    out = []
    for block in _blocks("bash"):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = cmd.split("#")[0].strip()
            if cmd:
                out.append(cmd)
    return out


def test_readme_is_a_map():
    assert len(open(README, encoding="utf-8").read().splitlines()) < 180


def test_every_readme_command_is_run_by_a_named_test_or_ci():
    commands = _commands()
    assert commands, "no shell block found"
    for cmd in commands:
        key = next((k for k in COVERED if cmd == k or cmd.startswith(k + " ")), None)
        assert key is not None, f"README command not covered by a test: {cmd!r}"
    for where in COVERED.values():
        path, _, name = where.split(" ")[0].partition("::")
        text = open(os.path.join(ROOT, path), encoding="utf-8").read()
        assert not name or f"def {name}(" in text, where
    assert "make test" in open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()


# Each row of the README's checkpoint table (a unique part of its first cell) and the tests
# that prove what the row claims: the family's loop exact against its published one, and its
# published (or rebuilt) files through load, preflight and a job.
PUBLISHED = "tests/test_published.py::test_published_checkpoint_loads_generates_and_runs_the_job"
REBUILT = "tests/test_published.py::test_rebuilt_config_loads_generates_and_runs_the_job"
BACKED = {
    "GSAI-ML/LLaDA-8B-Instruct": ["tests/test_reference_decoding.py::test_full_canvas_matches_the_reference",
                                  PUBLISHED],
    "Dream-org/Dream-v0-Instruct-7B": ["tests/test_reference_decoding.py::test_full_canvas_matches_the_reference",
                                       PUBLISHED],
    "apple/DiffuCoder-7B-Instruct": ["tests/test_dream_coders.py::test_the_engine_decodes_as_diffusion_generate"],
    "SJTU-Deng-Lab/D2F_LLaDA_Instruct_8B_Lora": [
        "tests/test_d2f.py::test_mixed_batches_match_the_d2f_reference",
        "tests/test_checkpoints.py::test_d2f_adapter_job_with_block_causal_matches_the_hand_merged_model"],
    "inclusionAI/LLaDA-MoE-7B-A1B-Instruct": [
        "tests/test_moe.py::test_llada_moe_mixed_batches_match_the_published_loop",
        "tests/test_moe.py::test_published_layout_loads_and_runs_through_the_job"],
    "google/diffusiongemma-26B-A4B-it": ["tests/test_diffusion_gemma.py::test_float64_equals_transformers_generate",
                                         "tests/test_diffusion_gemma_job.py"],
    "inclusionAI/LLaDA2.0-mini": ["tests/test_llada2.py::test_mixed_batches_equal_the_published_loops", PUBLISHED],
    "inclusionAI/LLaDA2.0-flash": ["tests/test_tp_plan.py::test_the_plan_of_llada2_flash",
                                   "tests/test_tensor_parallel.py::test_two_ranks_give_the_tokens_of_one_device"],
    "inclusionAI/LLaDA2.2-flash": [
        "tests/test_llada2_2.py::test_mixed_batches_equal_the_transcribed_loop",
        "tests/test_llada2_2.py::test_tensor_and_expert_parallel_2_give_the_transcribed_tokens",
        "tests/test_block_routing.py::test_mixed_batches_equal_the_block_routed_loops",
        "tests/test_tp_plan.py::test_the_plan_of_llada2_flash", REBUILT],
    "nvidia/Nemotron-Labs-Diffusion": [
        "tests/test_nemotron_labs_diffusion.py::test_one_mixed_batch_equals_the_published_loop",
        "tests/test_linear_spec.py::test_a_mixed_batch_gives_each_row_its_batch_size_one_tokens",
        "tests/test_linear_spec.py::test_batch_size_one_equals_the_published_loop", REBUILT],
    "JetLM/SDAR-1.7B/4B/8B-Chat": ["tests/test_sdar.py::test_one_mixed_batch_equals_the_published_loop",
                                   "tests/test_sdar.py::test_sdar_moe_mixed_batch_equals_the_published_loop",
                                   PUBLISHED],
    "Efficient-Large-Model/Fast_dLLM_v2_7B": [
        "tests/test_fast_dllm_v2.py::test_one_mixed_batch_equals_the_published_loop",
        "tests/test_fast_dllm_v2.py::test_the_published_config_loads_and_runs_the_job"],
    "GSAI-ML/iLLaDA-8B-Instruct": ["tests/test_illada.py::test_one_mixed_batch_equals_the_published_loop", REBUILT],
    "Dream-org/DreamReasoner-8B": ["tests/test_dream_reasoner.py::test_one_mixed_batch_equals_the_published_loops",
                                   "tests/test_dream_reasoner.py::test_the_rebuilt_config_is_dreamreasoner_never_dream_v0",
                                   REBUILT],
    "ByteDance-Seed/Stable-DiffCoder-8B-Instruct": [
        "tests/test_stable_diffcoder.py::test_one_mixed_batch_equals_diffulex",
        "tests/test_stable_diffcoder.py::test_a_plain_llama_config_is_refused", REBUILT],
    "d3LLM": ["tests/test_d3llm.py::test_mixed_batches_match_the_reference",
              "tests/test_d3llm.py::test_tensor_parallel_2_gives_the_reference_tokens",
              "tests/test_published.py::test_multi_block_job_on_the_weights_d3llm_distils"],
}


def _checkpoint_rows():
    text = open(README, encoding="utf-8").read()
    table = text.split("| checkpoint | needs |", 1)[1].split("\n\n", 1)[0]
    return [line.split("|")[1].strip() for line in table.splitlines()[2:] if line.startswith("|")]


def test_every_checkpoint_row_is_backed_by_named_tests():
    rows = _checkpoint_rows()
    assert len(rows) == len(BACKED), "a row without its tests in BACKED, or a BACKED entry without its row"
    for row in rows:
        key = next((k for k in BACKED if k in row), None)
        assert key is not None, f"README checkpoint row not backed by a named test: {row!r}"
        for where in BACKED[key]:
            path, _, name = where.partition("::")
            text = open(os.path.join(ROOT, path), encoding="utf-8").read()
            assert not name or f"def {name}(" in text, where


def test_make_targets_run_what_the_tests_run():
    """`make run` is the job script with no arguments (the tests run that script), and
    `make test` the suite (what .ci/run runs); checked with make's dry run."""
    recipe = {t: subprocess.run(["make", "-n", t], cwd=ROOT, capture_output=True, text=True, check=True).stdout
              for t in ("run", "test")}
    assert re.search(r"^\.venv/bin/python jobs/offline_eval\.py\s*$", recipe["run"], re.M), recipe["run"]
    assert re.search(r"^\.venv/bin/python -m pytest .* tests$", recipe["test"], re.M), recipe["test"]


def test_map_batches_example_is_an_excerpt_of_the_tested_script():
    example = open(os.path.join(ROOT, "examples", "map_batches_example.py"), encoding="utf-8").read()
    (block,) = [b for b in _blocks("python") if "build_processor" in b]
    assert block in example


def test_engine_example_runs(capfd):
    (block,) = [b for b in _blocks("python") if "Engine(" in b]
    code = f"import os; os.chdir({ROOT!r})\n" + block
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-3] in ("stop", "length"), res.stdout


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_links_stay_in_the_repository(doc):
    """Every Markdown link is relative and resolves to a file of the repository (the
    README's and docs'); http(s) links only to published papers' or code's pages, in docs/."""
    text = open(doc, encoding="utf-8").read()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"https?://", target):
            assert doc != README, f"{os.path.relpath(doc, ROOT)} links outside the repository: {target}"
            continue
        path = os.path.normpath(os.path.join(os.path.dirname(doc), target.split("#")[0]))
        assert path.startswith(ROOT + os.sep) and os.path.exists(path), f"{doc}: broken link {target}"
    assert "shared/docs" not in text
