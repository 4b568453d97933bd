"""Issue 42, items 2 and 5: ray.data.llm's and vLLM's processor options.

- `should_continue_on_error` (ray.data.llm's, default False): one dataset of good and bad
  rows through `build_processor` on the session's Ray, twice: True passes the error rows
  with their `error`, False raises naming the first (its id and error).
- `revision`: a hub id's files at a revision, through the fetching code's one seam for hub
  ids (the hub cannot be reached here: huggingface_hub's fsspec filesystem and its
  snapshot_download stand on local folders, one per revision); refused with a folder.
- `chat_template_kwargs`: the tokenize stage as a run builds it renders a template that
  reads one.
- `accelerator_type`, `placement_group_config`: the engines' Ray options and the pool check.
"""
from __future__ import annotations

import os
import shutil

import pyarrow as pa
import pytest

from common.storage import describe_error


def processor_config(model: str, **kw):
    from engine import EngineConfig, SamplingParams
    from pipeline import DLLMProcessorConfig

    return DLLMProcessorConfig(model=model, num_engines=1, batch_size=8, max_concurrent_batches=1, dtype="float64",
                               wait_for_engines_s=0, sort="none",
                               engine=EngineConfig(block_length=4, steps_per_block=4, token_budget=1024),
                               sampling=SamplingParams(max_new_tokens=4, policy="fixed"), **kw)


# --- should_continue_on_error: acceptance 2 -----------------------------------------------------

ROWS = [{"id": "g0", "prompt": "copy: ab", "sampling_params": None},
        {"id": "long", "prompt": "copy: " + "ab" * 1000, "sampling_params": None},
        {"id": "g1", "prompt": "rev: abc", "sampling_params": None},
        {"id": "badp", "prompt": "copy: x", "sampling_params": {"top_p": 7.0}},
        {"id": "g2", "prompt": "copy: xyz", "sampling_params": None}]


def test_should_continue_on_error_passes_error_rows_or_raises_on_the_first(ray_local, tiny_model_dir):
    import ray

    from pipeline import build_processor

    def dataset():  # one block, one batch: "first" is the first in input order
        return ray.data.from_items(ROWS, override_num_blocks=1)

    rows = build_processor(processor_config(tiny_model_dir, should_continue_on_error=True))(dataset()).take_all()
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in ROWS)  # every row exactly once
    by_id = {r["id"]: r for r in rows}
    for rid in ("g0", "g1", "g2"):
        r = by_id[rid]
        assert r["error"] is None and r["finish_reason"] == "length" and r["num_generated_tokens"] == 4, r
    assert by_id["long"]["error"] == "prompt of 2006 tokens + 1 blocks of 4 exceeds the model context of 1024 tokens"
    assert by_id["badp"]["error"] == "bad sampling_params: top_p must be in (0, 1], got 7.0", by_id["badp"]
    for rid in ("long", "badp"):
        assert by_id[rid]["finish_reason"] == "error" and by_id[rid]["generated_text"] is None, by_id[rid]

    with pytest.raises(Exception) as info:  # the default, as ray.data.llm's
        build_processor(processor_config(tiny_model_dir))(dataset()).take_all()
    message = describe_error(info.value)
    assert message.endswith(
        f"ErrorRow: row with id 'long' failed: {by_id['long']['error']} (should_continue_on_error=False, "
        "ray.data.llm's default; True passes error rows through with their error column)"), message


def test_raise_on_error_rows_names_the_first_error_row():
    from pipeline.processor import ErrorRow, raise_on_error_rows

    batch = pa.table({"id": ["a", "b", "c"], "error": [None, "empty prompt", "other"]})
    with pytest.raises(ErrorRow, match=r"^row with id 'b' failed: empty prompt \(should_continue_on_error=False"):
        raise_on_error_rows(batch, id_column="id")
    with pytest.raises(ErrorRow, match=r"^row 1 of its batch \(no 'key' column\) failed: empty prompt"):
        raise_on_error_rows(batch, id_column="key")
    good = pa.table({"id": ["a"], "error": pa.array([None], pa.string())})
    assert raise_on_error_rows(good, id_column="id") is good


def test_the_job_passes_error_rows_whatever_the_config_says(tiny_model_dir):
    """run_offline keeps its max_error_fraction semantics: its processor lets error rows pass."""
    from pipeline.run import build_processor_for

    proc = build_processor_for(processor_config(tiny_model_dir))
    assert proc.config.should_continue_on_error is True


# --- revision: through the fetching code's seam for hub ids -------------------------------------

HUB_ID = "no-such-org/tiny-dllm"


