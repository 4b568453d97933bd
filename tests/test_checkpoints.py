"""Issue 22: the published checkpoints served as published. Loading, generating, the stop
ids, the chat prompt, the preflight and a 10-row job of every vendored published file set
are tests/test_published.py's; here, on those sets built by tests/published.py (tiny
weights, the published files): PEFT LoRA adapters (D2F's) merged exactly, block-causal
attention on request, Dream's <|im_end|> ending a row, the plain tokenizer loader, and
every setting the engine would ignore refused with its message."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import published
from checkpoints import write_llada_moe, write_lora
from conftest import ROOT, read_parts
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model, load_model, save_model
from engine.loader import read_config
from pipeline.run import JobError, check_model

ENGINE = EngineConfig(block_length=4, steps_per_block=4, cache="refresh", token_budget=2048, max_batch_size=8)
SAMPLING = SamplingParams(max_new_tokens=8, policy="fixed")
# vendored published sets (tests/published/)
LLADA, DREAM = "GSAI-ML__LLaDA-8B-Instruct", "Dream-org__Dream-v0-Instruct-7B"
DREAM_BASE = "Dream-org__Dream-v0-Base-7B"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{name: folder}: the published LLaDA-8B-Instruct (it stands for LLaDA), Dream-v0
    Instruct and Base sets built by tests/published.py, and D2F's two adapters on them."""
    root = tmp_path_factory.mktemp("published")
    names = (LLADA, DREAM, DREAM_BASE)
    dirs = {name: published.build(name, str(root / name), seed=i) for i, name in enumerate(names)}
    dirs["D2F_LLaDA_Instruct_8B_Lora"] = write_lora(str(root / "D2F_LLaDA_Instruct_8B_Lora"),
                                                    read_config(dirs[LLADA]), base="GSAI-ML/LLaDA-8B-Instruct")
    dirs["D2F_Dream_Base_7B_Lora"] = write_lora(str(root / "D2F_Dream_Base_7B_Lora"), read_config(dirs[DREAM_BASE]),
                                                base="Dream-org/Dream-v0-Base-7B")
    return dirs


def _hand_merged(base: str, adapter: str, dtype=torch.float64):
    """The base model with W += alpha/r * B A done here, from the adapter's own files."""
    model, tok = load_model(base, dtype=dtype)
    acfg = json.load(open(os.path.join(adapter, "adapter_config.json")))
    scale = acfg["lora_alpha"] / (acfg["r"] ** 0.5 if acfg["use_rslora"] else acfg["r"])
    by_key = {model.config.family.checkpoint_name(n): n for n, _ in model.named_parameters()}
    with safe_open(os.path.join(adapter, "adapter_model.safetensors"), "pt") as fh, torch.no_grad():
        for key in fh.keys():
            if ".lora_A." in key:
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                a, b = fh.get_tensor(key).to(dtype), fh.get_tensor(key.replace("lora_A", "lora_B")).to(dtype)
                model.get_parameter(by_key[module + ".weight"]).add_(scale * (b @ a))
    return model, tok


