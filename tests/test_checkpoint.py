"""The Checkpoint (engine/checkpoint.py): a model is read once, by the job's preflight, and
every part of a run reads what it found (issue 36, acceptance 2 and 3)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from conftest import ROOT
from engine.checkpoint import Checkpoint
from pipeline import DLLMProcessorConfig
from pipeline.run_record import build_record
from pipeline.sorting.order import cost_model
from procs import private_ray, ray_temp_dir

# In every Python process that starts with this on its path (the job's driver and every
# process of its local Ray: dispatchers, the group actor, the engine, the stage tasks),
# each open of the model's config.json is written down, with the process's command line,
# and each open of a tokenizer file (TOKENIZER_AUDIT) as "<file> <blockray|transformers>",
# by who opened it.
AUDIT = '''
import os
import sys

_target = os.environ.get("AUDIT_CONFIG_JSON")
_tokenizer = {os.path.join(os.path.dirname(_target), n) for n in os.environ.get("AUDIT_TOKENIZER", "").split()
              } if _target else set()
if _target:
    _me = os.path.join(os.environ["AUDIT_DIR"], str(os.getpid()))
    with open(_me + ".alive", "w") as _f:
        _f.write(" ".join(sys.argv)[:300])

    def _by():
        frame = sys._getframe(2)
        while frame is not None:
            if os.sep + "transformers" + os.sep in frame.f_code.co_filename:
                return "transformers"
            frame = frame.f_back
        return "blockray"

    def _hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if path == _target:
                with open(_me + ".opens", "a") as f:
                    f.write(" ".join(sys.argv)[:300] + "\\n")
            elif path in _tokenizer:
                with open(_me + ".tok", "a") as f:
                    f.write(os.path.basename(path) + " " + _by() + "\\n")

    sys.addaudithook(_hook)
'''
TOKENIZER_AUDIT = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def test_a_cli_run_opens_config_json_once(tiny_model_dir, tmp_path):
    """A tiny job (local model, one engine, its own local Ray) with an audit hook in every
    process: no process opens the model's config.json more than once (the driver's
    preflight does, once), and the hook was in the Ray workers that ran the job. The
    tokenizer files (issue 52): the driver's blockray code opens each once (the Checkpoint),
    and no process loads the tokenizer more than once (transformers opens tokenizer.json once
    per load) nor opens a tokenizer file itself more than once."""
    model, hook, audit = tmp_path / "model", tmp_path / "hook", tmp_path / "audit"
    shutil.copytree(tiny_model_dir, model)
    hook.mkdir()
    audit.mkdir()
    (hook / "sitecustomize.py").write_text(AUDIT)
    inp = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(6)], "prompt": [f"copy: {'abcdef'[:i + 1]}"
                                                                          for i in range(6)]}), inp)
    env = dict(os.environ, AUDIT_CONFIG_JSON=os.path.realpath(model / "config.json"), AUDIT_DIR=str(audit),
               AUDIT_TOKENIZER=" ".join(TOKENIZER_AUDIT), PYTHONPATH=os.pathsep.join([str(hook), ROOT]))
    with ray_temp_dir() as temp_dir:
        res = subprocess.run([sys.executable, "jobs/offline_eval.py", "--model", str(model), "--input", inp,
                              "--output", str(tmp_path / "out"), "--num-engines", "1", "--batch-size", "3",
                              "--no-dashboard", *private_ray(temp_dir)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    opens = {f: open(audit / f).read().splitlines() for f in os.listdir(audit) if f.endswith(".opens")}
    assert [len(lines) for lines in opens.values()] == [1], opens  # the driver's, once
    assert "offline_eval.py" in next(iter(opens.values()))[0]
    workers = [f for f in os.listdir(audit) if f.endswith(".alive") and "default_worker.py" in open(audit / f).read()]
    assert len(workers) >= 3, os.listdir(audit)  # the engine, its dispatcher, the group actor, stage tasks
    driver = next(iter(opens)).removesuffix(".opens")
    tok = {f.removesuffix(".tok"): Counter(open(audit / f).read().splitlines()) for f in os.listdir(audit)
           if f.endswith(".tok")}
    assert all(tok[driver][f"{name} blockray"] == 1 for name in TOKENIZER_AUDIT), tok[driver]
    assert tok[driver]["tokenizer.json transformers"] == 1, tok[driver]  # loaded (checked) once
    for pid, seen in tok.items():
        assert all(n <= 1 for line, n in seen.items() if line.endswith(" blockray")), (pid, seen)
        assert seen["tokenizer.json transformers"] <= 1, (pid, seen)  # one load per process


def test_the_same_files_from_s3_and_a_folder_are_one_checkpoint(tiny_model_dir, s3fs_client, s3_storage):
    """The same files served from s3:// (moto) and from a local folder: one fingerprint, one
    ModelConfig, one run-record hash, one sorter cost model (a remote model no longer falls
    back to a cruder one)."""
    bucket = f"models-{uuid.uuid4().hex[:8]}"
    s3fs_client.mkdir(bucket)
    s3fs_client.put(tiny_model_dir.rstrip("/") + "/", f"{bucket}/tiny/", recursive=True)
    local, remote = Checkpoint.open(tiny_model_dir), Checkpoint.open(f"s3://{bucket}/tiny", storage=s3_storage)
    assert remote.fingerprint == local.fingerprint and remote.config == local.config
    assert remote.tensors == local.tensors and remote.stops == local.stops
    cfg = DLLMProcessorConfig(model=tiny_model_dir)
    assert build_record(cfg, remote, None)["model_sha256"] == build_record(cfg, local, None)["model_sha256"]
    for device in ("cpu", "cuda"):
        assert cost_model(cfg, device, remote) == cost_model(cfg, device, local)
