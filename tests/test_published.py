"""Every published file set vendored under tests/published/ (the files people download,
byte for byte) against blockray: a family it serves loads (tests/published.py builds a
tiny checkpoint from the published files, only sizes shrunk), generates, passes the
preflight and runs a 10-row job with the published stop ids, mask id and chat template;
a family it does not serve is refused naming its model_type. The expected values are
read from the published files here, never from the engine."""
from __future__ import annotations

import filecmp
import os
from typing import Any, Dict, List, Optional, Tuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import published
from conftest import read_parts
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, load_model
from engine.models.families import FamilyNotSupported
from pipeline import DLLMProcessorConfig
from pipeline.run import JobError, preflight, run_offline

# model_type of each vendored config.json: served today, or not (yet). A folder of another
# model_type fails test_every_vendored_folder_is_classified until it is put in one of them.
# ("Dream" covers DreamReasoner's config.json, told apart by its architecture; "llama" is served only as
# Stable-DiffCoder, by its architecture: a plain Llama is refused, tests/test_stable_diffcoder.py; "illada": the
# rebuilt iLLaDA config.json, recognised by its architecture ILLaDAForCausalLM, tests/test_illada.py)
SERVED = {"llada", "Dream", "llada2_moe", "sdar", "sdar_moe", "Fast_dLLM_Qwen", "llama", "illada",
          "nemotron_labs_diffusion"}
NOT_SERVED: set = set()  # none today (SDAR / SDAR-MoE were, until issue 38)

FOLDERS = published.folders()
# config.json rebuilt from located values (SOURCE.md says so; no byte copy reachable, no tokenizer files)
REBUILT = published.rebuilt_folders()


def model_type(folder: str) -> str:
    return published.config(folder)["model_type"]


SERVED_FOLDERS = [f for f in FOLDERS if model_type(f) in SERVED]
REBUILT_SERVED = [f for f in REBUILT if model_type(f) in SERVED]
NOT_SERVED_FOLDERS = [f for f in FOLDERS if model_type(f) in NOT_SERVED]

ENGINE = EngineConfig(block_length=4, steps_per_block=4, cache="refresh", token_budget=2048, max_batch_size=8)
SAMPLING = SamplingParams(max_new_tokens=8, policy="fixed")
# the block-causal families (LLaDA2, SDAR) as their docs run them: the persistent cache; LLaDA2.x with the threshold
# rule and 2.1's token editing
PERSISTENT_ENGINE = EngineConfig(block_length=4, steps_per_block=4, cache="persistent", token_budget=2048,
                                 max_batch_size=8)
LLADA2_SAMPLING = SamplingParams(max_new_tokens=8, threshold=0.95, edit_threshold=0.9)
# SDAR / TraDo as docs/models/sdar.md's command runs them: blocks of 4, 4 steps, low_confidence_dynamic 0.9
SDAR_SAMPLING = SamplingParams(max_new_tokens=8, threshold=0.9)
# Fast-dLLM v2 as docs/models/fast_dllm_v2.md runs it: blocks of 32 (bd_size) in sub-blocks of 8, threshold 0.9
FAST_DLLM_V2_ENGINE = EngineConfig(block_length=32, steps_per_block=32, cache="persistent", token_budget=2048,
                                   max_batch_size=8)
FAST_DLLM_V2_SAMPLING = SamplingParams(max_new_tokens=8, threshold=0.9, sub_block_length=8)
# DreamReasoner and Stable-DiffCoder as docs/usage.md runs them: blocks of 32 (DreamReasoner's config block_size,
# Diffulex's default), one step per position, threshold 0.9 (generation_utils' and Diffulex's accept_threshold)
BLOCK32_ENGINE = EngineConfig(block_length=32, steps_per_block=32, cache="persistent", token_budget=2048,
                              max_batch_size=8)
BLOCK32_SAMPLING = SamplingParams(max_new_tokens=8, threshold=0.9)
# LLaDA2.2 (a config naming the edit tokens) as docs/models/llada2.md runs it: its edit loop (preset llada2.2's
# thresholds), blocks of its routing block_size 32
LLADA22_SAMPLING = SamplingParams(max_new_tokens=8, edit_ops=True, threshold=0.5, edit_threshold=0.0)
USER = "copy: abc"
MESSAGES = [[{"role": "user", "content": f"copy: {'abcdefgh'[: i % 8 + 1]}"}] for i in range(10)]
# tokenizer_config.json tokenizer_class -> the class common.tokenizer reads it with
TOKENIZER_CLASS = {"PreTrainedTokenizerFast": "TokenizersBackend", "DreamTokenizer": "Qwen2Tokenizer",
                   "Qwen2Tokenizer": "Qwen2Tokenizer"}


