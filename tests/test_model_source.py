"""Issue 15, item 3: models from a local directory, object storage (moto_server as a real
S3 endpoint on loopback) or a hub id; one verified download per node into the model cache."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from conftest import ROOT, S3_KEY, S3_REGION, part_files, write_prompts
from common.model_source import (COMPLETE_MARKER, DOWNLOAD_LOG, FileStat, ModelSourceError, SourceKind, cache_dir,
                                 classify, fingerprint, listing, resolve_model)
from procs import job_ray


def downloads(cache: str) -> list:
    path = os.path.join(cache, DOWNLOAD_LOG)
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


@pytest.fixture
def model_cache(tmp_path, monkeypatch) -> str:
    cache = str(tmp_path / "model-cache")
    monkeypatch.setenv("BLOCKRAY_MODEL_CACHE", cache)
    return cache


def upload(s3fs_client, folder: str, name: str = "tiny-dllm") -> str:
    """Every file of `folder` uploaded to a fresh bucket; its s3:// URL."""
    bucket = f"models-{uuid.uuid4().hex[:8]}"
    s3fs_client.mkdir(bucket)
    s3fs_client.put(folder.rstrip("/") + "/", f"{bucket}/{name}/", recursive=True)
    return f"s3://{bucket}/{name}"


@pytest.fixture
def s3_model(s3fs_client, tiny_model_dir) -> str:
    """The tiny checkpoint uploaded to a fresh bucket; its s3:// URL."""
    return upload(s3fs_client, tiny_model_dir)


def same_size_edit(data: bytes) -> bytes:
    """`data` with its first digit changed: other content, same size (config.json stays JSON)."""
    i = next(i for i, c in enumerate(data) if chr(c).isdigit())
    return data[:i] + str((int(chr(data[i])) + 1) % 10).encode() + data[i + 1:]


def test_classify():
    assert classify("engine/assets/tiny-dllm").kind is SourceKind.LOCAL  # exists (cwd is the repo root in CI)
    assert classify("/no/such/dir").kind is SourceKind.LOCAL
    assert classify("file:///tmp/x").spec == "/tmp/x"
    assert classify("s3://bucket/llada/").kind is SourceKind.REMOTE
    assert classify("GSAI-ML/LLaDA-8B-Instruct").kind is SourceKind.HUB
    assert classify("s3://bucket/llada/").kind == "remote" and json.dumps(SourceKind.HUB) == '"hub"'  # still strings
    assert classify("/no/such/dir").is_local and not classify("s3://bucket/llada/").is_local


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


