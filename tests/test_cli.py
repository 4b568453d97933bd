"""Issue 15, items 5 and 6: the installed `blockray` command, and a --help generated
from the config dataclasses (every flag has a help line and shows its default)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from typing import List, Literal, Optional

import pytest

from conftest import ROOT
from engine.config import EngineConfig, SamplingParams
from pipeline.cli import add_config_options, build_parser, parse_args
from pipeline.config import DLLMProcessorConfig

BLOCKRAY = os.path.join(os.path.dirname(sys.executable), "blockray")  # `pip install -e .` (make setup) puts it here


def test_installed_command_runs_the_job_help():
    out = subprocess.run([BLOCKRAY, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: blockray") and "--model" in out.stdout and "--canvas" in out.stdout
    def options(text: str) -> str:  # the usage lines wrap after the program's name
        return text[text.index("\noptions:"):]

    sub = subprocess.run([BLOCKRAY, "eval", "--help"], capture_output=True, text=True, timeout=120)
    assert sub.returncode == 0 and sub.stdout == out.stdout
    script = subprocess.run([sys.executable, "jobs/offline_eval.py", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert script.returncode == 0 and options(script.stdout) == options(out.stdout)


def test_every_flag_has_help_and_its_default():
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        assert action.help and "(default: " in action.help, action.option_strings
    flags = {s for a in parser._actions for s in a.option_strings}
    for cls in (EngineConfig, SamplingParams, DLLMProcessorConfig):
        for f in dataclasses.fields(cls):
            if f.name in ("engine", "sampling", "resources_per_engine") or f.metadata.get("cli") is False:
                continue
            assert "--" + f.name.replace("_", "-") in flags, f"{cls.__name__}.{f.name} has no flag"
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no metadata help"
    text = parser.format_help()
    assert "--block-length BLOCK_LENGTH" in text and "(default: 32)" in text
    assert "--first-position, --no-first-position" in text and "--apply-chat-template, --no-apply-chat-template" in text


def test_a_new_config_field_is_a_new_flag():
    """Types map to argparse the one way: bools (also Optional) as --x/--no-x, Literal as
    choices, lists as nargs="+", Optional scalars by their type; a dict is not a flag."""
    @dataclasses.dataclass
    class Extra:
        keep_it: bool = dataclasses.field(default=True, metadata={"help": "keep it"})
        maybe: Optional[bool] = None
        words: Optional[List[str]] = None
        mode: Literal["a", "b"] = "a"
        count: Optional[int] = None
        table: Optional[dict] = None

    p = argparse.ArgumentParser()
    add_config_options(p, p.add_argument_group("extra"), Extra, dataclass_defaults=True)
    args = p.parse_args(["--no-keep-it", "--maybe", "--words", "x", "y", "--mode", "b", "--count", "3"])
    assert (args.keep_it, args.maybe, args.words, args.mode, args.count) == (False, True, ["x", "y"], "b", 3)
    assert p.parse_args([]).keep_it is True and p.parse_args([]).maybe is None
    assert not hasattr(args, "table")
    help_ = p.format_help()
    assert "keep it (default: on)" in help_ and "(default: auto)" in help_ and "{a,b}" in help_


def test_existing_flag_names_keep_working(tmp_path):
    args = parse_args(["eval", "--model", "m", "--num-engines", "3", "--sort", "none", "--apply-chat-template",
                       "--max-new-tokens", "8", "--stop-token-ids", "1", "2", "--no-resume", "--seed", "7"])
    assert (args.model, args.num_engines, args.sort, args.apply_chat_template) == ("m", 3, "none", True)
    assert (args.max_new_tokens, args.stop_token_ids, args.resume, args.seed) == (8, [1, 2], False, 7)
    assert parse_args([]).block_length is None  # unset: the model's blockray.json, then EngineConfig's


def test_presets_apply_under_the_flags_given():
    """--preset d2f-gsm8k sets D2F-LLaDA's gsm8k settings over the model's blockray.json;
    a flag given beside it still wins."""
    from pipeline.cli import build_config

    cfg = build_config(parse_args(["--preset", "d2f-gsm8k", "--block-length", "32"]), 0)
    s = cfg.sampling
    assert (cfg.engine.block_length, cfg.engine.cache) == (32, "persistent")
    assert (s.block_add_threshold, s.decoded_token_threshold, s.threshold, s.max_new_tokens) == (0.7, 0.95, 0.9, 512)
    h = build_config(parse_args(["--preset", "d2f-humaneval"]), 0)
    assert (h.engine.block_length, h.sampling.block_add_threshold) == (32, 0.1)
    assert build_config(parse_args([]), 0).sampling.block_add_threshold is None  # the default: one block at a time


def test_a_local_ray_that_times_out_while_it_starts_is_started_once_more():
    """Ray's fixed 30 s raylet registration wait can expire on a loaded machine: the
    half-started node (this process's children; here a real child process) is killed and
    the start tried once more; any other failure, or a second timeout, is raised. A stand-in
    for ray: the timeout cannot be produced on demand."""

    from pipeline.local_ray import STARTUP_TIMEOUT, start_local_ray

    class FakeRay:
        def __init__(self, failures):
            self.failures, self.calls, self.shutdowns, self.children = list(failures), [], 0, []

        def init(self, **kw):
            self.calls.append(kw)
            if self.failures:
                self.children.append(subprocess.Popen(["sleep", "300"]))  # what a failed start leaves
                raise self.failures.pop(0)
            return "context"

        def shutdown(self):
            self.shutdowns += 1

    timeout = Exception(f"The current node {STARTUP_TIMEOUT}. This could happen because ...")
    bystander = subprocess.Popen(["sleep", "300"])  # started before: not the failed start's
    ray = FakeRay([timeout])
    assert start_local_ray(ray, num_cpus=2) == "context"
    assert ray.calls == [{"address": "local", "num_cpus": 2}] * 2 and ray.shutdowns == 1
    assert ray.children[0].poll() is not None  # killed (and reaped) before the second start
    assert bystander.poll() is None
    bystander.kill()
    for failures in ([NotADirectoryError("temp dir")], [timeout, timeout]):
        ray = FakeRay(failures)
        with pytest.raises(Exception) as e:
            start_local_ray(ray)
        assert e.value is failures[-1] and len(ray.calls) == len(failures)
        for child in ray.children:
            child.kill()