def settings(folder: str) -> Tuple[EngineConfig, SamplingParams]:
    """The engine and sampling settings of the folder's family (small: each job ~10 s), by the
    family's model_type (DreamReasoner's config.json says "Dream", Stable-DiffCoder's "llama")."""
    if "delete_token_id" in published.config(folder):  # LLaDA2.2
        return BLOCK32_ENGINE, LLADA22_SAMPLING
    return {"llada2_moe": (PERSISTENT_ENGINE, LLADA2_SAMPLING), "sdar": (PERSISTENT_ENGINE, SDAR_SAMPLING),
            "sdar_moe": (PERSISTENT_ENGINE, SDAR_SAMPLING), "Fast_dLLM_Qwen": (FAST_DLLM_V2_ENGINE, FAST_DLLM_V2_SAMPLING),
            "dream_reasoner": (BLOCK32_ENGINE, BLOCK32_SAMPLING),
            "stable_diffcoder": (BLOCK32_ENGINE, BLOCK32_SAMPLING),
            "illada": (ENGINE, SAMPLING),  # LLaDA's generate() (its README: mask_id=5 reuses it): fixed schedule
            # Nemotron-Labs-Diffusion's generate() as its docstring calls it: block_length 32, threshold 0.9
            "nemotron_labs_diffusion": (BLOCK32_ENGINE, BLOCK32_SAMPLING),
            }.get(ModelConfig.from_hf(published.config(folder)).model_type, (ENGINE, SAMPLING))


# --- what the published files say --------------------------------------------------------