@pytest.fixture
def hub(tmp_path, tiny_model_dir, monkeypatch):
    """The hub as local folders, one per revision ("main", and "v2" with one file more):
    huggingface_hub's fsspec filesystem (hf://org/name@rev, what SourceFiles lists and
    reads) and its snapshot_download (what resolve_model fetches) answer from them; the
    URLs and downloads asked for are recorded."""
    import fsspec
    import huggingface_hub

    import common.model_source as source

    folders = {"main": str(tmp_path / "main"), "v2": str(tmp_path / "v2"), "feature/x": str(tmp_path / "v2")}
    shutil.copytree(tiny_model_dir, folders["main"])
    shutil.copytree(tiny_model_dir, folders["v2"])
    with open(os.path.join(folders["v2"], "README.md"), "w") as f:
        f.write("revision v2\n")
    asked = {"urls": [], "downloads": []}
    real = source.get_filesystem

    def get_filesystem(url, storage=None):
        if not url.startswith("hf://"):
            return real(url, storage)
        asked["urls"].append(url)
        repo, _, rev = url.removeprefix("hf://").partition("@")
        assert repo == HUB_ID
        from urllib.parse import unquote

        return fsspec.filesystem("file"), folders[unquote(rev) or "main"]

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        asked["downloads"].append((repo_id, revision, allow_patterns))
        return folders[revision or "main"]

    monkeypatch.setattr(source, "get_filesystem", get_filesystem)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return folders, asked


def test_revision_reaches_the_hub_and_is_the_models_identity(hub, tiny_model_dir):
    from common.model_source import HUB_METADATA, fingerprint
    from pipeline.preflight import check_model
    from pipeline.run_record import build_record

    folders, asked = hub
    main = check_model(HUB_ID, needs_tokenizer=True)
    v2 = check_model(HUB_ID, needs_tokenizer=True, revision="v2")
    assert asked["urls"][:1] == [f"hf://{HUB_ID}"] and f"hf://{HUB_ID}@v2" in asked["urls"]
    assert (main.revision, v2.revision) == (None, "v2")
    # the files read are the revision's: its fingerprint, which the run record (a resume's check) holds
    assert main.fingerprint == fingerprint(folders["main"]) and v2.fingerprint == fingerprint(folders["v2"])
    assert main.fingerprint != v2.fingerprint
    assert v2.metadata_dir() == folders["v2"] and v2.weights_dir() == folders["v2"]  # the engines' copy
    assert (HUB_ID, "v2", HUB_METADATA) in asked["downloads"] and (HUB_ID, "v2", None) in asked["downloads"]
    from pipeline import build_processor

    assert build_processor(processor_config(HUB_ID, revision="v2")).checkpoint.fingerprint == v2.fingerprint
    record = build_record(processor_config(HUB_ID, revision="v2"), v2, None)
    assert record["model_sha256"] == v2.fingerprint and record["settings"]["revision"] == "v2"

    check_model(HUB_ID, needs_tokenizer=False, revision="feature/x")  # quoted as huggingface_hub expects
    assert asked["urls"][-1] == f"hf://{HUB_ID}@feature%2Fx"


def test_revision_flag_fetches_that_revision_and_is_refused_with_a_folder(hub, tiny_model_dir, tmp_path, capsys):
    from pipeline.cli import build_config, main, parse_args

    folders, asked = hub
    config = build_config(parse_args(["--model", HUB_ID, "--revision", "v2"]), 0)
    assert config.revision == "v2" and asked["downloads"] == [(HUB_ID, "v2", ["*.json", "*.txt", "*.model",
                                                                            "*.jinja", "tokenizer*"])]
    out = str(tmp_path / "out")
    assert main(["--model", tiny_model_dir, "--revision", "v2", "--output", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: revision 'v2' applies to hub ids only, and model {tiny_model_dir} is a local folder: "
                   "it would be ignored; drop --revision (or give the hub id)"], err
    assert not os.path.exists(out)
    with pytest.raises(ValueError, match="revision 'v2' applies to hub ids only"):
        processor_config(tiny_model_dir, revision="v2")


# --- chat_template_kwargs ---------------------------------------------------------------------

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}. {% endfor %}"
            "{% if enable_thinking %}think: {% endif %}assistant: ")


