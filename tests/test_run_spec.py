"""The job's settings resolved once (issue 52 item 7): one RunSpec, built once by the CLI
(or by run_offline / preflight from a caller's keywords), read by the preflight, the
processor, the run record and the summary; the --chat-template file read once, the
storage options' environment once, the processor config built once."""
from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.cli
import pipeline.preflight
import pipeline.processor
import pipeline.run
import pipeline.run_spec
import pipeline.stages
from common.storage import StorageOptions
from conftest import ROOT, read_parts
from pipeline.config import DLLMProcessorConfig
from pipeline.errors import JobError
from pipeline.run_spec import RunSpec, as_spec

TINY = os.path.join(ROOT, "engine", "assets", "tiny-dllm")  # trained, no chat template of its own
# Only characters of the tiny vocabulary; no newline (the tiny tokenizer has none).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}. {% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
MESSAGES = [[{"role": "user", "content": "rev: abc"}], [{"role": "user", "content": "copy: ab"}]]


def _inputs(tmp_path):
    """(a chat input, a --chat-template file, a copy of the tiny model)."""
    src = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"id": ["u", "v"], "messages": MESSAGES}), src)
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text(TEMPLATE)
    model = str(tmp_path / "model")
    shutil.copytree(TINY, model)
    return src, str(tmpl), model


@pytest.fixture
def resolutions(monkeypatch):
    """Counts of what is read once per run: the --chat-template value resolved, the
    storage options filled from the environment, the processor config built from flags."""
    counts = {"chat_template": 0, "storage": 0, "build_config": 0}
    resolve = pipeline.stages.resolve_chat_template

    def counted_resolve(value):
        counts["chat_template"] += 1
        return resolve(value)

    for mod in (pipeline.stages, pipeline.run_spec, pipeline.preflight, pipeline.processor, pipeline.run):
        if hasattr(mod, "resolve_chat_template"):
            monkeypatch.setattr(mod, "resolve_chat_template", counted_resolve)
    filled = StorageOptions._filled

    def counted_filled(self, env):
        counts["storage"] += 1
        return filled(self, env)

    monkeypatch.setattr(StorageOptions, "_filled", counted_filled)
    build = pipeline.cli.build_config

    def counted_build(*a, **kw):
        counts["build_config"] += 1
        return build(*a, **kw)

    monkeypatch.setattr(pipeline.cli, "build_config", counted_build)
    return counts


def test_a_spec_is_resolved_as_it_is_built(tmp_path, monkeypatch, resolutions):
    src, tmpl, model = _inputs(tmp_path)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    cfg = DLLMProcessorConfig(model=model, chat_template=tmpl)
    spec = RunSpec(src, str(tmp_path / "out"), cfg)
    assert spec.chat_template == TEMPLATE and spec.storage.region == "eu-west-3" and spec.run_id
    assert resolutions["chat_template"] == 1 and resolutions["storage"] == 1
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    assert spec.storage.resolved() is spec.storage  # resolved once: later readers read nothing more
    assert resolutions["storage"] == 1
    assert as_spec(spec, None, None, {}) is spec
    with pytest.raises(TypeError, match="not both"):
        as_spec(spec, "elsewhere", None, {})
    with pytest.raises(TypeError, match="needed"):
        as_spec(src, None, cfg, {})
    with pytest.raises(JobError) as e:  # the job's own bounds, named as the CLI names them
        RunSpec(src, str(tmp_path / "out"), cfg, max_error_fraction=2)
    assert e.value.options == ("max_error_fraction",)
    with pytest.raises(JobError, match="neither a file") as e:
        RunSpec(src, str(tmp_path / "out"), DLLMProcessorConfig(model=model, chat_template=str(tmp_path / "no")))
    assert e.value.options == ("chat_template",) and not os.path.exists(tmp_path / "out")


def test_preflight_and_processor_read_one_spec(tmp_path, resolutions):
    """The preflight reads the template the spec resolved and passes on the one prompts are
    rendered with; the processor's tokenize stage renders with it, reading nothing more
    (no Ray: the stage is called here)."""
    from pipeline.preflight import preflight
    from pipeline.run import build_processor_for

    src, tmpl, model = _inputs(tmp_path)
    cfg = DLLMProcessorConfig(model=model, chat_template=tmpl)
    spec = RunSpec(src, str(tmp_path / "out"), cfg)
    checked = preflight(spec)
    try:
        assert checked.spec is spec and checked.chat_template == TEMPLATE
        assert checked.record["chat_template_sha256"]
        proc = build_processor_for(cfg, spec.storage, spec.run_id, checked.checkpoint,
                                   chat_template=checked.chat_template)
        out = proc.tokenize_udf()(pq.read_table(src))
        assert out.column("prompt").to_pylist() == ["user: rev: abc. assistant: ", "user: copy: ab. assistant: "]
    finally:
        checked.release()
    assert resolutions["chat_template"] == 1 and resolutions["storage"] == 1
    with pytest.raises(ValueError, match="other settings"):  # a preflight of another run is not this run's
        pipeline.run.run_offline(src, str(tmp_path / "elsewhere"), cfg, preflighted=checked)


def test_the_cli_builds_its_settings_once(tmp_path, ray_local, monkeypatch, capsys, resolutions):
    """Acceptance 6 of issue 52: one CLI run on the session's Ray builds the processor
    config once and resolves the chat template once, and the run record, the summary and
    the run id agree with the spec the preflight checked."""
    import ray

    src, tmpl, model = _inputs(tmp_path)
    out = str(tmp_path / "out")
    monkeypatch.setattr(ray, "init", lambda **kw: ray_local)  # join the session's Ray ...
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # ... and leave it up
    argv = ["--input", src, "--output", out, "--model", model, "--chat-template", tmpl, "--block-length", "4",
            "--steps-per-block", "4", "--max-new-tokens", "8", "--token-budget", "1024", "--num-engines", "1",
            "--num-cpus-per-engine", "0.5", "--sort", "none", "--no-report", "--address", "session"]
    assert pipeline.cli.main(argv) == 0, capsys.readouterr().err
    assert resolutions == {"chat_template": 1, "storage": 1, "build_config": 1}
    printed = capsys.readouterr().out
    run_id = printed.split("blockray run ", 1)[1].split()[0]
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["run_id"] == run_id and summary["rows"] == 2 and summary["errors"] == 0
    assert summary["config"]["chat_template"] == tmpl and summary["config"]["engine"]["block_length"] == 4
    assert summary["run_record"]["chat_template_sha256"] is not None
    rows = {r["id"]: r for r in read_parts(out).to_pylist()}
    assert rows["u"]["prompt"] == "user: rev: abc. assistant: "
