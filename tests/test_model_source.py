"""Issue 15, item 3: models from a local directory, object storage (moto_server as a real
S3 endpoint on loopback) or a hub id; one verified download per node into the model cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from conftest import ROOT, S3_KEY, S3_REGION, part_files, write_prompts
from common.model_source import (DOWNLOAD_LOG, ModelSourceError, cache_dir, classify, resolve_model)
from procs import job_ray


def downloads(cache: str) -> list:
    path = os.path.join(cache, DOWNLOAD_LOG)
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


@pytest.fixture
def model_cache(tmp_path, monkeypatch) -> str:
    cache = str(tmp_path / "model-cache")
    monkeypatch.setenv("BLOCKRAY_MODEL_CACHE", cache)
    return cache


@pytest.fixture
def s3_model(s3fs_client, tiny_model_dir) -> str:
    """The tiny checkpoint uploaded to a fresh bucket; its s3:// URL."""
    bucket = f"models-{uuid.uuid4().hex[:8]}"
    s3fs_client.mkdir(bucket)
    s3fs_client.put(tiny_model_dir.rstrip("/") + "/", f"{bucket}/tiny-dllm/", recursive=True)
    return f"s3://{bucket}/tiny-dllm"


def test_classify():
    assert classify("engine/assets/tiny-dllm").kind == "local"  # exists (cwd is the repo root in CI)
    assert classify("/no/such/dir").kind == "local"
    assert classify("file:///tmp/x").spec == "/tmp/x"
    assert classify("s3://bucket/llada/").kind == "remote"
    assert classify("GSAI-ML/LLaDA-8B-Instruct").kind == "hub"


def test_s3_model_is_downloaded_once_verified_and_refreshed(s3_model, s3_storage, s3fs_client, model_cache):
    meta = resolve_model(s3_model, s3_storage, weights=False)  # what the driver's preflight fetches
    assert os.path.isfile(os.path.join(meta, "config.json"))
    assert not [f for f in os.listdir(meta) if f.endswith(".safetensors")]
    local = resolve_model(s3_model, s3_storage)
    assert local == cache_dir(s3_model) and local.startswith(model_cache)
    assert [f for f in os.listdir(local) if f.endswith(".safetensors")]
    assert resolve_model(s3_model + "/", s3_storage) == local  # reused: no second download
    assert resolve_model(s3_model, s3_storage, weights=False) == local  # the full copy serves the metadata too
    assert [d["dir"] for d in downloads(model_cache)] == [meta, local]

    from engine import load_model

    model, _ = load_model(local, tokenizer=False)
    assert model.config.vocab_size > 0

    # The remote changed (same URL, new weights): fetched again, never the stale copy.
    key = s3_model.removeprefix("s3://") + "/model.safetensors"
    s3fs_client.pipe(key, s3fs_client.cat(key) + b"\0" * 8)
    assert resolve_model(s3_model, s3_storage) == local
    assert len(downloads(model_cache)) == 3
    assert os.path.getsize(os.path.join(local, "model.safetensors")) == s3fs_client.size(key)


def test_s3_model_checks_name_what_is_missing(s3_model, s3_storage, s3fs_client, model_cache):
    root = s3_model.removeprefix("s3://")
    s3fs_client.pipe(f"{root}/model.safetensors.index.json",
                     json.dumps({"weight_map": {"w": "model-00002-of-00002.safetensors"}}).encode())
    with pytest.raises(ModelSourceError, match="model-00002-of-00002.safetensors"):
        resolve_model(s3_model, s3_storage)
    with pytest.raises(ModelSourceError, match="does not exist or is empty"):
        resolve_model(s3_model + "-typo", s3_storage)
    assert downloads(model_cache) == []


def test_bad_model_fails_in_the_driver_before_any_actor(s3_storage, model_cache):
    """The processor API checks the model when it is built: one line, no Ray needed."""
    from pipeline import DLLMProcessorConfig, build_processor

    for model, words in (("/no/such/model", "not a directory"),
                         ("s3://no-such-bucket-42/llada", "does not exist")):
        t0 = time.time()
        with pytest.raises(ValueError, match=words) as info:
            build_processor(DLLMProcessorConfig(model=model), storage=s3_storage)
        assert "\n" not in str(info.value) and time.time() - t0 < 10


def test_hub_id_offline_says_how_to_give_a_local_path(tmp_path):
    """Nothing is downloaded: offline, the job exits 2 with one line naming the way out."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               BLOCKRAY_MODEL_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "jobs/offline_eval.py", "--model", "no-such-org/no-such-dllm",
                          "--output", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, res.stderr
    assert "no-such-org/no-such-dllm" in err[0] and "--local-dir" in err[0] and "--model DIR" in err[0], err
    assert not os.path.exists(tmp_path / "out")


def test_job_with_an_s3_model_downloads_once_per_node(tmp_path, s3_endpoint, s3_model, model_cache):
    """`--model s3://…` end to end (the job on a private local Ray, 2 engines on one node):
    the driver fetches the metadata for its checks, the node the weights, once."""
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "r{:02d}", 8)
    secret = "zQ9-MODEL-SOURCE-SECRET-5e1d"  # moto accepts any secret; this one is easy to grep for
    env = dict(os.environ, AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=secret, AWS_REGION=S3_REGION,
               BLOCKRAY_MODEL_CACHE=model_cache)
    with job_ray() as ray:  # a Ray of its own: its node gets this environment
        res = subprocess.run([sys.executable, "jobs/offline_eval.py", "--model", s3_model, "--endpoint-url",
                              s3_endpoint, "--input", inp, "--output", out, "--num-engines", "2", "--batch-size",
                              "2", "--block-length", "4", "--steps-per-block", "4", "--max-new-tokens", "8",
                              "--max-error-fraction", "1", "--sort", "none", *ray],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["rows"] == 8 and summary["errors"] == 0 and summary["model"] == s3_model
    assert part_files(out)
    full = cache_dir(s3_model)
    made = downloads(model_cache)
    assert [d["dir"] for d in made].count(full) == 1, made  # two engines, one download
    assert [d["dir"] for d in made].count(full + "-meta") == 1, made  # the driver's checks
    assert secret not in res.stdout + res.stderr + json.dumps(summary)
