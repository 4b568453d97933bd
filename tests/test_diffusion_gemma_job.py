"""DiffusionGemma through the real job: the tiny checkpoint (tiny/diffusion_gemma.py) and
a 10-row Parquet file of `messages` through jobs/offline_eval.py. Every row comes back
once, rendered by the checkpoint's chat template, with the tokens CanvasEngine gives
in-process for that rendered prompt and the row's seed and knobs; masked-diffusion-only
options are refused by the preflight, or per row."""
from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import ROOT, read_parts
from engine import EngineConfig, SamplingParams
from engine.canvas import CanvasEngine, CanvasParams, CanvasServe, load_diffusion_gemma
from pipeline.run import JobError, check_model
from tiny.diffusion_gemma import build

MESSAGES = [[{"role": "user", "content": " ".join(f"w{(i * 7 + j) % 50 + 1}" for j in range(i % 5 + 1))}]
            for i in range(10)]
SAMPLING = [{"seed": 500 + i, "max_new_tokens": 8 + 8 * (i % 3), **({"max_denoising_steps": 3} if i % 4 == 0 else {})}
            for i in range(10)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dgemma-job")
    ckpt = build(str(tmp / "ckpt"))
    inp = str(tmp / "in.parquet")
    pq.write_table(pa.table({"id": [f"g{i}" for i in range(10)], "messages": MESSAGES,
                             "sampling_params": SAMPLING}), inp)
    return ckpt, inp, tmp


def test_job_serves_diffusion_gemma_with_the_chat_template(job, ray_address):
    from transformers import AutoTokenizer

    ckpt, inp, tmp = job
    res = subprocess.run([sys.executable, "jobs/offline_eval.py", "--model", ckpt, "--input", inp, "--output",
                          str(tmp / "out"), "--dtype", "float64", "--num-engines", "1", "--batch-size", "5",
                          "--no-enable-metrics", "--address", ray_address],  # the session's Ray: none to start
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = read_parts(str(tmp / "out")).to_pylist()
    assert sorted(r["id"] for r in rows) == [f"g{i}" for i in range(10)]  # every row exactly once
    assert [r["error"] for r in rows] == [None] * 10
    tok = AutoTokenizer.from_pretrained(ckpt)
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
               for m in MESSAGES]
    assert all(p[0] == 2 and p[-2:] == tok.convert_tokens_to_ids(["<start_of_turn>", "model"]) for p in prompts)
    model = load_diffusion_gemma(ckpt, torch.float64)
    eng = CanvasEngine(model, CanvasParams.from_generation_config(ckpt))
    ref = {}
    for i, (p, sp) in enumerate(zip(prompts, SAMPLING)):
        ref[f"g{i}"] = eng.generate([p], sp["max_new_tokens"], [sp["seed"]], sp)[0]
    by_id = {r["id"]: r for r in rows}
    for rid, o in ref.items():
        assert by_id[rid]["num_prompt_tokens"] == len(o.prompt_token_ids)  # the chat-rendered prompt
        assert by_id[rid]["generated_token_ids"] == o.token_ids, rid
        assert by_id[rid]["finish_reason"] == o.finish_reason
    assert len({tuple(o.token_ids) for o in ref.values()}) > 5  # rows differ: the comparison means something


@pytest.mark.parametrize("kw, named", [(dict(attention="block_causal"), "--attention"),
                                       (dict(adapter="some/lora"), "--adapter"),
                                       (dict(engine=EngineConfig(block_length=8)), "block_length"),
                                       (dict(sampling=SamplingParams(policy="fixed")), "policy")])
def test_masked_diffusion_options_are_refused_for_diffusion_gemma(job, kw, named):
    """The preflight of the job and of build_dllm_processor (check_model) names them."""
    with pytest.raises(JobError, match=named) as e:
        check_model(job[0], False, **kw)
    assert "DiffusionGemma" in str(e.value)


def test_a_row_with_a_masked_diffusion_option_gets_its_own_error(job):
    model = load_diffusion_gemma(job[0], torch.float32)
    serve = CanvasServe(model, CanvasParams.from_generation_config(job[0]))
    serve.add_request([2, 7, 8], SamplingParams(max_new_tokens=8, seed=1, temperature=0.5), "bad")
    serve.add_request([2, 7, 8], SamplingParams(max_new_tokens=8, seed=1), "good")
    outs = {}
    while serve.has_unfinished():
        outs.update({o.request_id: o for o in serve.step()})
    assert outs["bad"].finish_reason == "error" and "temperature" in outs["bad"].error
    assert outs["good"].finish_reason in ("stop", "length") and outs["good"].token_ids