@pytest.mark.parametrize("family", ["llada", "Dream"])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_lora_merge_equals_the_unmerged_computation(family, use_rslora, tmp_path):
    """W' x == W x + scale * B (A x) in float64 for every targeted module (r=4, alpha=12)."""
    cfg = ModelConfig.tiny(family, vocab_size=96, mask_token_id=95)
    base = tmp_path / "base"
    save_model(build_model(cfg, dtype=torch.float64, seed=3), base)
    adapter = write_lora(str(tmp_path / "lora"), cfg, r=4, lora_alpha=12.0, use_rslora=use_rslora, seed=5)
    plain, _ = load_model(base, dtype=torch.float64)
    merged, _ = load_model(base, dtype=torch.float64, adapter=adapter)
    scale = 12.0 / (2.0 if use_rslora else 4.0)
    x = torch.randn(7, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    by_key = {cfg.family.checkpoint_name(n): n for n, _ in plain.named_parameters()}
    n = 0
    with safe_open(os.path.join(adapter, "adapter_model.safetensors"), "pt") as fh:
        for key in fh.keys():
            if ".lora_A." not in key:
                continue
            name = by_key[key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"]
            a, b = fh.get_tensor(key).double(), fh.get_tensor(key.replace("lora_A", "lora_B")).double()
            want = x @ plain.get_parameter(name).T + scale * ((x @ a.T) @ b.T)
            assert torch.allclose(x @ merged.get_parameter(name).T, want, rtol=1e-12, atol=1e-12), name
            n += 1
    assert n == cfg.n_layers * 4
    untouched = [k for k, _ in plain.named_parameters() if not any(f".{m}." in k for m in "qkvo")]
    assert all(torch.equal(plain.get_parameter(k), merged.get_parameter(k)) for k in untouched)


def test_d2f_adapter_job_with_block_causal_matches_the_hand_merged_model(built, ray_address, tmp_path):
    """`blockray --model LLaDA-8B-Instruct --adapter D2F_LLaDA_Instruct_8B_Lora --attention
    block_causal` (the real command, exit 0) gives, row for row, the tokens of the same
    model merged by hand with block-causal attention."""
    base, adapter = built[LLADA], built["D2F_LLaDA_Instruct_8B_Lora"]
    prompts = [f"copy: {'abcdefgh'[: i % 8 + 1]}" for i in range(10)]
    inp = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(10)], "prompt": prompts}), inp)
    cmd = [sys.executable, "jobs/offline_eval.py", "--model", base, "--adapter", adapter, "--attention",
           "block_causal", "--input", inp, "--output", str(tmp_path / "out"), "--dtype", "float64",
           "--num-engines", "1", "--batch-size", "5", "--block-length", "4", "--steps-per-block", "4",
           "--max-new-tokens", "8", "--policy", "fixed", "--cache", "refresh", "--no-enable-metrics",
           "--address", ray_address]  # the session's Ray: none to start
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "126348 (chat template end of turn <|eot_id|>)" in res.stdout  # the summary names the stops' source
    got = {r["id"]: r["generated_token_ids"] for r in read_parts(str(tmp_path / "out")).to_pylist()}
    model, tok = _hand_merged(base, adapter)
    model.config.dllm_attention = "block_causal"
    ref = Engine(model, ENGINE, tokenizer=tok).generate(prompts, SAMPLING)
    assert got == {f"p{i}": list(o.token_ids) for i, o in enumerate(ref)}
    plain, _ = load_model(base, dtype=torch.float64, attention="block_causal")
    assert [o.token_ids for o in Engine(plain, ENGINE, tokenizer=tok).generate(prompts, SAMPLING)] != [
        o.token_ids for o in ref]  # the adapter changes the tokens: the comparison means something


def test_dream_d2f_adapter_with_block_causal_matches_the_hand_merged_model(built):
    """`--model Dream-v0-Base-7B --adapter D2F_Dream_Base_7B_Lora --attention block_causal`
    (Dream's D2F command; the job path of an adapter is the LLaDA test's above): the
    preflight accepts it, and the adapter merged at load onto the published Dream names
    gives, row for row, the tokens of the model merged by hand, block-causal."""
    base, adapter = built[DREAM_BASE], built["D2F_Dream_Base_7B_Lora"]
    assert check_model(base, needs_tokenizer=True, adapter=adapter, attention="block_causal").model == base
    prompts = [f"copy: {'abcdefgh'[: i % 8 + 1]}" for i in range(4)]
    merged, tok = load_model(base, dtype=torch.float64, adapter=adapter, attention="block_causal")
    hand, _ = _hand_merged(base, adapter)
    hand.config.dllm_attention = "block_causal"
    ref = Engine(hand, ENGINE, tokenizer=tok).generate(prompts, SAMPLING)
    assert [o.token_ids for o in Engine(merged, ENGINE, tokenizer=tok).generate(prompts, SAMPLING)] == [
        o.token_ids for o in ref]
    plain, _ = load_model(base, dtype=torch.float64, attention="block_causal")
    assert [o.token_ids for o in Engine(plain, ENGINE, tokenizer=tok).generate(prompts, SAMPLING)] != [
        o.token_ids for o in ref]  # the adapter changes the tokens: the comparison means something


