"""What a job's engine pool needs against what the cluster has: an impossible job is
refused naming the options, instead of waiting --wait-for-engines-s for actors Ray can
never place (or failing with Ray's infeasibility error, which names no option).

The pool: `num_engines` engine actors (each `DLLMProcessorConfig.engine_resources`), one
dispatcher per engine (DISPATCHER_CPUS), and room beside them for one CPU task of the
stages (read, tokenize, sort, detokenize, write), without which rows never reach the
engines. CPUs, GPUs and the GPU type (accelerator_type, Ray's resource
`accelerator_type:<type>`, which a node has when its GPUs are of that type) only: a
custom resource (--engine-resource, or in placement_group_config's bundles) may come with
nodes that join later, and an engine waiting for one fails after --wait-for-engines-s,
naming it.

Checked by the preflight, before the output is touched: against the node a local Ray will
start with (the CPUs of --num-cpus, else the machine's, and its GPUs, as Ray itself
resolves them), or against a joined cluster once connected (before any engine starts), in
total and per node, or what its autoscaler may grow it to.

GPU memory (`check_gpu_memory`): a model whose weights and one row of one block need more
than gpu_memory_utilization x the cluster's largest GPU is refused. Ray reports no GPU
memory: the local node's is read from NVML (the bindings Ray ships, as Ray counts its GPUs,
no CUDA context), a joined cluster's from each GPU node's `accelerator_type:<T>` resource
(ACCELERATOR_MEMORY_GIB); a GPU of a type not listed there is not checked (each engine
then plans its budget at start and refuses, naming the memory, when not one row fits)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

from actors.engine_router import DISPATCHER_CPUS

from .config import ACCELERATOR_PREFIX, DLLMProcessorConfig
from .errors import JobError

# The CPUs of a read or write task (pipeline/reader.py read_prompts, pipeline/writer.py write_results)
IO_TASK_CPUS = 0.25


@dataclass
class Cluster:
    """The resources a cluster has (or can grow to), in total and per node; `kinds`: the
    resources known (a local Ray not started yet: its CPUs only)."""

    total: Dict[str, float]
    nodes: List[Dict[str, float]] = field(default_factory=list)
    kinds: Optional[Iterable[str]] = None  # None: every resource (absent means none)
    what: str = "the cluster"
    gpu_memory: Optional[int] = None  # bytes of its largest GPU; None: unknown (or no GPU)
    gpu_type: Optional[str] = None  # that GPU's accelerator type, as Ray names it

    def knows(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds

    @property
    def gpus(self) -> float:
        return self.total.get("GPU", 0.0)


# GiB of GPU memory by Ray's accelerator type (ray.util.accelerators; the node resource
# "accelerator_type:<T>"): the largest memory the type ships with, since a refusal must be
# certain (Ray names an 80 and a 94 GiB H100 alike).
ACCELERATOR_MEMORY_GIB = {"V100": 32, "P100": 16, "T4": 16, "P4": 8, "K80": 12, "A10G": 24, "L4": 24, "L40S": 48,
                          "A100": 80, "A100-40G": 40, "A100-80G": 80, "H100": 94, "H200": 141, "H20": 96,
                          "B200": 192, "B300": 288, "GB200": 192, "GB300": 288, "RTX-PRO-6000": 96}


def listed_gpu_memory(nodes: Iterable[Dict[str, float]]) -> "tuple[Optional[int], Optional[str]]":
    """(bytes, type) of the largest GPU among `nodes` whose accelerator type is listed in
    ACCELERATOR_MEMORY_GIB; (None, None) when none is."""
    n = len(ACCELERATOR_PREFIX)
    found = [(ACCELERATOR_MEMORY_GIB[k[n:]] << 30, k[n:]) for node in nodes
             if node.get("GPU") for k in node if k.startswith(ACCELERATOR_PREFIX) and k[n:] in ACCELERATOR_MEMORY_GIB]
    return max(found) if found else (None, None)


def nvml_gpu_memory() -> Optional[int]:
    """Bytes of this machine's largest NVIDIA GPU from NVML (Ray's own bindings: no CUDA
    context is created), or None without one."""
    try:
        import ray._private.thirdparty.pynvml as nvml

        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVIDIA driver
        return None
    try:
        sizes = [int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).total)
                 for i in range(nvml.nvmlDeviceGetCount())]
        return max(sizes, default=None)
    except Exception:  # noqa: BLE001 - not checked
        return None
    finally:
        nvml.nvmlShutdown()


def local_cluster(num_cpus: Optional[int]) -> Cluster:
    """The node a local Ray started with `num_cpus` (None: the machine's) will have,
    resolved as Ray resolves it when it starts (CPUs, GPUs, custom resources); its CPUs
    alone should Ray's resolver be unavailable."""
    where = f"--num-cpus {num_cpus}" if num_cpus is not None else "this machine's CPUs; --num-cpus"
    try:
        from ray._private.resource_and_label_spec import ResourceAndLabelSpec

        spec = ResourceAndLabelSpec(num_cpus=num_cpus).resolve(is_head=True)
        node = {**{k: float(v) for k, v in (spec.resources or {}).items()}, "CPU": float(spec.num_cpus),
                "GPU": float(spec.num_gpus or 0)}
        memory, kind = listed_gpu_memory([node])
        if node["GPU"]:
            memory = nvml_gpu_memory() or memory
        return Cluster(node, [node], what=f"the local Ray ({where})", gpu_memory=memory, gpu_type=kind)
    except Exception:  # noqa: BLE001 - Ray's resolver moved: what the job knows
        cpus = float(num_cpus if num_cpus is not None else len(os.sched_getaffinity(0)))
        return Cluster({"CPU": cpus}, [{"CPU": cpus}], kinds=("CPU",), what=f"the local Ray ({where})")


def connected_cluster() -> Cluster:
    """The cluster this process is connected to: its alive nodes' resources, and where an
    autoscaler runs it, the node types it may add and the totals it may reach (read as Ray
    Train reads them before placing its workers)."""
    import ray

    total = {k: float(v) for k, v in ray.cluster_resources().items()}
    nodes = [{k: float(v) for k, v in n["Resources"].items()} for n in ray.nodes() if n.get("Alive")]
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
        most = state.get_max_resources_from_cluster_config() if config is not None else None
    except Exception:  # noqa: BLE001 - no autoscaler to ask: the cluster as it is
        config, most = None, None
    if config is not None:
        nodes += [{k: float(v) for k, v in g.resources.items()} for g in config.node_group_configs if g.max_count]
        total = {k: max(total.get(k, 0.0), float((most or {}).get(k, 0))) for k in {*total, *(most or {})}}
    return Cluster(total, nodes, what="the cluster" + (" (with the nodes its autoscaler may add)" if config else ""),
                   **dict(zip(("gpu_memory", "gpu_type"), listed_gpu_memory(nodes))))


def pool_needs(config: DLLMProcessorConfig, cluster_gpus: float) -> Dict[str, Any]:
    """{"engine": one engine's resources, "total": the whole pool's, "task": the CPU task
    kept room for}, on a cluster with `cluster_gpus` GPUs."""
    res = config.engine_resources(cluster_gpus)
    engine = {"CPU": res["num_cpus"], "GPU": res["num_gpus"],
              **{k: v for k, v in res["resources"].items() if k.startswith(ACCELERATOR_PREFIX)}}
    task = max(config.cpu_stage_num_cpus, IO_TASK_CPUS)
    n = config.num_engines
    total = {k: n * v for k, v in engine.items()}
    total["CPU"] += n * DISPATCHER_CPUS + task
    return {"engine": engine, "total": total, "task": task}


# The option that sets what one engine asks for, by resource
_PER_ENGINE = {"CPU": "num_cpus_per_engine", "GPU": "num_gpus_per_engine"}


def _option(config: DLLMProcessorConfig, kind: str) -> str:
    """The option that makes one engine ask for resource `kind`."""
    if kind.startswith(ACCELERATOR_PREFIX):
        return "accelerator_type"
    return "placement_group_config" if config.placement_group_config is not None else _PER_ENGINE[kind]


def check_resources(config: DLLMProcessorConfig, cluster: Cluster) -> None:
    """Raise JobError naming the options when the pool can never be placed on `cluster`:
    more of a resource in total than it has (no node with GPUs of the accelerator_type), or
    one engine larger than any of its nodes."""
    gpus = cluster.total.get("GPU", 0.0) if cluster.knows("GPU") else 0.0
    needs = pool_needs(config, gpus)
    n, engine = config.num_engines, needs["engine"]
    # the GPU type first: with accelerator_type and no GPU of that type, that is what to fix
    for kind, need in sorted(needs["total"].items(), key=lambda kv: not kv[0].startswith(ACCELERATOR_PREFIX)):
        have = cluster.total.get(kind, 0.0)
        if not need or not cluster.knows(kind) or need <= have + 1e-9:
            continue
        per = _option(config, kind)
        if per == "accelerator_type":
            types = sorted(k[len(ACCELERATOR_PREFIX):] for k in cluster.total if k.startswith(ACCELERATOR_PREFIX))
            raise JobError(f"accelerator_type {config.accelerator_type!r}: no node of {cluster.what} has GPUs of that "
                           f"type (its GPU types: {', '.join(types) or 'none'}): the engines could never start. Give "
                           "the type Ray reports for the cluster's GPUs, or drop it", per)
        how = f"{n} engine(s) x {engine[kind]:g}"
        if kind == "CPU":
            how += f" + {n} dispatcher(s) x {DISPATCHER_CPUS:g} + {needs['task']:g} for a read/tokenize/write task"
        more = "more CPUs (--num-cpus for a local Ray)" if kind == "CPU" else "GPUs"
        raise JobError(f"the engine pool needs {need:g} {kind} ({how}) but {cluster.what} has {have:g}: the engines "
                       f"could never all start. Give it {more}, fewer engines (--num-engines) or less {kind} per "
                       f"engine ({'--' + per.replace('_', '-')})", "num_engines", per)
    sized = {k: v for k, v in engine.items() if v and cluster.knows(k)}
    if cluster.nodes and not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in sized.items())
                                 for node in cluster.nodes):
        want = ", ".join(f"GPUs of type {k[len(ACCELERATOR_PREFIX):]}" if k.startswith(ACCELERATOR_PREFIX)
                         else f"{v:g} {k}" for k, v in sized.items())
        raise JobError(f"one engine needs {want} on a single node, and no node of {cluster.what} has that much: "
                       "ask less per engine", *dict.fromkeys(_option(config, k) for k in sized))