def render(folder: str, messages: List[Dict[str, str]]) -> str:
    """The published chat template rendered as transformers renders it (a sandboxed jinja2
    with trim_blocks / lstrip_blocks, the special tokens as variables)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tc = published.tokenizer_config(folder)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    specials = {k: published.token_text(v) for k, v in tc.items() if k.endswith("_token") and not k.startswith("add_")}
    return env.from_string(published.chat_template(folder)).render(messages=messages, add_generation_prompt=True,
                                                                    **specials)


def _ids(value: Any) -> List[int]:
    return value if isinstance(value, list) else [] if value is None else [value]


def end_of_turn(folder: str) -> Optional[str]:
    """The added token the published chat template closes a message with, if it numbers
    one (LLaDA: <|eot_id|>; Dream: <|im_end|>; LLaDA2's <|role_end|> has no id in its files)."""
    text = render(folder, [{"role": "user", "content": "MARK"}])
    after = text[text.index("MARK") + 4:]
    return next((t["content"] for t in published.added_tokens(folder).values() if after.startswith(t["content"])),
                None)


def expected_stops(folder: str) -> Dict[int, str]:
    """{stop id: where the published files give it}, in the order the engine reports them."""
    hf, tc = published.config(folder), published.tokenizer_config(folder)
    gen = published.read_json(folder, "generation_config.json") or {}
    ids = published.published_ids(folder)
    stops: Dict[int, str] = {}
    for t in _ids(hf.get("eos_token_id")):  # config.json eos_token_id: LLaDA 126081, Dream 151643
        stops.setdefault(t, "config.json eos_token_id")
    for t in _ids(gen.get("eos_token_id")):  # generation_config.json: LLaDA's and Dream's repeat config.json's
        stops.setdefault(t, "generation_config.json eos_token_id")
    eot = end_of_turn(folder)  # tokenizer_config.json added_tokens_decoder: <|eot_id|> 126348, <|im_end|> 151645
    if eot is not None:
        stops.setdefault(ids[eot], f"chat template end of turn {eot}")
    if not stops:  # LLaDA2 names no eos id: tokenizer_config.json eos_token <|endoftext|>, whose id 156892 is
        eos = published.token_text(tc["eos_token"])  # config.json pad_token_id (pad_token is the same token)
        stops[ids[eos]] = "tokenizer_config.json eos_token"
    return stops


def _messages_input(path: str) -> str:
    pq.write_table(pa.table({"id": [f"m{i}" for i in range(10)], "messages": MESSAGES}), path)
    return path


# --- the vendored files -------------------------------------------------------------------

def test_vendored_files_are_the_published_files():
    """Where the shared copies exist (<repo>/../shared/checkpoints), every published set
    there (a folder with a config.json) is vendored, file for file, byte for byte; a set
    added there later fails here until it is vendored."""
    if not os.path.isdir(published.SHARED):
        pytest.skip(f"{published.SHARED} is absent (a clean clone): the vendored copies are the reference")
    shared = sorted(d for d in os.listdir(published.SHARED)
                    if os.path.isfile(os.path.join(published.SHARED, d, "config.json")))
    assert FOLDERS == shared
    for folder in REBUILT:  # rebuilt only where the shared copies hold no config.json to vendor
        assert os.path.isfile(os.path.join(published.SHARED, folder, "SOURCE.md")), folder
        assert not os.path.isfile(os.path.join(published.SHARED, folder, "config.json")), folder
        assert os.listdir(published.path(folder)) and set(os.listdir(published.path(folder))) == {"config.json",
                                                                                                 "SOURCE.md"}, folder
    for folder in shared:
        names = sorted(os.listdir(os.path.join(published.SHARED, folder)))
        assert sorted(os.listdir(published.path(folder))) == names, folder
        _, mismatch, errors = filecmp.cmpfiles(os.path.join(published.SHARED, folder), published.path(folder), names,
                                               shallow=False)
        assert (mismatch, errors) == ([], []), folder


def test_every_vendored_folder_is_classified():
    """Each vendored set says where it comes from, and its model_type is one blockray
    serves or one it is known not to (so a new set is never silently skipped)."""
    assert FOLDERS and all(os.path.isfile(published.path(f, "SOURCE.md")) for f in FOLDERS)
    assert {f: model_type(f) for f in FOLDERS + REBUILT if model_type(f) not in SERVED | NOT_SERVED} == {}
    assert all(os.path.isfile(published.path(f, "SOURCE.md")) for f in REBUILT)
    assert SERVED_FOLDERS


# --- a family blockray does not serve -----------------------------------------------------

@pytest.mark.parametrize("folder", NOT_SERVED_FOLDERS, ids=[f"{f}-not-served" for f in NOT_SERVED_FOLDERS])
def test_family_blockray_does_not_serve_is_refused(folder, tmp_path):
    """Not served yet (SDAR today): the published config.json is refused naming its
    model_type, by the engine's parser and by the job's preflight (before any engine),
    never run as another family."""
    mt = model_type(folder)
    with pytest.raises(FamilyNotSupported, match=f"model_type {mt!r} in config.json is not a family blockray "
                                                 "supports"):
        ModelConfig.from_hf(published.config(folder))
    config = DLLMProcessorConfig(model=published.path(folder), engine=ENGINE, sampling=SAMPLING)
    with pytest.raises(JobError, match=r"\(--model\)") as e:
        preflight(_messages_input(str(tmp_path / "in.parquet")), str(tmp_path / "out"), config)
    assert f"model_type {mt!r}" in str(e.value)


# --- a family blockray serves -------------------------------------------------------------

def _ten_row_chat_job(folder, root, engine, sampling, stops, tmp_path):
    """The preflight and a 10-row job of chat messages over the tiny build at `root`: every id
    once, each prompt rendered with the template, the summary naming where each stop id came
    from. Returns the output rows."""
    inp, out = _messages_input(str(tmp_path / "in.parquet")), str(tmp_path / "out")
    config = DLLMProcessorConfig(model=root, batch_size=5, engine=engine, sampling=sampling, enable_metrics=False)
    assert preflight(inp, str(tmp_path / "checked"), config).source.num_rows == 10
    summary = run_offline(inp, out, config)
    assert (summary["rows"], summary["errors"], summary["status"]) == (10, 0, "ok")
    assert summary["stop_token_ids"] == {str(t): src for t, src in stops.items()}
    rows = read_parts(out).to_pylist()
    assert sorted(r["id"] for r in rows) == [f"m{i}" for i in range(10)]
    assert {r["id"]: r["prompt"] for r in rows} == {f"m{i}": render(folder, m) for i, m in enumerate(MESSAGES)}
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)
    return rows