def test_dream_im_end_ends_the_row_and_stays_out_of_the_text(built):
    """A <|im_end|> the model produces ends the row with finish_reason "stop" in the first
    block that holds it, and is not in generated_text. The model is the Dream layout with
    the embedding and output rows of one token t and <|im_end|> swapped: it computes
    exactly what the original does, with <|im_end|> wherever the original produced t."""
    model, tok = load_model(built[DREAM], dtype=torch.float64)
    prompt = "user: copy: abc\nassistant:"  # neither t nor <|im_end|> in the prompt: the swap is exact
    free = SamplingParams(max_new_tokens=16, policy="fixed", stop_token_ids=[])
    orig = Engine(model, ENGINE, tokenizer=tok).generate([prompt], free)[0].token_ids
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    im_end = 151645
    assert im_end not in ids and im_end not in orig
    p = next(j for j in range(4, 16) if orig[j] not in orig[:j] and orig[j] not in ids and orig[j] < 151643)
    t = orig[p]
    with torch.no_grad():
        for w in (model.embed.weight, model.lm_head.weight):
            w[[t, im_end]] = w[[im_end, t]]
    assert model.config.stop_token_ids == [151643, im_end]
    out = Engine(model, ENGINE, tokenizer=tok).generate([prompt], SamplingParams(max_new_tokens=16, policy="fixed"))[0]
    assert out.finish_reason == "stop"
    assert list(out.token_ids) == list(orig[:p])
    assert out.num_blocks == p // 4 + 1  # the first block that holds it
    assert out.text == tok.decode(orig[:p], skip_special_tokens=True) and "<|im_end|>" not in out.text


def test_stop_ids_are_the_union_of_the_checkpoint_files_without_a_vocab_size_rule(tmp_path):
    """eos lists kept whole, generation_config.json read, the end-of-turn token found
    through the chat template in a resized vocabulary (no rule on vocab_size)."""
    from engine.models.stops import checkpoint_stop_ids

    root = _tiny("llada", tmp_path / "m", eos_token_id=[1, 5])
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert read_config(root).stop_ids == [1, 5, 7]
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}",
        "added_tokens_decoder": {"90": {"content": "<|eot_id|>", "special": True},
                                 "91": {"content": "<|im_end|>", "special": True}}}))
    assert checkpoint_stop_ids(root) == {1: "config.json eos_token_id", 5: "config.json eos_token_id",
                                         7: "generation_config.json eos_token_id",
                                         90: "chat template end of turn <|eot_id|>"}  # <|im_end|>: not in the template
    assert ModelConfig.from_hf(json.load(open(os.path.join(root, "config.json")))).stop_token_ids == [1, 5]


# --- refusals: nothing silently ignored ------------------------------------------------