def test_job_with_an_s3_model_downloads_once_per_node(tmp_path, s3_endpoint, s3_model, s3_storage, model_cache,
                                                     monkeypatch):
    """`--model s3://…` end to end (the job on a private local Ray, 2 engines on one node):
    the driver fetches the metadata for its checks, the node the weights, once; a resume
    on that node, where the weights now are, is accepted (the run record holds the
    fingerprint of the files at their source, not of whichever copy is local)."""
    from pipeline.cli import build_config, parse_args
    from pipeline.preflight import preflight

    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "r{:02d}", 8)
    secret = "zQ9-MODEL-SOURCE-SECRET-5e1d"  # moto accepts any secret; this one is easy to grep for
    env = dict(os.environ, AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=secret, AWS_REGION=S3_REGION,
               BLOCKRAY_MODEL_CACHE=model_cache)
    argv = ["--model", s3_model, "--endpoint-url", s3_endpoint, "--input", inp, "--output", out, "--num-engines", "2",
            "--batch-size", "2", "--block-length", "4", "--steps-per-block", "4", "--max-new-tokens", "8",
            "--max-error-fraction", "1", "--sort", "none"]
    with job_ray() as ray:  # a Ray of its own: its node gets this environment
        res = subprocess.run([sys.executable, "jobs/offline_eval.py", *argv, *ray],
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
    # the rerun's preflight on this node, as the CLI builds it: every row already written, none refused
    checked = preflight(inp, out, build_config(parse_args(argv), 0, s3_storage), storage=s3_storage,
                        max_error_fraction=1.0)
    checked.release()
    assert len(checked.done) == 8 and checked.settings_changed == [] and checked.source.num_rows == 0


def test_listing_reports_sizes_and_the_stores_versions(tmp_path, tiny_model_dir, s3fs_client, s3_storage):
    """S3 (s3fs) lists each object's ETag, quoted; the listing keeps it unquoted, which for a
    single-part upload is the MD5 of the content. Hidden files and lock files are no model's."""
    folder = str(tmp_path / "m")
    shutil.copytree(tiny_model_dir, folder)
    for extra in (".gitattributes", ".cache/huggingface/download/config.json.metadata", "x.lock"):
        os.makedirs(os.path.dirname(os.path.join(folder, extra)), exist_ok=True)
        open(os.path.join(folder, extra), "w").write("not the model's")
    url = upload(s3fs_client, folder)
    names = sorted(os.listdir(tiny_model_dir))
    remote, local = listing(url, s3_storage), listing(folder)
    assert sorted(remote) == sorted(local) == names
    config = open(os.path.join(folder, "config.json"), "rb").read()
    assert remote["config.json"] == FileStat(len(config), hashlib.md5(config).hexdigest())
    assert local["config.json"].size == len(config) and local["config.json"].version  # its mtime
    assert listing(url + "-typo", s3_storage) == {} and listing(str(tmp_path / "none")) == {}


def test_fingerprint_is_the_same_for_the_same_files_wherever_they_are(
        tmp_path, tiny_model_dir, s3fs_client, s3_storage, model_cache):
    """A folder and its copy under s3:// give one fingerprint; the metadata-only and the full
    cached copies of an s3:// model do not change it (it is read from the source); a changed
    byte in config.json changes it."""
    url = upload(s3fs_client, tiny_model_dir)
    fp = fingerprint(tiny_model_dir)
    assert fingerprint(url, s3_storage) == fingerprint(url + "/", s3_storage) == fp and len(fp) == 64

    meta = resolve_model(url, s3_storage, weights=False)
    assert fingerprint(url, s3_storage) == fp
    assert fingerprint(meta) != fp  # the copy the driver holds lacks the weights: why the source is read
    full = resolve_model(url, s3_storage)
    assert fingerprint(url, s3_storage) == fp
    assert fingerprint(full) == fp  # a full copy is the same files (the cache's marker is left out)
    assert len(downloads(model_cache)) == 2

    key = url.removeprefix("s3://") + "/config.json"
    s3fs_client.pipe(key, same_size_edit(s3fs_client.cat(key)))
    changed = fingerprint(url, s3_storage)
    assert changed != fp
    folder = str(tmp_path / "m")
    shutil.copytree(tiny_model_dir, folder)
    with open(os.path.join(folder, "config.json"), "wb") as f:
        f.write(s3fs_client.cat(key))
    assert fingerprint(folder) == changed
    snapshot = str(tmp_path / "snapshot")  # a hub snapshot's layout: links to the files
    os.makedirs(snapshot)
    for name in os.listdir(folder):
        os.symlink(os.path.join(folder, name), os.path.join(snapshot, name))
    assert fingerprint(snapshot) == changed
    with pytest.raises(ModelSourceError, match="does not exist or is empty"):
        fingerprint(url + "-typo", s3_storage)


def test_fingerprint_reads_the_ends_of_large_files(tmp_path, tiny_model_dir, s3fs_client, s3_storage):
    """A file over 2 MiB (a weight shard) counts by its size and its first and last MiB, read
    as byte ranges: a change there is seen, locally and on S3 alike; one in the middle that
    keeps the size is not (the price of never reading a whole shard)."""
    folder = str(tmp_path / "m")
    shutil.copytree(tiny_model_dir, folder)
    shard = os.path.join(folder, "model-00002-of-00002.safetensors")
    data = bytearray(os.urandom(5 << 20))
    open(shard, "wb").write(data)
    fp = fingerprint(folder)
    assert fingerprint(upload(s3fs_client, folder), s3_storage) == fp

    def with_byte(at: int) -> str:
        edited = bytearray(data)
        edited[at] ^= 0xFF
        open(shard, "wb").write(edited)
        return fingerprint(folder)

    assert with_byte(len(data) - 1) != fp and with_byte(10) != fp
    assert with_byte(len(data) // 2) == fp
    open(shard, "wb").write(data + b"\0")
    assert fingerprint(folder) != fp  # its size


def test_content_changed_at_the_same_size_is_fetched_again(s3_model, s3_storage, s3fs_client, model_cache):
    local = resolve_model(s3_model, s3_storage)
    assert resolve_model(s3_model, s3_storage) == local
    assert len(downloads(model_cache)) == 1  # unchanged: not downloaded again

    key = s3_model.removeprefix("s3://") + "/config.json"
    new = same_size_edit(s3fs_client.cat(key))
    assert len(new) == os.path.getsize(os.path.join(local, "config.json"))
    s3fs_client.pipe(key, new)
    assert resolve_model(s3_model, s3_storage) == local
    assert open(os.path.join(local, "config.json"), "rb").read() == new
    assert [d["dir"] for d in downloads(model_cache)] == [local, local]
    assert resolve_model(s3_model, s3_storage) == local and len(downloads(model_cache)) == 2

    weights = s3_model.removeprefix("s3://") + "/model.safetensors"  # a shard re-uploaded at its size
    data = bytearray(s3fs_client.cat(weights))
    data[len(data) // 2] ^= 0xFF
    s3fs_client.pipe(weights, bytes(data))
    assert resolve_model(s3_model, s3_storage) == local and len(downloads(model_cache)) == 3
    assert open(os.path.join(local, "model.safetensors"), "rb").read() == bytes(data)

    s3fs_client.rm(s3_model.removeprefix("s3://") + "/special_tokens_map.json")  # a file gone at the source
    assert resolve_model(s3_model, s3_storage) == local and len(downloads(model_cache)) == 4
    assert not os.path.exists(os.path.join(local, "special_tokens_map.json"))


def test_marker_of_sizes_only_is_fetched_again(s3_model, s3_storage, model_cache):
    """A copy verified by older code (its marker lists sizes, no versions) is fetched once more."""
    local = resolve_model(s3_model, s3_storage)
    marker = os.path.join(local, COMPLETE_MARKER)
    record = json.load(open(marker))
    assert set(record["files"]["config.json"]) == {"size", "version"}
    record["files"] = {rel: stat["size"] for rel, stat in record["files"].items()}
    json.dump(record, open(marker, "w"))
    assert resolve_model(s3_model, s3_storage) == local
    assert len(downloads(model_cache)) == 2
    assert set(json.load(open(marker))["files"]["config.json"]) == {"size", "version"}
    assert resolve_model(s3_model, s3_storage) == local and len(downloads(model_cache)) == 2


def test_fingerprint_of_an_unreachable_hub_id_says_how_to_give_a_local_path(monkeypatch):
    """Offline (no request leaves the process), a hub id fails with one ModelSourceError line."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ModelSourceError) as info:
        fingerprint("no-such-org/no-such-dllm")
    message = str(info.value)
    assert "no-such-org/no-such-dllm" in message and "--local-dir" in message and "\n" not in message
