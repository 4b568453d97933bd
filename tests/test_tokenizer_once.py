"""The tokenizer files are read once (issue 52, item 7): on the driver, blockray reads each
of them once (the Checkpoint's SourceFiles: fingerprint and TokenizerFacts) and
transformers loads the tokenizer once (its own reads of the folder; common.tokenizer is
given the Checkpoint's parse of tokenizer_config.json, not opening it again); a remote
(s3://) model's tokenizer files cross the network once, whether the node copy was fetched
first (the CLI's blockray.json look-up) or not (a Python caller's preflight)."""
from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Run in a fresh interpreter: the job's preflight on a local model, with an audit hook
# writing down each open of a file in the model folder and whether transformers opened it.
DRIVER = '''
import json, os, sys
model = os.path.realpath(sys.argv[1])
opens = []

def _hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if path.startswith(model + os.sep):
            frame, by = sys._getframe(1), "blockray"
            while frame is not None:
                if os.sep + "transformers" + os.sep in frame.f_code.co_filename:
                    by = "transformers"
                    break
                frame = frame.f_back
            opens.append([path[len(model) + 1:], by])

sys.addaudithook(_hook)
from pipeline import DLLMProcessorConfig
from pipeline.preflight import preflight

checked = preflight(sys.argv[2], sys.argv[3], DLLMProcessorConfig(model=model))
checked.checkpoint.load_tokenizer()  # cached: the run's later readers load nothing again
checked.release()
print(json.dumps(opens))
'''


