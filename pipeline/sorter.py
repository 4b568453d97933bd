"""Cost-aware sorter and sharder for offline dLLM batch inference (BlendServe-style).

Why this exists: the engine on each rank (one per GPU) runs a BlockServe loop whose
cost is driven by row widths ``p + (b+1) L`` and whose padding is driven by how
different the prompt lengths inside a batch are. A naive contiguous split of the
input leaves one rank with all the long prompts (it finishes last, the others
idle) and hands every engine a random length mix (it pads a lot). This module
estimates each request's cost *before* generation, deals requests to ranks so
that every rank gets the same estimated cost and the same mix of compute-dense
and memory-dense work, keeps requests that share a long prompt prefix together,
and orders every shard by prompt length.

Pure Python + NumPy: no Ray, no torch (the pipeline layer must not touch tensors).

Honesty about estimates: how many blocks a request really needs (EOS can come
early) cannot be known before generation, so every estimate uses the budget
``K = ceil(max_new_tokens / L)`` blocks, optionally scaled by a *calibration*
factor (the mean fraction of the budget used, measured on a sample). Estimates are
for balancing, never a promise.

Typical use::

    from pipeline.sorter import ModelProfile, H200, RequestFeatures, shard
    feats = [RequestFeatures(prompt_len=len(ids), max_new_tokens=256, prefix=tuple(ids))
             for ids in prompts]
    plan = shard(feats, num_ranks=8, model=ModelProfile.from_config(cfg), device=H200,
                 block_length=32, steps_per_block=32, min_prefix=32)
    plan.ranks          # per-rank request indices, in the order to submit them
    plan.report         # estimated cost / imbalance / padding, and the naive split's

Calibration: measure ``(batch_cells, seconds)`` per block cycle from the engine,
``fit = fit_cycle_time(samples)``, then ``shard(..., cost_model=CostModel.from_fit(
fit, block_length=L))`` balances on the fitted time instead of the roofline.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = [
    "ModelProfile",
    "DeviceProfile",
    "H200",
    "CPU",
    "RequestFeatures",
    "RequestCost",
    "estimate",
    "CycleFit",
    "fit_cycle_time",
    "CostModel",
    "PrefixTrie",
    "ShardPlan",
    "shard",
    "padding_fraction",
]


# --------------------------------------------------------------------------- profiles


@dataclass(frozen=True)
class ModelProfile:
    """The few numbers of a transformer that set its FLOPs and KV-cache traffic.

    ``bytes_per_param`` sizes weights, ``bytes_per_element`` sizes K/V entries
    (both 2 for bf16). ``head_dim`` defaults to ``hidden_size // n_heads``.
    """

    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0
    bytes_per_param: float = 2.0
    bytes_per_element: float = 2.0

    def __post_init__(self) -> None:
        if self.head_dim <= 0:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.n_heads, 1))
        for name in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "intermediate_size", "vocab_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], bytes_per_element: Optional[float] = None) -> "ModelProfile":
        """Build from a Hugging Face style ``config.json`` dict.

        Accepts LLaDA keys (``d_model, n_layers, n_heads, n_kv_heads,
        mlp_hidden_size, vocab_size``) or Qwen2/Dream keys (``hidden_size,
        num_hidden_layers, num_attention_heads, num_key_value_heads,
        intermediate_size, vocab_size``). Element size comes from ``torch_dtype``
        (float32 -> 4, otherwise 2) unless given.
        """

        def pick(*keys: str, default: Any = None) -> Any:
            for k in keys:
                if k in cfg and cfg[k] is not None:
                    return cfg[k]
            if default is not None:
                return default
            raise KeyError(f"config has none of {keys}")

        hidden = int(pick("d_model", "hidden_size"))
        heads = int(pick("n_heads", "num_attention_heads"))
        kv_heads = int(pick("n_kv_heads", "num_key_value_heads", default=heads))
        dtype = str(cfg.get("torch_dtype", "bfloat16"))
        elem = bytes_per_element if bytes_per_element is not None else (4.0 if "32" in dtype else 2.0)
        return cls(
            n_layers=int(pick("n_layers", "num_hidden_layers")),
            hidden_size=hidden,
            n_heads=heads,
            n_kv_heads=kv_heads,
            intermediate_size=int(pick("mlp_hidden_size", "intermediate_size")),
            vocab_size=int(pick("embedding_size", "vocab_size")),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            bytes_per_param=elem,
            bytes_per_element=elem,
        )

    def linear_flops_per_token(self) -> float:
        """Dense matmul FLOPs of one token through all layers (QKV, O, gated MLP)."""
        d, hd = self.hidden_size, self.head_dim
        per_layer = 2.0 * (d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd
                           + self.n_heads * hd * d + 3 * d * self.intermediate_size)
        return per_layer * self.n_layers

    def attention_flops_per_pair(self) -> float:
        """FLOPs of one (query, key) pair over all layers: QK^T and AV, 2 per MAC."""
        return 4.0 * self.n_heads * self.head_dim * self.n_layers

    def head_flops_per_token(self) -> float:
        """LM-head FLOPs for one position (only block positions need logits)."""
        return 2.0 * self.hidden_size * self.vocab_size

    def kv_bytes_per_token(self) -> float:
        """Bytes of K and V for one token over all layers."""
        return 2.0 * self.n_layers * self.n_kv_heads * self.head_dim * self.bytes_per_element


@dataclass(frozen=True)
class DeviceProfile:
    """Roofline numbers of one accelerator: peak dense FLOP/s and memory bytes/s."""

    name: str
    peak_flops: float
    mem_bandwidth: float


#: NVIDIA H200 SXM: ~989 TFLOP/s dense bf16, 4.8 TB/s HBM3e.
H200 = DeviceProfile("H200", peak_flops=989e12, mem_bandwidth=4.8e12)
#: A generic multi-core server CPU (order of magnitude only: ~1 TFLOP/s, ~100 GB/s).
CPU = DeviceProfile("cpu", peak_flops=1.0e12, mem_bandwidth=1.0e11)


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class RequestFeatures:
    """What the sorter knows about a request before it runs.

    ``prefix`` is the prompt's token ids (or any leading part of them); requests
    sharing a long enough prefix are kept together. ``None`` means "never group".
    """

    prompt_len: int
    max_new_tokens: int
    prefix: Optional[Tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if int(self.prompt_len) < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len!r}")
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if self.prefix is not None and not isinstance(self.prefix, tuple):
            object.__setattr__(self, "prefix", tuple(int(t) for t in self.prefix))


@dataclass(frozen=True)
class RequestCost:
    """Estimated work of one request over its block cycles (refresh KV cache).

    ``density`` = compute time / memory time on the device: > 1 means
    compute-bound, < 1 memory-bound. ``time_s`` is the request-level roofline
    ``max(compute_s, memory_s)``, the scalar the sharder balances by default.
    """

    blocks: int
    flops: float
    kv_bytes: float
    kv_peak_bytes: float
    compute_s: float
    memory_s: float
    density: float
    time_s: float


def _blocks(max_new_tokens: np.ndarray, block_length: int, calibration: float) -> np.ndarray:
    """Blocks charged per request: the budget ceil(g/L), scaled by calibration, >= 1."""
    k = np.ceil(np.asarray(max_new_tokens, dtype=np.float64) / block_length)
    if calibration != 1.0:
        k = np.clip(np.ceil(k * calibration), 1.0, k)
    return k


def _estimate_arrays(
    prompt_len: np.ndarray,
    max_new_tokens: np.ndarray,
    model: ModelProfile,
    device: DeviceProfile,
    block_length: int,
    steps_per_block: int,
    calibration: float = 1.0,
) -> Dict[str, np.ndarray]:
    """Vectorised cost of many requests (closed forms, no per-cycle loop).

    Cycle b (0-based) works on a row of width w_b = p + (b+1) L. With the refresh
    cache its first step runs the full row (w_b tokens through the matmuls,
    w_b^2 attention pairs, K/V of w_b tokens written) and each of the other S-1
    steps runs the L block columns against the row (L tokens, L*w_b pairs, K/V
    of w_b tokens read, L written). Logits are needed for the L block columns on
    each of the S steps. Weight traffic is left out: it is shared by the whole
    batch, so it does not tell requests apart.
    """
    if block_length < 1 or steps_per_block < 1:
        raise ValueError("block_length and steps_per_block must be >= 1")
    if not calibration > 0.0:
        raise ValueError(f"calibration must be > 0, got {calibration!r}")
    p = np.asarray(prompt_len, dtype=np.float64)
    L, S = float(block_length), float(steps_per_block)
    K = _blocks(max_new_tokens, block_length, calibration)
    sum_w = K * p + L * K * (K + 1) / 2.0
    sum_w2 = K * p * p + p * L * K * (K + 1) + L * L * K * (K + 1) * (2 * K + 1) / 6.0
    flops = (model.linear_flops_per_token() * (sum_w + K * (S - 1) * L)
             + model.attention_flops_per_pair() * (sum_w2 + (S - 1) * L * sum_w)
             + model.head_flops_per_token() * K * S * L)
    kv_tok = model.kv_bytes_per_token()
    kv_bytes = kv_tok * (S * sum_w + K * (S - 1) * L)
    compute_s = flops / device.peak_flops
    memory_s = kv_bytes / device.mem_bandwidth
    return {
        "blocks": K,
        "flops": flops,
        "kv_bytes": kv_bytes,
        "kv_peak_bytes": kv_tok * (p + K * L),
        "compute_s": compute_s,
        "memory_s": memory_s,
        "density": compute_s / memory_s,
        "time_s": np.maximum(compute_s, memory_s),
    }


def estimate(
    requests: Union[RequestFeatures, Sequence[RequestFeatures]],
    model: ModelProfile,
    device: DeviceProfile = H200,
    block_length: int = 32,
    steps_per_block: int = 32,
    calibration: float = 1.0,
) -> Union[RequestCost, List[RequestCost]]:
    """Estimated cost of one request (-> RequestCost) or of a sequence (-> list).

    ``calibration`` is the expected fraction of the budget actually used (1.0 =
    the full budget, the safe default since EOS cannot be predicted).
    """
    single = isinstance(requests, RequestFeatures)
    reqs: Sequence[RequestFeatures] = [requests] if single else list(requests)  # type: ignore[list-item]
    arr = _estimate_arrays(
        np.array([r.prompt_len for r in reqs], dtype=np.float64),
        np.array([r.max_new_tokens for r in reqs], dtype=np.float64),
        model, device, block_length, steps_per_block, calibration,
    )
    out = [
        RequestCost(
            blocks=int(arr["blocks"][i]),
            flops=float(arr["flops"][i]),
            kv_bytes=float(arr["kv_bytes"][i]),
            kv_peak_bytes=float(arr["kv_peak_bytes"][i]),
            compute_s=float(arr["compute_s"][i]),
            memory_s=float(arr["memory_s"][i]),
            density=float(arr["density"][i]),
            time_s=float(arr["time_s"][i]),
        )
        for i in range(len(reqs))
    ]
    return out[0] if single else out


# --------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class CycleFit:
    """Fitted ``seconds per block cycle = a + b * batch_cells`` (least squares).

    ``batch_cells`` is the query cells the cycle forwarded (the engine's
    ``computed_cells``, padding included), so ``a`` is the fixed per-cycle overhead
    (launches, weight reads, host work) and ``b`` the marginal seconds per cell.
    """

    a: float
    b: float
    rmse: float
    n: int

    def predict(self, batch_cells: Union[float, np.ndarray]) -> Union[float, np.ndarray]:
        """Predicted seconds of a block cycle that forwards ``batch_cells`` cells."""
        return self.a + self.b * batch_cells


def fit_cycle_time(samples: Iterable[Tuple[float, float]]) -> CycleFit:
    """Least-squares fit of ``a + b * batch_cells`` to ``(batch_cells, seconds)`` samples.

    Needs at least two distinct ``batch_cells`` values (else the slope is not
    identifiable and ValueError is raised). Measure samples from the engine on
    the target device; a handful of cycles at varied batch sizes is enough.
    """
    data = np.asarray(list(samples), dtype=np.float64)
    if data.ndim != 2 or data.shape[1] != 2 or len(data) < 2:
        raise ValueError("samples must be at least two (batch_cells, seconds) pairs")
    x, y = data[:, 0], data[:, 1]
    if np.ptp(x) == 0:
        raise ValueError("samples need at least two distinct batch_cells values")
    A = np.stack([np.ones_like(x), x], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    rmse = float(np.sqrt(np.mean((A @ np.array([a, b]) - y) ** 2)))
    return CycleFit(a=float(a), b=float(b), rmse=rmse, n=int(len(x)))


@dataclass(frozen=True)
class CostModel:
    """Per-request time from fitted cycle constants, used instead of the roofline.

    A request's share of engine time is ``a / concurrency`` per block cycle (the fixed
    overhead, split among the ``concurrency`` requests expected to share a cycle) plus
    ``b`` per query cell it forwards over its life. Those cells depend on the cache:
    with ``refresh`` the first step of block b runs the row's ``w_b = p + (b+1) L``
    columns and the other S-1 steps its L block columns; ``none`` runs the whole row
    on every step; ``persistent`` computes each token's K/V once (prompt, then every
    block) besides the S block steps; ``dual`` is ``refresh`` under the block canvas.
    Under the full canvas (``full_canvas``) a row is ``w = p + K L`` wide from the
    start: ``none`` runs w per step, ``refresh`` w at a block's first step and then the
    block and the masked suffix behind it, ``dual`` w and then the block alone.
    """

    a: float
    b: float
    block_length: int
    concurrency: float = 1.0
    steps_per_block: int = 1
    cache: str = "refresh"
    full_canvas: bool = False

    @classmethod
    def from_fit(cls, fit: CycleFit, block_length: int, concurrency: float = 1.0, steps_per_block: int = 1,
                 cache: str = "refresh") -> "CostModel":
        return cls(a=fit.a, b=fit.b, block_length=block_length, concurrency=concurrency,
                   steps_per_block=steps_per_block, cache=cache)

    def cells(self, prompt_len: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Query cells forwarded over a request's life (vectorised)."""
        p, K = np.asarray(prompt_len, dtype=np.float64), np.asarray(blocks, dtype=np.float64)
        L, S = float(self.block_length), float(self.steps_per_block)
        if self.full_canvas:
            w = p + K * L
            if self.cache == "none":
                return K * S * w
            if self.cache == "dual":
                return K * w + K * (S - 1) * L
            return K * w + (S - 1) * (K * L + L * K * (K - 1) / 2.0)  # block + suffix behind it
        sum_w = K * p + L * K * (K + 1) / 2.0
        if self.cache == "none":
            return S * sum_w
        if self.cache == "persistent":
            return p + L + 2 * L * (K - 1) + K * (S - 1) * L
        return sum_w + K * (S - 1) * L

    def times(self, prompt_len: np.ndarray, max_new_tokens: np.ndarray, calibration: float = 1.0) -> np.ndarray:
        """Vectorised ``time_for`` over arrays of prompt lengths and budgets."""
        K = _blocks(max_new_tokens, self.block_length, calibration)
        return K * self.a / max(self.concurrency, 1e-12) + self.b * self.cells(prompt_len, K)

    def time_for(self, request: RequestFeatures, calibration: float = 1.0) -> float:
        """Estimated seconds of engine time this request accounts for."""
        return float(self.times(np.array([request.prompt_len]), np.array([request.max_new_tokens]), calibration)[0])


