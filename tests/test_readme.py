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