@pytest.mark.parametrize("folder", SERVED_FOLDERS, ids=[f"{f}-served" for f in SERVED_FOLDERS])
def test_published_checkpoint_loads_generates_and_runs_the_job(folder, ray_local, tmp_path):
    """The tiny build of the published set: its tokenizer, stop ids, mask id and chat
    template as published; Engine.generate on a prompt rendered with its own template;
    the preflight; a 10-row job of chat messages (every id once, each prompt rendered with
    the template, the summary naming where each stop id came from)."""
    root = published.build(folder, str(tmp_path / folder))
    model, tok = load_model(root, dtype=torch.float32)
    tc = published.tokenizer_config(folder)
    assert type(tok).__name__ == TOKENIZER_CLASS[tc["tokenizer_class"]]
    stops = expected_stops(folder)
    assert model.config.stop_token_ids == list(stops)
    eos = published.token_text(tc["eos_token"])  # tokenizer_config.json eos_token, at its published id
    assert (tok.eos_token, tok.eos_token_id) == (eos, published.published_ids(folder)[eos])
    mask, mask_id = published.mask_token(folder)  # config.json mask_token_id, else tokenizer_config.json's
    assert tok.convert_tokens_to_ids(mask) == mask_id == model.config.mask_token_id
    chat = render(folder, [{"role": "user", "content": USER}])
    assert tok.apply_chat_template([{"role": "user", "content": USER}], tokenize=False,
                                   add_generation_prompt=True) == chat
    engine, sampling = settings(folder)
    outs = Engine(model, engine, tokenizer=tok).generate([chat, "copy: the"], sampling)
    assert [o.error for o in outs] == [None, None]
    assert all(o.finish_reason in ("stop", "length") and len(o.token_ids) <= 8 for o in outs)

    _ten_row_chat_job(folder, root, engine, sampling, stops, tmp_path)


@pytest.mark.parametrize("folder", REBUILT_SERVED, ids=[f"{f}-rebuilt" for f in REBUILT_SERVED])
def test_rebuilt_config_loads_generates_and_runs_the_job(folder, ray_local, tmp_path):
    """A config.json rebuilt from located values (no tokenizer files located): tests/published.py
    build_from_config (sizes shrunk, weights under the family's names), load_model (no
    tokenizer), Engine.generate, the preflight and a 10-row job of pre-tokenized prompts, the
    mask and stop ids config.json names, else the family's published defaults."""
    hf = published.config(folder)
    root = published.build_from_config(hf, str(tmp_path / folder))
    model, tok = load_model(root, dtype=torch.float32)
    cfg = model.config
    assert tok is None and cfg.family.matches(hf)
    if hf["model_type"] in ("Dream", "llama"):  # DreamReasoner, Stable-DiffCoder: told apart by their keys
        assert cfg.model_type != hf["model_type"]
    assert cfg.mask_token_id == hf.get("mask_token_id", cfg.family.defaults["mask_token_id"])
    eos = hf.get("eos_token_id", cfg.family.defaults["eos_token_id"])
    assert cfg.stop_token_ids == [eos]
    engine, sampling = settings(folder)
    prompts = [[6 + j % 20 for j in range(3 + 4 * i)] for i in range(10)]  # ids 6..25: Stable-DiffCoder's toy vocab 32
    outs = Engine(model, engine).generate(prompts[:2], sampling)
    assert [o.error for o in outs] == [None, None]
    assert all(o.finish_reason in ("stop", "length") and len(o.token_ids) <= 8 for o in outs)

    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(10)], "prompt_token_ids": prompts}), inp)
    config = DLLMProcessorConfig(model=root, batch_size=5, engine=engine, sampling=sampling, enable_metrics=False)
    assert preflight(inp, str(tmp_path / "checked"), config).source.num_rows == 10
    summary = run_offline(inp, out, config)
    assert (summary["rows"], summary["errors"], summary["status"]) == (10, 0, "ok")
    # the summary names the stop ids the engine stops at, a family's default eos with where it came from
    assert set(summary["stop_token_ids"]) == {str(eos)}
    rows = read_parts(out).to_pylist()
    assert sorted(r["id"] for r in rows) == [f"r{i}" for i in range(10)]
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)


