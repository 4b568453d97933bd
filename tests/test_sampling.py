"""vLLM-style sampling in the engine: vLLM's names, top-p / top-k, stop strings, seeds;
a request's tokens do not depend on its batch (float64, the embedded model and its
tokenizer)."""
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.decoding import restrict

torch.set_num_threads(1)
MODEL = "engine/assets/tiny-dllm"
PROMPTS = ["rep 5: glxdz", "copy: pefcvilanrkarephqcrejypxibd", "sort: oedl", "rep 3: abc", "rep 2: w"]
CFG = EngineConfig(block_length=8, steps_per_block=8, cache="refresh", token_budget=2048)


@pytest.fixture(scope="module")
def tiny():
    return load_model(MODEL, dtype=torch.float64)


def test_vllm_names_and_unknown_keys():
    sp = SamplingParams.from_dict({"max_tokens": 8, "top_p": 0.9, "top_k": 5, "stop": "x", "n": 3,
                                   "temperature": 0.7, "seed": 1, "stop_token_ids": ["4"]})
    assert (sp.max_new_tokens, sp.top_p, sp.top_k, sp.stop, sp.n, sp.temperature, sp.seed, sp.stop_token_ids) == (
        8, 0.9, 5, ["x"], 3, 0.7, 1, [4])
    assert sp.validate() is None
    base = SamplingParams(max_new_tokens=24, threshold=0.5)
    assert SamplingParams.from_dict({"top_k": None, "max_tokens": 4}, base) == SamplingParams(
        max_new_tokens=4, threshold=0.5)
    with pytest.raises(ValueError, match=r"\['best_of', 'frequency_penalty'\]"):
        SamplingParams.from_dict({"max_tokens": 4, "frequency_penalty": 0.1, "best_of": 2})
    assert "top_p" in SamplingParams(top_p=0.0).validate()
    assert "stop" in SamplingParams(stop="x").validate()
    assert "n must" in SamplingParams(n=0).validate()


def test_restrict_keeps_the_top_k_and_the_top_p_mass():
    lg = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))
    keep = lambda t: torch.isfinite(t)[0].tolist()  # noqa: E731
    assert keep(restrict(lg, 1.0, 2, 1.0)) == [True, True, False, False]
    assert keep(restrict(lg, 1.0, 0, 0.75)) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.75
    assert keep(restrict(lg, 1.0, 0, 0.81)) == [True, True, True, False]
    assert keep(restrict(lg, 1.0, 0, 0.1)) == [True, False, False, False]  # the most likely always stays


def test_sampled_rows_are_batch_invariant_and_seeded(tiny):
    model, tok = tiny
    sp = SamplingParams.from_dict({"max_tokens": 16, "top_p": 0.9, "top_k": 5, "temperature": 0.7, "seed": 1})
    params = [sp, SamplingParams(max_new_tokens=16), sp, SamplingParams(max_new_tokens=24, threshold=0.5), sp]
    batched = Engine(model, CFG, tokenizer=tok).generate(PROMPTS, params)
    for o, p, s in zip(batched, PROMPTS, params):
        alone = Engine(model, CFG, tokenizer=tok).generate([p], [s])[0]
        assert o.token_ids == alone.token_ids and o.error is None
    # distinct seeds give distinct samples; top_k=1 or a tiny top_p is greedy at any temperature
    seeds = [Engine(model, CFG, tokenizer=tok).generate(["copy: pefcvilanrkare"] * 1, [
        SamplingParams(max_new_tokens=24, temperature=5.0, top_k=20, seed=s)])[0].token_ids for s in range(4)]
    assert len({tuple(x) for x in seeds}) > 1
    greedy = Engine(model, CFG, tokenizer=tok).generate(PROMPTS, SamplingParams(max_new_tokens=16))
    for kw in [dict(top_k=1), dict(top_p=1e-9)]:
        hot = Engine(model, CFG, tokenizer=tok).generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=50.0,
                                                                                 seed=3, **kw))
        assert [o.token_ids for o in hot] == [o.token_ids for o in greedy]


def test_stop_strings_cut_the_text_at_a_block_boundary(tiny):
    model, tok = tiny
    free = Engine(model, CFG, tokenizer=tok).generate(PROMPTS, SamplingParams(max_new_tokens=32))
    text = free[1].text  # the copy task: a long answer
    stop = text[10:12]
    assert len(text) > 12 and stop
    outs = Engine(model, CFG, tokenizer=tok).generate(PROMPTS, SamplingParams(max_new_tokens=32, stop=[stop]))
    for o, f in zip(outs, free):
        at = f.text.find(stop)
        if at < 0:
            assert (o.text, o.token_ids) == (f.text, f.token_ids)
        else:
            assert o.finish_reason == "stop" and o.text == f.text[:at] and stop not in o.text
            assert o.token_ids == f.token_ids[: len(o.token_ids)]
            assert stop in tok.decode(o.token_ids, skip_special_tokens=True)  # the fewest tokens that hold it
            assert o.num_blocks == -(-len(o.token_ids) // CFG.block_length)  # it left at that block's boundary
    assert outs[1].text == text[:10]
    no_tok = Engine(model, CFG).generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, stop=["a"]))[0]
    assert no_tok.finish_reason == "error" and "tokenizer" in no_tok.error
