"""Tensor / expert parallel over gloo without Ray: `run_ranks` saves a model, spawns one
process per rank (each loads its shard with load_model(tp=...) and decodes the same jobs)
and returns what each rank decoded."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence

import torch

from engine import Engine, EngineConfig, SamplingParams, load_model, save_model


def _rank(rank: int, world: int, root: str, prompts: Sequence[Sequence[int]], params: List[SamplingParams],
          cfg: EngineConfig) -> None:
    from engine.parallel import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, world, f"file://{os.path.join(root, 'rendezvous')}", "gloo")
    model, _ = load_model(os.path.join(root, "model"), dtype=torch.float64, tokenizer=False, tp=tp)
    outs = Engine(model, cfg).generate([list(p) for p in prompts], params)
    moe = next((layer for layer in model.layers if getattr(layer, "owned", None) is not None), None)
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(dict(tokens=[list(o.token_ids) for o in outs], steps=[o.num_steps for o in outs],
                       errors=[o.error for o in outs], held=sum(p.numel() for p in model.parameters()),
                       own=list(moe.owned) if moe is not None else [],
                       edit_ids=[model.config.delete_token_id, model.config.split_token_id]), f)
    torch.distributed.barrier()  # no rank leaves while the other still reads (gloo aborts on a closed peer)
    destroy_tensor_parallel()


def run_ranks(model: Any, root: str, prompts: Sequence[Sequence[int]], params: List[SamplingParams],
              cfg: EngineConfig, world: int = 2) -> List[Dict[str, Any]]:
    """Each rank's {tokens, steps, errors, held (parameters it holds), own (the experts of its
    first expert-parallel layer), edit_ids} after decoding `prompts` under `cfg` (its
    tensor_parallel_size set to `world`) from `model` saved under `root`."""
    import dataclasses

    import torch.multiprocessing as mp

    save_model(model, os.path.join(root, "model"))
    cfg = dataclasses.replace(cfg, tensor_parallel_size=world)
    mp.start_processes(_rank, args=(world, root, prompts, params, cfg), nprocs=world, join=True,
                       start_method="spawn")
    return [json.load(open(os.path.join(root, f"rank{r}.json"), encoding="utf-8")) for r in range(world)]