def test_chat_template_kwargs_reach_the_template(tiny_model_dir):
    from pipeline import build_processor
    from pipeline.cli import build_config, parse_args

    batch = pa.table({"id": ["a"], "messages": [[{"role": "user", "content": "rev: ab"}]]})
    prompts = {}
    for kwargs in (None, {"enable_thinking": True}, {"enable_thinking": False}):
        cfg = processor_config(tiny_model_dir, chat_template=TEMPLATE, chat_template_kwargs=kwargs)
        out = build_processor(cfg).tokenize_udf()(batch)  # the tokenize stage as a run builds it
        prompts[str(kwargs)] = out.column("prompt")[0].as_py()
        assert out.column("__error").to_pylist() == [None]
    assert prompts == {"None": "user: rev: ab. assistant: ", "{'enable_thinking': False}": "user: rev: ab. assistant: ",
                       "{'enable_thinking': True}": "user: rev: ab. think: assistant: "}, prompts

    args = parse_args(["--model", tiny_model_dir, "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert build_config(args, 0).chat_template_kwargs == {"enable_thinking": False}
    for bad in ("[1]", "{nope"):
        with pytest.raises(SystemExit) as info:
            parse_args(["--model", tiny_model_dir, "--chat-template-kwargs", bad])
        assert info.value.code == 2
    with pytest.raises(ValueError, match="chat_template_kwargs must be a dict"):
        processor_config(tiny_model_dir, chat_template_kwargs=["enable_thinking"])


# --- accelerator_type, placement_group_config -------------------------------------------------

def test_accelerator_type_and_placement_group_config_are_the_engines_ray_options(tiny_model_dir):
    import ray

    from actors.engine_actor import DLLMEngineActor
    from pipeline import DLLMProcessorConfig
    from pipeline.preflight import JobError
    from pipeline.processor import DLLMProcessor
    from pipeline.resources import Cluster, check_resources, local_cluster

    accel = DLLMProcessorConfig(model="m", num_engines=2, accelerator_type="H200")
    pg = DLLMProcessorConfig(model="m", accelerator_type="H200", placement_group_config={
        "bundles": [{"GPU": 1, "CPU": 2}, {"CPU": 1, "nvme": 1}], "strategy": "STRICT_PACK"})
    assert accel.engine_resources(0) == {"num_gpus": 1.0, "num_cpus": 1.0, "device": "cuda",
                                         "resources": {"accelerator_type:H200": 0.001}}
    assert pg.engine_resources(0) == {"num_gpus": 1.0, "num_cpus": 3.0, "device": "cuda",
                                      "resources": {"nvme": 1.0, "accelerator_type:H200": 0.001}}
    options = DLLMProcessor(pg).engine_options()
    assert options == {"num_cpus": 3.0, "num_gpus": 1.0, "scheduling_strategy": "SPREAD",
                       "resources": {"nvme": 1.0, "accelerator_type:H200": 0.001}}
    ray.remote(DLLMEngineActor).options(**options)  # what Ray takes for an actor (as its accelerator_type option)

    h200 = {"CPU": 16.0, "GPU": 2.0, "accelerator_type:H200": 1.0, "nvme": 1.0}
    a100 = {"CPU": 16.0, "GPU": 8.0, "accelerator_type:A100-80G": 1.0}
    check_resources(accel, Cluster({"CPU": 32.0, "GPU": 10.0, "accelerator_type:H200": 1.0,
                                    "accelerator_type:A100-80G": 1.0}, [h200, a100]))
    with pytest.raises(JobError) as info:
        check_resources(accel, Cluster(a100, [a100]))
    assert str(info.value) == ("accelerator_type 'H200': no node of the cluster has GPUs of that type (its GPU "
                               "types: A100-80G): the engines could never start. Give the type Ray reports for the "
                               "cluster's GPUs, or drop it (--accelerator-type)")
    with pytest.raises(JobError, match=r"^accelerator_type 'H200': no node of the local Ray \(--num-cpus 2\) has GPUs "
                                       r"of that type \(its GPU types: none\)"):
        check_resources(accel, local_cluster(2))  # this machine: no GPU at all
    small = {"CPU": 2.0, "GPU": 1.0, "accelerator_type:H200": 1.0}
    with pytest.raises(JobError) as info:
        check_resources(pg, Cluster({"CPU": 4.0, "GPU": 2.0, "accelerator_type:H200": 2.0}, [small, small]))
    assert str(info.value) == ("one engine needs 3 CPU, 1 GPU, GPUs of type H200 on a single node, and no node of the "
                               "cluster has that much: ask less per engine (--placement-group-config, "
                               "--accelerator-type)")

    refusals = {
        "strategy SPREAD over 2 bundles": dict(placement_group_config={"bundles": [{"GPU": 1}, {"GPU": 1}],
                                                                        "strategy": "SPREAD"}),
        "unknown key(s) 'resources_per_bundle'": dict(placement_group_config={"resources_per_bundle": {"GPU": 1}}),
        "and so does --num-gpus-per-engine": dict(placement_group_config={"bundles": [{"GPU": 1}]},
                                                  num_gpus_per_engine=1),
        "bundles[0]['GPU'] must be a finite amount >= 0": dict(placement_group_config={"bundles": [{"GPU": -1}]}),
        "accelerator_type 'H200' is a GPU type, and each engine asks for no GPU": dict(
            accelerator_type="H200", num_gpus_per_engine=0),
        "postprocess_error_rows=True needs should_continue_on_error=True": dict(postprocess_error_rows=True),
    }
    for words, kw in refusals.items():
        with pytest.raises(ValueError) as info:
            DLLMProcessorConfig(model="m", **kw)
        assert words in str(info.value), (words, str(info.value))