REFUSED = [
    ("llada", {"attention_layer_norm": True}, "attention_layer_norm=True is not supported by blockray's LLaDA model"),
    ("llada", {"activation_type": "gelu"}, "activation_type='gelu' is not supported by blockray's LLaDA model"),
    ("llada", {"block_type": "sequential"}, "block_type='sequential' is not supported"),
    ("llada", {"scale_logits": True}, "scale_logits=True is not supported"),
    ("llada", {"input_emb_norm": True}, "input_emb_norm=True is not supported"),
    ("Dream", {"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling={'type': 'yarn', 'factor': 4.0} is not "
                                                                 "supported by blockray's Dream model"),
    ("Dream", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ("Dream", {"shiny_new_option": 3}, "config.json key 'shiny_new_option' (= '3') is not one blockray's Dream model "
                                       "honours"),
]


def _tiny(family: str, root, **extra_config) -> str:
    """A tiny checkpoint whose config.json carries the published keys of its family."""
    cfg = ModelConfig.tiny(family, vocab_size=96, mask_token_id=95)
    save_model(build_model(cfg, seed=0), root)
    hf = published.config(LLADA if family == "llada" else DREAM)  # the published config.json
    keys = {k: v for k, v in hf.items() if k not in cfg.to_hf() and k not in cfg.family.honoured}
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({**keys, **cfg.to_hf(), **extra_config}, f)
    return str(root)


@pytest.mark.parametrize("family,change,message", REFUSED, ids=[next(iter(c)) for _, c, _ in REFUSED])
def test_setting_the_engine_would_ignore_is_refused(family, change, message, tmp_path):
    root = _tiny(family, tmp_path / "m", **change)
    if change.get("attention_layer_norm"):  # with the q/k norm tensors such a checkpoint holds
        extra = {f"model.transformer.blocks.0.{n}_norm.weight": torch.ones(32) for n in "qk"}
        save_file(extra, str(tmp_path / "m" / "norms.safetensors"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_model(root)
    with pytest.raises(JobError, match=r"\(--model\)") as e:
        check_model(root, needs_tokenizer=False)
    assert message in str(e.value)


def test_published_keys_are_all_accounted_for(tmp_path):
    """Every key of the published configs is honoured or listed as irrelevant (or at its
    one supported value): the tiny copies with all of them load."""
    for family in ("llada", "Dream"):
        model, _ = load_model(_tiny(family, tmp_path / family), dtype=torch.float32)
        assert model.config.family.name == {"llada": "LLaDA", "Dream": "Dream"}[family]


def test_unused_tensor_is_refused(tmp_path):
    root = _tiny("llada", tmp_path / "m")
    save_file({"model.transformer.blocks.0.q_norm.weight": torch.ones(32)}, str(tmp_path / "m" / "extra.safetensors"))
    msg = "holds 1 tensor(s) blockray's LLaDA model does not use, e.g. 'model.transformer.blocks.0.q_norm.weight'"
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        load_model(root)
    with pytest.raises(JobError) as e:
        check_model(root, needs_tokenizer=False)
    assert msg in str(e.value)


def test_llada2_config_without_its_expert_width_is_refused_in_the_preflight(tmp_path):
    """LLaDA2.x is served now (tests/test_llada2.py); a config.json missing a key its
    family needs is refused in one line naming the key."""
    root = tmp_path / "moe"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({
        "model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"], "hidden_size": 2048,
        "num_hidden_layers": 20, "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
        "vocab_size": 157184}))
    with pytest.raises(JobError, match=r"config.json lacks 'moe_intermediate_size'") as e:
        check_model(str(root), needs_tokenizer=False)
    assert "\n" not in str(e.value)


ADAPTER_REFUSED = [({"use_dora": True}, "use_dora=True: DoRA"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                   ({"bias": "all"}, "bias='all': trained biases"), ({"peft_type": "IA3"}, "peft_type 'IA3'")]


@pytest.mark.parametrize("change,message", ADAPTER_REFUSED, ids=[next(iter(c)) for c, _ in ADAPTER_REFUSED])
def test_adapter_options_not_implemented_are_refused(change, message, tmp_path):
    root = _tiny("llada", tmp_path / "m")
    adapter = write_lora(str(tmp_path / "lora"), read_config(root), **change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_model(root, adapter=adapter)
    with pytest.raises(JobError, match=r"\(--adapter\)"):
        check_model(root, needs_tokenizer=False, adapter=adapter)


def test_adapter_for_another_base_is_refused(tmp_path):
    root = _tiny("llada", tmp_path / "m")
    other = ModelConfig.tiny("llada", vocab_size=96, mask_token_id=95, hidden_size=48, n_heads=4)
    adapter = write_lora(str(tmp_path / "lora"), other)
    with pytest.raises(ValueError, match=r"has lora_A \(4, 48\) .* expected \(4, 32\) .* different base model"):
        load_model(root, adapter=adapter)
    dream_adapter = write_lora(str(tmp_path / "dream-lora"), ModelConfig.tiny("Dream", vocab_size=96, mask_token_id=95))
    with pytest.raises(ValueError, match="not a linear weight of the LLaDA base model"):
        load_model(root, adapter=dream_adapter)


def _tokenizer_facts(tok) -> dict:
    text = "<|startoftext|>copy: the cat<|endoftext|> <|im_end|> <|mask|> héllo\n\tworld"
    ids = tok(text, add_special_tokens=True)["input_ids"]
    return dict(cls=type(tok), vocab=tok.get_vocab(), special=tok.special_tokens_map,
                added={i: str(t) for i, t in tok.added_tokens_decoder.items()}, template=tok.chat_template,
                ids=ids, text=tok.decode(ids), plain=tok.decode(ids, skip_special_tokens=True),
                side=tok.padding_side, max_len=tok.model_max_length, eos=tok.eos_token_id, pad=tok.pad_token_id)


def test_plain_tokenizers_load_as_autotokenizer_would(tmp_path):
    """common/tokenizer.py loads a plain tokenizer.json (no model of transformers' own)
    without AutoTokenizer, so that tokenizing processes never import torch: on every
    layout that takes that path (every published set tests/published.py builds) the
    tokenizer is the one AutoTokenizer builds; a transformers model type keeps AutoTokenizer."""
    import transformers

    from common.tokenizer import load_tokenizer, plain_tokenizer

    buildable = [f for f in published.folders() if published.config(f)["model_type"] in published.SHRINK]
    dirs = {name: published.build(name, str(tmp_path / name)) for name in buildable}
    dirs["LLaDA-MoE-7B-A1B-Instruct"] = write_llada_moe(str(tmp_path / "LLaDA-MoE"))  # no published files
    dirs["tiny"] = os.path.join(ROOT, "engine", "assets", "tiny-dllm")
    plain = {name: plain_tokenizer(d) for name, d in dirs.items()}
    qwen2 = ("Dream", "JetLM__SDAR")  # their tokenizer is transformers' Qwen2Tokenizer
    assert plain == {name: not name.startswith(qwen2) for name in dirs}, plain
    for name, d in dirs.items():
        auto = transformers.AutoTokenizer.from_pretrained(d, local_files_only=True, trust_remote_code=False) \
            if plain[name] else None
        if auto is not None:
            assert _tokenizer_facts(load_tokenizer(d)) == _tokenizer_facts(auto), name
    native = tmp_path / "native"
    shutil.copytree(dirs["tiny"], native)
    cfg = json.loads((native / "config.json").read_text())
    (native / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2"}))
    assert not plain_tokenizer(str(native))  # AutoTokenizer would read Qwen2's config: left to it


def test_tokenizer_needing_remote_code_names_what_is_needed(built, tmp_path):
    """Dream without merges.txt cannot be read as Qwen2Tokenizer: refused, naming the file;
    the message never blames config.json's auto_map (the engine never uses it)."""
    d = tmp_path / "dream"
    shutil.copytree(built[DREAM], d)
    os.remove(d / "merges.txt")
    with pytest.raises(JobError) as e:
        check_model(str(d), needs_tokenizer=True)
    msg = str(e.value)
    assert "needs remote code" in msg and "DreamTokenizer is transformers' Qwen2Tokenizer" in msg
    assert "merges.txt missing" in msg and "config.json auto_map" not in msg


def test_truncated_safetensors_is_refused_by_the_preflight(tiny_model_dir, tmp_path):
    """Issue 23 case 10: a truncated model.safetensors is refused by the real CLI's
    preflight (exit 2, one line naming the file) from the shard headers alone."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    inp = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["copy: a", "copy: b"]}), inp)
    res = subprocess.run([sys.executable, "jobs/offline_eval.py", "--model", str(model), "--input", inp, "--output",
                          str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "model.safetensors is truncated" in res.stderr and "(--model)" in res.stderr, res.stderr
    assert "blockray offline eval:" not in res.stdout  # refused in the preflight, before Ray started


def test_s3_model_shard_headers_and_s3_adapter_are_checked_without_downloading_weights(
        tiny_model_dir, s3fs_client, s3_storage, tmp_path, monkeypatch):
    """An object-storage model's shard headers are read remotely (byte ranges: a truncated
    shard is refused in the preflight, its weights never downloaded); an s3:// adapter is
    checked against the base from its own files there."""
    import uuid

    monkeypatch.setenv("BLOCKRAY_MODEL_CACHE", str(tmp_path / "cache"))
    bucket = f"models-{uuid.uuid4().hex[:8]}"
    s3fs_client.mkdir(bucket)
    s3fs_client.put(tiny_model_dir.rstrip("/") + "/", f"{bucket}/tiny/", recursive=True)
    adapter = write_lora(str(tmp_path / "lora"), read_config(tiny_model_dir), targets=["q_proj", "v_proj"])
    s3fs_client.put(adapter + "/", f"{bucket}/lora/", recursive=True)
    ckpt = check_model(f"s3://{bucket}/tiny", needs_tokenizer=True, storage=s3_storage, adapter=f"s3://{bucket}/lora")
    assert ckpt.adapter is not None and ckpt.tensors  # the adapter planned, the shard headers read
    local = ckpt.metadata_dir()  # the tokenizer's copy: no weights downloaded
    assert not [f for f in os.listdir(local) if f.endswith(".safetensors")]
    data = s3fs_client.cat_file(f"{bucket}/tiny/model.safetensors")
    s3fs_client.pipe(f"{bucket}/tiny/model.safetensors", data[: len(data) // 2])
    with pytest.raises(JobError, match=r"model\.safetensors is truncated: .* \(--model\)"):
        check_model(f"s3://{bucket}/tiny", needs_tokenizer=False, storage=s3_storage)