def test_the_preflight_reads_each_tokenizer_file_once(tiny_model_dir, tmp_path):
    """A local model's preflight (text prompts: the tokenizer is loaded and checked): each
    tokenizer file opened once by blockray, and once by transformers' one load of the
    tokenizer, except tokenizer_config.json, which transformers' from_pretrained itself opens
    twice (once for `fast_tokenizer_files`, once for the init kwargs)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    inp = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["copy: ab", "copy: abc"]}), inp)
    res = subprocess.run([sys.executable, "-c", DRIVER, str(model), inp, str(tmp_path / "out")], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    opens = collections.Counter(tuple(o) for o in json.loads(res.stdout.strip().splitlines()[-1]))
    for name in TOKENIZER_FILES:
        assert opens[(name, "blockray")] == 1, opens
    assert opens[("tokenizer.json", "transformers")] == 1, opens  # one load
    assert opens[("special_tokens_map.json", "transformers")] <= 1, opens
    assert opens[("tokenizer_config.json", "transformers")] <= 2, opens  # from_pretrained's own two
    assert opens[("config.json", "blockray")] == 1 and ("config.json", "transformers") not in opens, opens


@pytest.fixture
def fetches(monkeypatch):
    """{path: whole-file fetches from S3} of the files named TOKENIZER_FILES, counted in s3fs
    (cat_file of the whole file, get_file), for S3 filesystems made from here on."""
    import s3fs

    counted: collections.Counter = collections.Counter()
    cat, get = s3fs.S3FileSystem._cat_file, s3fs.S3FileSystem._get_file

    async def _cat_file(self, path, version_id=None, start=None, end=None, **kw):
        if start is None and end is None and path.rsplit("/", 1)[-1] in TOKENIZER_FILES:
            counted[path.rsplit("/", 1)[-1]] += 1
        return await cat(self, path, version_id=version_id, start=start, end=end, **kw)

    async def _get_file(self, rpath, lpath, **kw):
        if rpath.rsplit("/", 1)[-1] in TOKENIZER_FILES:
            counted[rpath.rsplit("/", 1)[-1]] += 1
        return await get(self, rpath, lpath, **kw)

    s3fs.S3FileSystem.clear_instance_cache()  # instances bind their methods when made
    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", _cat_file)
    monkeypatch.setattr(s3fs.S3FileSystem, "_get_file", _get_file)
    yield counted
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize("copy_first", [False, True], ids=["python-caller", "cli-order"])
def test_a_remote_models_tokenizer_files_are_fetched_once(tiny_model_dir, s3fs_client, s3_storage, tmp_path,
                                                          monkeypatch, fetches, copy_first):
    """An s3:// model through the driver's checks (Checkpoint, tokenizer check, the chat
    template's and the stages' folder): each tokenizer file fetched once. `cli-order`: the
    node's metadata copy fetched first (pipeline.cli.build_config reads blockray.json from
    it), then the Checkpoint reads the files from that verified copy."""
    from common.model_source import resolve_model
    from engine.checkpoint import Checkpoint
    from pipeline.preflight import check_model

    monkeypatch.setenv("BLOCKRAY_MODEL_CACHE", str(tmp_path / "cache"))
    bucket = f"models-{uuid.uuid4().hex[:8]}"
    s3fs_client.mkdir(bucket)
    s3fs_client.put(tiny_model_dir.rstrip("/") + "/", f"{bucket}/tiny/", recursive=True)
    url = f"s3://{bucket}/tiny"
    if copy_first:
        resolve_model(url, s3_storage.resolved(), weights=False)
    ckpt = check_model(url, needs_tokenizer=True, storage=s3_storage)
    local = ckpt.metadata_dir()
    assert ckpt.load_tokenizer() is not None and ckpt.metadata_dir() == local
    assert resolve_model(url, s3_storage.resolved(), weights=False) == local  # a stage's look-up: the same copy
    assert sorted(fetches) == sorted(TOKENIZER_FILES) and set(fetches.values()) == {1}, fetches
    assert not [f for f in os.listdir(local) if f.endswith(".safetensors")]
    local_ckpt = Checkpoint.open(tiny_model_dir)
    assert ckpt.fingerprint == local_ckpt.fingerprint and ckpt.tokenizer == local_ckpt.tokenizer


def test_a_pickled_checkpoint_carries_neither_the_files_nor_the_drivers_folder(tiny_model_dir, s3fs_client,
                                                                               s3_storage, tmp_path, monkeypatch):
    """What the Checkpoint read (its SourceFiles' bytes) and where this node's copy is stay in
    the process that opened it: an engine on another node finds its own copy."""
    import pickle

    monkeypatch.setenv("BLOCKRAY_MODEL_CACHE", str(tmp_path / "cache"))
    bucket = f"models-{uuid.uuid4().hex[:8]}"
    s3fs_client.mkdir(bucket)
    s3fs_client.put(tiny_model_dir.rstrip("/") + "/", f"{bucket}/tiny/", recursive=True)
    from engine.checkpoint import Checkpoint

    ckpt = Checkpoint.open(f"s3://{bucket}/tiny", storage=s3_storage.resolved())
    ckpt.metadata_dir()
    copy = pickle.loads(pickle.dumps(ckpt))
    assert copy._files is None and copy._metadata is None and copy == ckpt
    assert copy.metadata_dir() == ckpt.metadata_dir()  # fetch_remote finds the copy the driver wrote


def test_the_tokenizer_check_still_refuses_what_does_not_load(tiny_model_dir, tmp_path):
    """Checkpoint.load_tokenizer keeps the preflight's check: a tokenizer.json that is JSON
    but no tokenizer, and a model without tokenizer files, are refused naming --model."""
    from pipeline.errors import JobError
    from pipeline.preflight import check_model

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer.json").write_text(json.dumps({"added_tokens": []}))
    with pytest.raises(JobError, match=r"model: the tokenizer in .*broken does not load: ") as e:
        check_model(str(broken), needs_tokenizer=True)
    assert e.value.options == ("model",)
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    for name in TOKENIZER_FILES:
        (bare / name).unlink()
    with pytest.raises(JobError, match=r"model: .*bare has no tokenizer files, needed for text prompts"):
        check_model(str(bare), needs_tokenizer=True)
    assert check_model(str(bare), needs_tokenizer=False).tokenizer.present is False  # token-id prompts need none