def check_gpu_memory(config: DLLMProcessorConfig, checkpoint: Any, cluster: Cluster) -> None:
    """Raise JobError when the model cannot fit at all on `cluster`'s GPUs: its weights and
    one row of one block (engine.budget.engine_plan of a whole GPU, weights not loaded) need
    more than gpu_memory_utilization x its largest GPU's memory. With the engines on CPU, a
    gpu_memory_utilization other than the default is refused: nothing would read it.
    Unknown GPU memory, or DiffusionGemma's canvas engine (which plans no budget): not checked."""
    from engine.config import EngineConfig

    gpus = cluster.total.get("GPU", 0.0) if cluster.knows("GPU") else 0.0
    util = config.engine.gpu_memory_utilization
    if config.engine_resources(gpus)["device"] == "cpu":
        if util != EngineConfig().gpu_memory_utilization:
            why = f"{cluster.what} has no GPU" if not gpus else "--num-gpus-per-engine is 0"
            raise JobError(f"gpu_memory_utilization {util:g}: the engines run on CPU ({why}), where nothing reads "
                           "it (the token budget is --token-budget, else the CPU default); leave it at the default",
                           "gpu_memory_utilization")
        return
    if cluster.gpu_memory is None or not checkpoint.serving.plans_memory:
        return
    import torch  # a GPU job's driver only

    from actors.engine_build import resolve_dtype
    from engine.budget import ShardBytes, engine_plan, smallest_tensor_parallel_size, weight_bytes
    from engine.models.sharding import ShardingRefused

    memory, mcfg = cluster.gpu_memory, checkpoint.config
    dtype = resolve_dtype(config.dtype, torch.device("cuda"))
    tp = config.engine.tensor_parallel_size
    try:  # under tensor parallelism, one rank's plan (engine.budget.ShardBytes)
        plan = engine_plan(mcfg, dtype, config.engine, memory, memory, weights_loaded=False)
    except ShardingRefused as e:
        raise JobError(f"model {config.model}: {e}; --tensor-parallel-size must divide its attention heads (and "
                       "MLP widths)", "tensor_parallel_size") from e
    if plan.token_budget:
        return
    weights = weight_bytes(mcfg, dtype) if tp == 1 else ShardBytes.of(mcfg, dtype, tp).weights
    need = plan.bytes_for(config.engine.block_length + 1)
    gpu = _size(memory) + (f" ({cluster.gpu_type})" if cluster.gpu_type else "")
    smallest = smallest_tensor_parallel_size(mcfg, dtype, config.engine, memory)
    where = "its weights take" if tp == 1 else f"at --tensor-parallel-size {tp} each GPU's share of its weights takes"
    fix = (f"Use --tensor-parallel-size {smallest} (the smallest of 1, 2, 4, 8 whose per-GPU share fits: "
           f"`blockray plan --model ... --gpu ...` prints the plan), " if smallest and smallest > tp else "Use ")
    raise JobError(
        f"model {config.model} cannot fit on the GPUs of {cluster.what}: {where} {_size(weights)} "
        f"({mcfg.num_params():,} parameters in {str(dtype).removeprefix('torch.')}), with one row of one block and "
        f"the reserve {_size(need)}, more than gpu_memory_utilization {util:g} x the largest GPU's {gpu} = "
        f"{_size(util * memory)}. {fix}GPUs with more memory, a higher --gpu-memory-utilization or a smaller --dtype",
        "gpu_memory_utilization", "model", "dtype", *(("tensor_parallel_size",) if smallest and smallest > tp else ()))


def _size(n: float) -> str:
    unit = next(u for u in (3, 2, 1, 0) if n >= 2 ** (10 * u) or not u)
    return f"{n / 2 ** (10 * unit):.1f} {('B', 'KiB', 'MiB', 'GiB')[unit]}"