# --------------------------------------------------------------------------- prefix trie


def _lcp(a: Tuple[int, ...], b: Tuple[int, ...]) -> int:
    """Length of the common prefix of two tuples (C-speed slice compares + bisection)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("label", "children", "ends", "depth")

    def __init__(self, label: Tuple[int, ...], depth: int) -> None:
        self.label = label  # tokens on the edge from the parent
        self.children: Dict[int, "_Node"] = {}
        self.ends: List[int] = []  # requests whose prefix ends exactly here
        self.depth = depth  # tokens from the root to the end of this node


class PrefixTrie:
    """Compressed (radix) trie over token ids.

    Why a trie: requests that share >= ``m`` leading tokens are exactly the
    requests in the subtree of the first node at depth >= m, and when such a
    group is too big for one rank, the trie says where to cut it (along its
    subtrees, so sub-groups that share an even longer prefix stay together).
    """

    def __init__(self) -> None:
        self.root = _Node((), 0)

    def insert(self, tokens: Tuple[int, ...], idx: int) -> None:
        node, pos = self.root, 0
        while True:
            if pos == len(tokens):
                node.ends.append(idx)
                return
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = _Node(tokens[pos:], len(tokens))
                leaf.ends.append(idx)
                node.children[tokens[pos]] = leaf
                return
            k = _lcp(child.label, tokens[pos:pos + len(child.label)])
            if k < len(child.label):  # split the edge at k
                mid = _Node(child.label[:k], node.depth + k)
                child.label = child.label[k:]
                mid.children[child.label[0]] = child
                node.children[tokens[pos]] = mid
                child = mid
            node, pos = child, pos + k

    @staticmethod
    def members(node: _Node) -> List[int]:
        """All request indices in a subtree, in trie (lexicographic) order."""
        out: List[int] = []
        stack = [node]
        while stack:
            n = stack.pop()
            out.extend(n.ends)
            stack.extend(n.children[k] for k in sorted(n.children, reverse=True))
        return out

    def group_nodes(self, min_len: int) -> List[_Node]:
        """The first nodes at depth >= min_len: each subtree is one prefix group."""
        out: List[_Node] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            for k in sorted(n.children, reverse=True):
                c = n.children[k]
                (out if c.depth >= min_len else stack).append(c)
        return out


def _chunk(idx: List[int], cost: np.ndarray, lens: np.ndarray, share: float) -> List[List[int]]:
    """Cut requests (ordered by prompt length) into consecutive pieces of cost <= share."""
    order = sorted(idx, key=lambda i: (lens[i], i))
    pieces: List[List[int]] = [[]]
    acc = 0.0
    for i in order:
        if pieces[-1] and acc + cost[i] > share:
            pieces.append([])
            acc = 0.0
        pieces[-1].append(i)
        acc += cost[i]
    return pieces


def _split_group(node: _Node, cost: np.ndarray, lens: np.ndarray, share: float) -> List[List[int]]:
    """Split an over-share group along its trie subtrees, each piece <= share if possible."""
    pieces: List[List[int]] = []
    stack = [node]
    while stack:
        n = stack.pop()
        for k in sorted(n.children):
            mem = PrefixTrie.members(n.children[k])
            if float(cost[mem].sum()) <= share:
                pieces.append(mem)
            else:
                stack.append(n.children[k])
        if n.ends:
            pieces.extend(_chunk(n.ends, cost, lens, share) if float(cost[n.ends].sum()) > share else [list(n.ends)])
    return pieces


def _build_items(
    feats: Sequence[RequestFeatures], cost: np.ndarray, lens: np.ndarray, min_prefix: int, share: float,
) -> Tuple[List[List[int]], np.ndarray, int, int]:
    """Units the sharder places whole: prefix groups (<= share), pieces of bigger
    groups, and singletons. Returns (items, group id per request, #groups, #split)."""
    trie = PrefixTrie()
    for i, f in enumerate(feats):
        if min_prefix > 0 and f.prefix is not None and len(f.prefix) >= min_prefix:
            trie.insert(f.prefix, i)
    gid = np.full(len(feats), -1, dtype=np.int64)
    items: List[List[int]] = []
    n_groups = n_split = 0
    for g, node in enumerate(trie.group_nodes(min_prefix)):
        mem = PrefixTrie.members(node)
        gid[mem] = g
        if len(mem) > 1:
            n_groups += 1
        if float(cost[mem].sum()) <= share or len(mem) == 1:
            items.append(mem)
        else:
            n_split += 1
            items.extend(_split_group(node, cost, lens, share))
    next_gid = int(gid.max()) + 1 if len(feats) else 0
    for i in range(len(feats)):
        if gid[i] < 0:
            gid[i] = next_gid
            next_gid += 1
            items.append([i])
    return items, gid, n_groups, n_split


# --------------------------------------------------------------------------- assignment


def _two_ended_rounds(density: np.ndarray, num_ranks: int) -> List[List[int]]:
    """Rounds of the two-ended scan over the density-sorted items.

    Each round takes up to R items from the compute-dense end and up to R from
    the memory-dense end (BlendServe's dual scanner), so every rank receives
    both kinds in every round and ends with the same mix.
    """
    order = list(np.argsort(density, kind="stable"))
    lo, hi = 0, len(order) - 1
    rounds: List[List[int]] = []
    while lo <= hi:
        r: List[int] = []
        for _ in range(num_ranks):
            if lo > hi:
                break
            r.append(int(order[hi]))
            hi -= 1
        for _ in range(num_ranks):
            if lo > hi:
                break
            r.append(int(order[lo]))
            lo += 1
        rounds.append(r)
    return rounds


def _deal(item_cost: np.ndarray, item_density: np.ndarray, num_ranks: int) -> List[List[int]]:
    """Two-ended density rounds; inside a round, largest first onto the least-loaded rank.

    Every placement goes to the least-loaded rank, so the list-scheduling bound
    holds: max load <= total/R + largest item (<= 4/3 OPT + largest item).
    """
    heap = [(0.0, r) for r in range(num_ranks)]
    out: List[List[int]] = [[] for _ in range(num_ranks)]
    for rnd in _two_ended_rounds(item_density, num_ranks):
        for it in sorted(rnd, key=lambda j: (-item_cost[j], j)):
            load, r = heapq.heappop(heap)
            out[r].append(it)
            heapq.heappush(heap, (load + float(item_cost[it]), r))
    return out


def _repair(assign: List[List[int]], item_cost: np.ndarray, max_iter: int) -> None:
    """Move or swap one item from the heaviest to the lightest rank while that
    strictly lowers the heavier of the two; the global maximum never rises, so
    the dealing bound still holds and the tail imbalance of the deal shrinks."""
    R = len(assign)
    if R < 2:
        return
    loads = np.array([float(item_cost[a].sum()) if a else 0.0 for a in assign])
    for _ in range(max_iter):
        h, l = int(np.argmax(loads)), int(np.argmin(loads))
        gap = loads[h] - loads[l]
        if gap <= 1e-12 * max(loads[h], 1e-300) or not assign[h]:
            return
        ch = item_cost[assign[h]]
        best_delta, best = 0.0, None  # delta = cost moved from h to l, want ~gap/2, in (0, gap)
        # single move
        j = int(np.argmin(np.abs(ch - gap / 2.0)))
        if 0.0 < ch[j] < gap:
            best_delta, best = float(ch[j]), (j, None)
        # swap: h gives x, l gives y, delta = cx - cy
        if assign[l]:
            cl = item_cost[assign[l]]
            lo_order = np.argsort(cl, kind="stable")
            cl_sorted = cl[lo_order]
            target = ch - gap / 2.0
            pos = np.searchsorted(cl_sorted, target)
            for cand in (np.clip(pos, 0, len(cl_sorted) - 1), np.clip(pos - 1, 0, len(cl_sorted) - 1)):
                delta = ch - cl_sorted[cand]
                ok = (delta > 0.0) & (delta < gap)
                if ok.any():
                    score = np.where(ok, np.abs(delta - gap / 2.0), np.inf)
                    x = int(np.argmin(score))
                    if abs(delta[x] - gap / 2.0) < abs(best_delta - gap / 2.0):
                        best_delta, best = float(delta[x]), (x, int(lo_order[cand[x]]))
        if best is None or max(loads[h] - best_delta, loads[l] + best_delta) >= loads[h]:
            return
        x, y = best
        item_x = assign[h].pop(x)
        if y is not None:
            item_y = assign[l].pop(y)
            assign[h].append(item_y)
        assign[l].append(item_x)
        loads[h] -= best_delta
        loads[l] += best_delta


def _order_shard(reqs: List[int], gid: np.ndarray, lens: np.ndarray) -> List[int]:
    """Longest prompt first, each prefix group kept contiguous (placed at its longest
    member, members descending). Similar lengths stay adjacent, so the engine pads
    little; and the long requests start first, so a rank does not end with a few long
    requests running alone (LPT's argument, inside one rank) and the rows that join late
    are short ones, which the engine's catch-up forward keeps apart from wide rows."""
    units: Dict[int, List[int]] = {}
    for i in reqs:
        units.setdefault(int(gid[i]), []).append(i)
    blocks = [sorted(m, key=lambda i: (-lens[i], i)) for m in units.values()]
    blocks.sort(key=lambda m: (-lens[m[0]], m[0]))
    return [i for m in blocks for i in m]


# --------------------------------------------------------------------------- reporting


def _window_cells(widths: Sequence[float], batch_size: int) -> Tuple[float, float]:
    """(real cells, padded cells) of consecutive windows of ``batch_size`` rows,
    each left-padded to its widest row."""
    w = np.asarray(widths, dtype=np.float64)
    cells = padded = 0.0
    for s in range(0, len(w), batch_size):
        win = w[s:s + batch_size]
        cells += float(win.sum())
        padded += float(len(win) * win.max())
    return cells, padded


def padding_fraction(widths: Sequence[float], batch_size: int) -> float:
    """Padded share of cells when consecutive windows of ``batch_size`` rows are
    left-padded to the window's widest row: 1 - sum(w) / sum(n_window * max_window).
    This is what an engine fed the shard in order pays for mixing lengths."""
    cells, padded = _window_cells(widths, batch_size)
    return 1.0 - cells / padded if padded > 0 else 0.0


def _imbalance(loads: Sequence[float]) -> float:
    m = float(np.mean(loads)) if len(loads) else 0.0
    return float(max(loads)) / m if m > 0 else 1.0


def _side_report(ranks: List[List[int]], cost: np.ndarray, widths: np.ndarray,
                 compute_s: np.ndarray, memory_s: np.ndarray, batch_size: int) -> Dict[str, Any]:
    rank_cost = [float(cost[r].sum()) if r else 0.0 for r in ranks]
    win = [_window_cells(widths[r], batch_size) for r in ranks]
    pad = [1.0 - c / p_ if p_ > 0 else 0.0 for c, p_ in win]
    real, padded = sum(c for c, _ in win), sum(p_ for _, p_ in win)
    dens = [float(compute_s[r].sum() / memory_s[r].sum()) if r else 0.0 for r in ranks]
    return {
        "rank_cost": rank_cost,
        "imbalance": _imbalance(rank_cost),
        "padding": pad,
        "padding_mean": 1.0 - real / padded if padded > 0 else 0.0,
        "rank_density": dens,
        "rank_requests": [len(r) for r in ranks],
    }


# --------------------------------------------------------------------------- sharding


@dataclass
class ShardPlan:
    """Result of ``shard``.

    ``ranks[r]`` are indices into the input features, in the order rank r
    should submit them. ``items`` are the units placed whole (prefix groups,
    pieces of split groups, singletons); ``costs``/``densities`` are the
    per-request scalars used. ``report`` holds the plan's estimated per-rank
    cost, ``imbalance`` (max/mean), expected ``padding`` per rank, the same for
    the naive contiguous split (``naive_*``), and bookkeeping.
    """

    ranks: List[List[int]]
    report: Dict[str, Any]
    items: List[List[int]] = field(default_factory=list)
    costs: List[float] = field(default_factory=list)
    densities: List[float] = field(default_factory=list)
    group_ids: List[int] = field(default_factory=list)


def shard(
    feats: Sequence[RequestFeatures],
    num_ranks: int,
    model: ModelProfile,
    device: DeviceProfile = H200,
    block_length: int = 32,
    steps_per_block: int = 32,
    min_prefix: int = 32,
    batch_size: int = 16,
    calibration: float = 1.0,
    cost_model: Optional[CostModel] = None,
    repair_iters: Optional[int] = None,
) -> ShardPlan:
    """Deal requests to ``num_ranks`` ranks (balanced cost, same density mix,
    prefix groups kept together) and order each shard by prompt length.

    Steps: (1) estimate cost (roofline seconds on ``device``, or ``cost_model``'s
    fitted seconds) and density per request; (2) group requests sharing
    >= ``min_prefix`` tokens via a trie; a group is one item if its cost is at
    most one rank's share (total/R), else it is cut along the trie; (3) deal the
    items by the two-ended density scan, largest first within each round, to the
    least-loaded rank, then a short repair pass; (4) order each shard.
    ``batch_size`` only sets the window of the padding report.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    feats = list(feats)
    n = len(feats)
    lens = np.array([f.prompt_len for f in feats], dtype=np.float64)
    gens = np.array([f.max_new_tokens for f in feats], dtype=np.float64)
    est = _estimate_arrays(lens, gens, model, device, block_length, steps_per_block, calibration)
    cost = cost_model.times(lens, gens, calibration) if cost_model is not None else est["time_s"]
    total = float(cost.sum())
    share = total / num_ranks

    items, gid, n_groups, n_split = _build_items(feats, cost, lens, min_prefix, share)
    item_cost = np.array([float(cost[m].sum()) for m in items], dtype=np.float64)
    item_density = np.array(
        [float(est["compute_s"][m].sum() / est["memory_s"][m].sum()) for m in items], dtype=np.float64)

    assign = _deal(item_cost, item_density, num_ranks)
    _repair(assign, item_cost, repair_iters if repair_iters is not None else 64 + 4 * num_ranks)
    ranks = [_order_shard([i for it in a for i in items[it]], gid, lens) for a in assign]

    widths = lens + block_length  # first-cycle row width p + L
    naive = [list(map(int, c)) for c in np.array_split(np.arange(n), num_ranks)]
    mine = _side_report(ranks, cost, widths, est["compute_s"], est["memory_s"], batch_size)
    base = _side_report(naive, cost, widths, est["compute_s"], est["memory_s"], batch_size)
    report: Dict[str, Any] = dict(mine)
    report.update({f"naive_{k}": v for k, v in base.items()})
    report.update({
        "num_requests": n,
        "num_ranks": num_ranks,
        "total_cost": total,
        "rank_share": share,
        "largest_item": float(item_cost.max()) if len(items) else 0.0,
        "num_groups": n_groups,
        "num_split_groups": n_split,
        "batch_size": batch_size,
        "cost_unit": "s (fitted cycle model)" if cost_model is not None else f"s (roofline on {device.name})",
        "calibration": calibration,
    })
    return ShardPlan(ranks=ranks, report=report, items=items, costs=[float(c) for c in cost],
                     densities=[float(d) for d in est["density"]], group_ids=[int(g) for g in gid])
