"""Generate with a diffusion LM inside your own Ray Data pipeline.

A processor is a chain of `map_batches` stages (tokenize → engine actors → detokenize),
so it slots between any Ray Data reads, transforms and writes:

    python examples/map_batches_example.py [MODEL_DIR]    # default: the embedded tiny model
"""
import os
import sys

import ray

from pipeline import DLLMProcessorConfig, EngineConfig, SamplingParams, build_processor

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "assets", "tiny-dllm")


def score(batch):
    """An ordinary user stage after the processor (pandas batches)."""
    batch["correct"] = batch["reversed"] == batch["word"].str[::-1]
    return batch


def main(model: str):
    config = DLLMProcessorConfig(
        model=model,
        num_engines=2,  # engine actors: one GPU each, or half a CPU each without GPUs
        batch_size=4,  # rows per call into an engine; several calls are in flight per engine
        engine=EngineConfig(block_length=8, steps_per_block=8, token_budget=4096),
        sampling=SamplingParams(max_new_tokens=24, policy="threshold", threshold=0.9),
    )
    processor = build_processor(
        config,
        # preprocess: fields to add to each row (here the prompt the model expects)
        preprocess=lambda row: {"prompt": f"rev: {row['word']}"},
        # postprocess: the output row, built from input and generation columns
        postprocess=lambda row: {"word": row["word"], "reversed": row["generated_text"],
                                 "tokens": row["num_generated_tokens"], "error": row["error"]},
    )
    ds = ray.data.from_items([{"word": w} for w in ["ray", "block", "diffusion", "parquet", "mask", "engine"]])
    ds = processor(ds)  # lazy, like any map_batches
    # A fraction of a CPU: on a small machine the engine actors already hold most cores.
    ds = ds.map_batches(score, batch_format="pandas", num_cpus=0.25)
    return ds.take_all()


if __name__ == "__main__":
    if not ray.is_initialized():
        ray.init()
    ROWS = main(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL)
    for row in ROWS:
        print(row)