# --- d3LLM: multi-block decoding on the weights it distils -----------------------------------
# d3LLM's own checkpoint files: only their generation_config.json were located (the public docs index:
# https://huggingface.co/d3LLM/d3LLM_LLaDA/blob/main/generation_config.json, d3LLM_Dream's and d3LLM_Dream_Coder's);
# no config.json, tokenizer_config.json or chat template of d3LLM's is reachable (REFERENCES.md "d3LLM"), so no
# tests/published/d3LLM__* folder. d3LLM_LLaDA is LLaDA-8B-Instruct's architecture and weight names (SGLang loads it
# as LLaDAModelLM) and its located generation_config.json names LLaDA-8B-Instruct's ids: the job runs on that folder.
# (d3LLM_Dream's located generation_config.json is Dream-v0-Instruct-7B's key for key, transformers_version aside.)
D3LLM_LLADA_GENERATION = {"_from_model_config": True, "bos_token_id": 126080, "eos_token_id": 126081,
                          "transformers_version": "4.49.0"}  # d3LLM/d3LLM_LLaDA generation_config.json, as located
D3LLM_FOLDERS = [f for f in SERVED_FOLDERS if f == "GSAI-ML__LLaDA-8B-Instruct"]
# d3LLM's loop (SGLang FullAttnMultiBlock): no cache, blocks of 4 here; on the tiny random weights every entropy is
# about ln(vocabulary) (~11.7 nats), so the job's threshold 20 commits every eligible mask (a block per forward) where
# the published 0.4 commits one forced mask per forward (Engine.generate below)
D3LLM_ENGINE = EngineConfig(block_length=4, steps_per_block=4, cache="none", token_budget=2048, max_batch_size=8)
D3LLM_SAMPLING = SamplingParams(max_new_tokens=8, multi_block=True, entropy_threshold=20.0)


@pytest.mark.parametrize("folder", D3LLM_FOLDERS, ids=[f"{f}-multi-block" for f in D3LLM_FOLDERS])
def test_multi_block_job_on_the_weights_d3llm_distils(folder, ray_local, tmp_path):
    """d3LLM's multi-block decoding (SamplingParams.multi_block, the CLI's --multi-block) on the
    tiny build of LLaDA-8B-Instruct's published files (d3LLM_LLaDA's located generation_config.json
    gives the same ids): load_model, Engine.generate at the published defaults, the preflight
    (which refuses it under a cache) and a 10-row job whose rows take a forward per block."""
    gen = published.read_json(folder, "generation_config.json")
    assert {k: gen[k] for k in ("bos_token_id", "eos_token_id")} == \
        {k: D3LLM_LLADA_GENERATION[k] for k in ("bos_token_id", "eos_token_id")}
    root = published.build(folder, str(tmp_path / folder))
    model, tok = load_model(root, dtype=torch.float32)
    stops = expected_stops(folder)
    assert model.config.stop_token_ids == list(stops) and not model.config.block_causal
    chat = render(folder, [{"role": "user", "content": USER}])
    outs = Engine(model, D3LLM_ENGINE, tokenizer=tok).generate(
        [chat, "copy: the"], SamplingParams(max_new_tokens=8, multi_block=True))  # the published 0.1, 0.95, 0.4
    assert [o.error for o in outs] == [None, None]
    assert all(o.finish_reason in ("stop", "length") and o.num_steps >= len(o.token_ids) for o in outs)
    # one forced commit per forward (no entropy under 0.4 on random weights): 8 forwards for 8 tokens
    assert all(o.num_steps == 8 for o in outs if o.finish_reason == "length")

    cached = DLLMProcessorConfig(model=root, batch_size=5, engine=ENGINE, sampling=D3LLM_SAMPLING,
                                 enable_metrics=False)
    with pytest.raises(JobError, match="set cache 'none'"):
        preflight(_messages_input(str(tmp_path / "in.parquet")), str(tmp_path / "refused"), cached)
    rows = _ten_row_chat_job(folder, root, D3LLM_ENGINE, D3LLM_SAMPLING, stops, tmp_path)
    # every eligible mask committed: a block per forward (the fixed schedule would take 4 per block)
    assert all(r["num_steps"] <= 2 for r in rows) and any(r["num_steps"] == 2 for r in rows)
