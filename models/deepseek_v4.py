"""DeepSeek V4 Flash, eager, written only against an OpSet (docs/model.md is the spec).

`DeepseekV4(args, weights, ops)` binds GGUF-named QTensors (docs/model.md §2) into typed per-block records,
placed once on the OpSet's device in their stored blocks; no large weight is ever dequantized. Positions
are planned on the host: everything that depends only on `start`, the row count, the window, the ratios
and the ring capacities becomes an index array (`plan_positions`), so a forward reads nothing back from
the device. The indexer's top-k, the only data-dependent index set, flows from `ops.indexer_topk` straight
into `ops.sparse_attention`. The KV state lives in `LayerCache` objects that the caller (ds4.session)
owns; `forward` runs a contiguous block of tokens layer-major, writing their rows into those caches.
Expert parallelism (an OpSet made with `parallel="ep"`): rank r of N binds only the routed experts
`owned_experts(E, r, N)` (the stacks are sliced before placing, so each rank holds 1/N of their bytes),
runs the chosen experts it owns, and one `ops.all_reduce` per MoE layer sums the ranks' partial outputs;
everything else is replicated (docs/distributed.md). Tensor parallelism (`parallel="tp"`) also splits the
vocabulary, the attention and indexer heads and the shared expert (models/tensor_parallel.py): `tp_sum` adds
the ranks' partial attention outputs, indexer scores and FFN outputs, and the LM head's slices are gathered.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backends.registry import OpSet
from ds4.errors import ModelFileError
from models.args import ModelArgs, block_shapes, model_shapes
from models.tensor_parallel import TensorSplit, tensor_split
from ops.moe import Experts
from ops.quants import QTensor
from ops.rope_tail import rope_freqs
from ops.sparse_attention import AttnRows

OPTIONAL = ("exp_probs_b.bias",)  # the selection bias may be absent on the base model (docs/model.md §2)
SMALL = ("norm.weight", "_scale.weight", "_base.weight", "attn_sinks.weight", "_ape.weight", ".bias",
         "tid2eid.weight")  # tensors kept dequantized (vectors and tiny tables)
ROUTED = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")  # stacked [E, ...] experts

STEPS = ("eager", "fixed", "compiled")  # how a forward runs (DeepseekV4.forward)
Array = Any  # an array of the OpSet's family (a torch tensor, or an mx.array)


def check_small(name: str, values: Any, n_experts: int) -> None:
    """A SMALL tensor's values (on the host, at load): finite; a token->expert table holds expert ids."""
    if not bool(values.isfinite().all()):
        raise ModelFileError(f"tensor {name} holds non-finite values (NaN or Inf)")
    if name.endswith("tid2eid.weight"):
        ok = bool(((values >= 0) & (values < n_experts) & (values == values.round())).all())
        if not ok:
            raise ModelFileError(f"tensor {name} holds values that are not expert ids in [0, {n_experts})")


def owned_experts(n_experts: int, rank: int, world: int) -> range:
    """The routed experts rank `rank` of `world` holds: [rank·E/N, (rank+1)·E/N)."""
    return range(rank * n_experts // world, (rank + 1) * n_experts // world)


def experts_slice(w: QTensor, owned: range) -> QTensor:
    """Zero-copy view of the experts `owned` of a stacked [E, out, in] weight."""
    return QTensor(w.qtype, (len(owned), *w.shape[1:]), w.data[owned.start:owned.stop], w.name)


def bind(weights: Mapping[str, QTensor], shapes: dict[str, tuple[int, ...]], prefix: str, ops: OpSet,
         optional: tuple[str, ...] = (), n_experts: int = 0, owned: range | None = None,
         split: TensorSplit | None = None) -> dict[str, Any]:
    """Check names/shapes (and SMALL tensors' values, see check_small) and return {name without prefix:
    QTensor placed on the device, or a float array for SMALL ones}; with `owned`, routed expert stacks
    keep only those experts (expert parallelism); with `split`, this rank's share of the split tensors
    (tensor parallelism)."""
    bound = {}
    for name, shape in shapes.items():
        if name not in weights:
            if name.endswith(optional):
                continue
            raise ModelFileError(f"tensor {name} is missing")
        t = weights[name]
        if tuple(t.shape) != shape:
            raise ModelFileError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        short = name.removeprefix(prefix)
        if name.endswith(SMALL):
            values = t.dequantize()
            check_small(name, values, n_experts)
            bound[short] = ops.array(split.values(short, values) if split else values, "float32")
        elif owned is not None and name.endswith(ROUTED):
            bound[short] = ops.place(experts_slice(t, owned))
        else:
            bound[short] = ops.place(split.weight(short, t) if split else t)
    return bound


# ---- weights as typed records -------------------------------------------------------------------------

@dataclass
class HyperConnection:
    """One sub-layer's HC mixing weights (fn [2S+S², S·D], scale [3], base [2S+S²])."""

    fn: QTensor
    scale: Array
    base: Array


@dataclass
class HCHead:
    """The HC head that collapses the streams before the LM head, and the final norm."""

    fn: QTensor
    scale: Array
    base: Array
    norm: Array


@dataclass
class Compressor:
    """A compressor: kv and gate projections, the per-slot position bias (ape) and the pooled-row norm."""

    kv: QTensor
    gate: QTensor
    ape: Array
    norm: Array


@dataclass
class Indexer:
    """The lightning indexer of a ratio-4 layer: query projection, head weights and its own compressor."""

    q_b: QTensor
    proj: QTensor
    compressor: Compressor


@dataclass
class Block:
    """One decoder block's weights and derived constants."""

    ratio: int              # compression ratio (0 = raw window only; 4 = overlapping, with the indexer)
    freqs: Array            # RoPE frequencies of this block
    hc_attn: HyperConnection
    hc_ffn: HyperConnection
    attn_norm: Array
    ffn_norm: Array
    q_a: QTensor
    q_a_norm: Array
    q_b: QTensor
    kv: QTensor
    kv_norm: Array
    sinks: Array
    output_a: QTensor       # this rank's groups of the grouped output projection (tp)
    output_b: QTensor
    compressor: Compressor | None
    indexer: Indexer | None
    experts: Experts
    shared: tuple[QTensor, QTensor, QTensor]  # shared expert gate, up, down
    shared_clamp: float | None


def make_compressor(w: dict[str, Any], name: str) -> Compressor:
    return Compressor(w[f"{name}_kv.weight"], w[f"{name}_gate.weight"], w[f"{name}_ape.weight"],
                      w[f"{name}_norm.weight"])


def make_block(args: ModelArgs, ops: OpSet, w: dict[str, Any], ratio: int, hashed: bool, clamp: float,
               first_expert: int = 0) -> Block:
    """A block record from its bound weights (names without the `blk.N.` prefix); the expert stacks start
    at global expert `first_expert` (expert parallelism)."""
    yarn = (args.rope_factor, args.beta_fast, args.beta_slow, args.original_ctx)
    theta = args.compress_rope_theta if ratio else args.rope_theta
    experts = Experts(
        router=w["ffn_gate_inp.weight"], bias=w.get("exp_probs_b.bias"),
        tid2eid=ops.array(w["ffn_gate_tid2eid.weight"], "int64") if hashed else None,
        gate=w["ffn_gate_exps.weight"], up=w["ffn_up_exps.weight"], down=w["ffn_down_exps.weight"],
        top_k=args.n_experts_used, route_scale=args.route_scale, normalize=args.norm_topk_prob, clamp=clamp,
        first=first_expert)
    return Block(
        ratio=ratio, freqs=ops.array(rope_freqs(args.rope_dim, theta, yarn if ratio else None), "float32"),
        hc_attn=HyperConnection(w["hc_attn_fn.weight"], w["hc_attn_scale.weight"], w["hc_attn_base.weight"]),
        hc_ffn=HyperConnection(w["hc_ffn_fn.weight"], w["hc_ffn_scale.weight"], w["hc_ffn_base.weight"]),
        attn_norm=w["attn_norm.weight"], ffn_norm=w["ffn_norm.weight"],
        q_a=w["attn_q_a.weight"], q_a_norm=w["attn_q_a_norm.weight"], q_b=w["attn_q_b.weight"],
        kv=w["attn_kv.weight"], kv_norm=w["attn_kv_a_norm.weight"], sinks=w["attn_sinks.weight"],
        output_a=w["attn_output_a.weight"],
        output_b=w["attn_output_b.weight"],
        compressor=make_compressor(w, "attn_compressor") if ratio else None,
        indexer=Indexer(w["indexer.attn_q_b.weight"], w["indexer.proj.weight"],
                        make_compressor(w, "indexer_compressor")) if ratio == 4 else None,
        experts=experts,
        shared=(w["ffn_gate_shexp.weight"], w["ffn_up_shexp.weight"], w["ffn_down_shexp.weight"]),
        shared_clamp=clamp if args.shared_swiglu_clamp else None)


# ---- KV state ---------------------------------------------------------------------------------------

@dataclass
class LayerCache:
    """KV state of one layer, indexed by absolute position so rollback is a position change.

    `rows` holds the raw window ring (`raw_cap` slots, position p at p % raw_cap) followed by the
    compressed rows (row c at raw_cap + c, append-only). `comp_kv`/`comp_score` keep each token's
    compressor inputs in a ring of `comp_cap` slots; `index_*` are the indexer's equivalents.
    """

    ratio: int
    raw_cap: int
    rows: Array
    comp_cap: int = 0
    comp_kv: Array | None = None
    comp_score: Array | None = None
    index_rows: Array | None = None
    index_kv: Array | None = None
    index_score: Array | None = None

    def comp_capacity(self) -> int:
        """Compressed rows a position can ever see; the row after them is a scratch row no query reads."""
        return self.rows.shape[0] - self.raw_cap - 1


# ---- positions planned on the host ------------------------------------------------------------------

@dataclass(frozen=True)
class CompressorPlan:
    """Index arrays of one forward's compressor work: ring writes and the blocks these rows complete."""

    slots: Array             # [M] ring slot of each row's compressor inputs
    ape: Array               # [M] position-bias row of each row (position % ratio)
    blocks: Array | None = None     # [B] compressed-row index of each completed block (None: no block completes)
    block_pos: Array | None = None  # [B] first position of each completed block (its RoPE position)
    tokens: Array | None = None     # [B, ratio] ring slots of each completed block's tokens
    prev: Array | None = None       # [B, ratio] ring slots of the previous block's tokens (ratio 4)
    prev_valid: Array | None = None  # [B, ratio, 1] whether that previous token exists (ratio 4)
    lanes: Array | None = None      # [B, 2 * ratio] rows of a ring seen as [2 * cap, d] (ratio 4, eager, every block
                                    # with a previous one): the previous block's lane 0 rows, then this block's lane 1


@dataclass(frozen=True)
class Plan:
    """Index arrays of one forward (start, M rows) for the layers of one compression ratio."""

    pos: Array                      # [M] positions
    raw_slots: Array                # [M] raw ring slot of each row
    raw_rows: Array                 # [M, window] raw ring slots each row attends to (−1 = none)
    n_raw: tuple[int, ...]          # valid leading entries of each raw_rows row
    visible: tuple[int, ...] = ()   # compressed rows each row sees ((p + 1) // ratio); fixed plan: the capacity
    visible_rows: Array | None = None  # the counts (p + 1) // ratio as an array (for indexer_topk)
    comp_rows: Array | None = None  # [M, max visible or capacity] compressed rows (ratio != 4; −1 = none)
    compressor: CompressorPlan | None = None


_KEPT: dict[int, dict[tuple, Array]] = {}   # per OpSet, by id (a plain dict: a decode step asks ~10 times); dropped
                                            # with the OpSet
KEPT_ARRAYS = 4096   # plan arrays kept per OpSet; all dropped when full
SMALL_ROWS = 16      # forwards of up to this many rows (decode, verify) slice their ring arrays from kept ones
INT_BLOCK = 4096     # values of each kept array `int_range` slices


def kept_array(ops: OpSet, key: tuple, values: Callable[[], list], dtype: str = "int64") -> Array:
    """`ops.array(values(), dtype)`, made once per OpSet and `key` and handed out again after: the plan's index arrays
    that depend on the ring slots rather than on the absolute position (nothing writes into a plan's arrays)."""
    arrays = _KEPT.get(id(ops))
    if arrays is None:
        arrays = _KEPT[id(ops)] = {}
        weakref.finalize(ops, _KEPT.pop, id(ops), None)
    array = arrays.get(key)
    if array is None:
        if len(arrays) >= KEPT_ARRAYS:
            arrays.clear()
        array = arrays[key] = ops.array(values(), dtype)
    return array


def int_range(ops: OpSet, start: int, M: int) -> Array:
    """[start, start + M) as an array (positions, a decode's token id): for up to SMALL_ROWS values from 0 up a slice
    of one kept array per INT_BLOCK values (a small list through ops.array costs ~5 us, a slice ~1)."""
    if M > SMALL_ROWS or start < 0:
        return ops.array(list(range(start, start + M)))
    first = start - start % INT_BLOCK
    kept = kept_array(ops, ("ints", first), lambda: list(range(first, first + INT_BLOCK + SMALL_ROWS)))
    return kept[start - first:start - first + M]


def residues(ops: OpSet, pos: range, n: int) -> Array:
    """[p % n for p in pos]: for up to SMALL_ROWS positions a slice of one kept array per n."""
    if len(pos) > SMALL_ROWS:
        return ops.array([p % n for p in pos])
    first = pos.start % n
    return kept_array(ops, ("mod", n), lambda: [i % n for i in range(n + SMALL_ROWS)])[first:first + len(pos)]


def ring_rows(ops: OpSet, cap: int, window: int, pos: range) -> Array:
    """[[(p - b) % cap for b in range(window)] for p in pos] (the raw ring slots each row attends to, all valid), as
    slices of one kept array [1, cap + window] per ring: its entry j is (-j) % cap, so the row of p starts at
    (-p) % cap."""
    seq = kept_array(ops, ("descending", cap, window), lambda: [[-j % cap for j in range(cap + window)]])
    rows = [seq[:, -p % cap:-p % cap + window] for p in pos]
    return rows[0] if len(rows) == 1 else ops.cat(rows)


def early_ring_rows(ops: OpSet, cap: int, window: int, pos: range, valid_from: int) -> Array:
    """[[(p - b) % cap if p - b >= valid_from else -1 for b in range(window)] for p in pos] (rows that do not see a
    whole window yet): each row's first p - valid_from + 1 slots sliced as in `ring_rows`, the rest from a kept row
    of -1; a row with valid_from <= p < valid_from + window is one slice of a kept row
    [(valid_from + window - 1 - j) % cap for j < window, then -1 for window - 1 entries] (at j = valid_from + window
    - 1 - p: no concatenation, ~8 -> ~3 us a decode row)."""
    seq = kept_array(ops, ("descending", cap, window), lambda: [[-j % cap for j in range(cap + window)]])
    none = kept_array(ops, ("none", window), lambda: [[-1] * window])
    top = valid_from + window - 1
    early = kept_array(ops, ("early", cap, window, valid_from),
                       lambda: [[(top - j) % cap for j in range(window)] + [-1] * (window - 1)])
    rows = []
    for p in pos:
        n = max(0, min(window, p - valid_from + 1))
        rows.append(early[:, top - p:top - p + window] if valid_from <= p <= top else
                    ops.cat([seq[:, -p % cap:-p % cap + n], none[:, :window - n]], dim=1))
    return rows[0] if len(rows) == 1 else ops.cat(rows)


def plan_compressor(ops: OpSet, pos: range, ratio: int, cap: int, scratch: int | None = None) -> CompressorPlan:
    """Ring slots and completed blocks of a compressor of `ratio` with a ring of `cap` slots. With a
    `scratch` row (a fixed-capacity plan) every row pools its own block, and a block that is not complete
    yet is written to that never-read row, so the shapes do not depend on the positions."""
    slots, ape = residues(ops, pos, cap), residues(ops, pos, ratio)
    if scratch is None:
        blocks = [(p + 1) // ratio - 1 for p in pos if (p + 1) % ratio == 0]
        if not blocks:
            return CompressorPlan(slots, ape)
        targets = blocks
    else:
        blocks = [p // ratio for p in pos]
        targets = [b if (p + 1) % ratio == 0 else scratch for p, b in zip(pos, blocks, strict=True)]
    tokens = [[b * ratio + i for i in range(ratio)] for b in blocks]     # the ring slots depend on b * ratio % cap
    ring = (ratio, cap, tuple(b * ratio % cap for b in blocks))
    prev = kept_array(ops, ("prev", *ring), lambda: [[(t - ratio) % cap for t in row] for row in tokens])
    one = scratch is None and len(blocks) == 1      # an eager decode's completed block: its values from kept arrays
    lanes = None    # eager plans only: a fixed plan's arrays are the same for every position (a compiled step's)
    if ratio == 4 and scratch is None and all(b > 0 for b in blocks):
        lanes = kept_array(ops, ("lanes", *ring), lambda: [[2 * ((t - ratio) % cap) for t in row] +
                                                          [2 * (t % cap) + 1 for t in row] for row in tokens])
    return CompressorPlan(slots, ape, int_range(ops, targets[0], 1) if one else ops.array(targets),
                          int_range(ops, blocks[0] * ratio, 1) if one else ops.array([b * ratio for b in blocks]),
                          kept_array(ops, ("tokens", *ring), lambda: [[t % cap for t in row] for row in tokens]), prev,
                          kept_array(ops, ("prev_valid", ratio, tuple(b > 0 for b in blocks)),
                                     lambda: [[[t >= ratio] for t in row] for row in tokens], "bool"), lanes)


def plan_positions(ops: OpSet, start: int, M: int, window: int, cache: LayerCache, valid_from: int = 0,
                   fixed: bool = False, raw_plan: Plan | None = None) -> Plan:
    """Every index array a forward of rows start..start+M-1 needs for layers shaped like `cache`; raw
    rows below position `valid_from` are not attended (the MTP cache may start late).

    `fixed=True` gives the fixed-capacity plan of a compiled step: every shape and count depends only on
    M and the cache's capacities, never on `start` (counts cover the whole width, unused entries are −1,
    the compressed part spans the cache's capacity, and every row pools a block, see plan_compressor).
    `raw_plan`: the ratio-0 plan of the same rows for a cache of the same raw ring, whose arrays are reused.
    Arrays that depend only on ring slots and counts are made once and kept (`kept_array`), or sliced from kept ones
    (`ring_rows`, `residues`); the positions are new."""
    pos = range(start, start + M)
    if raw_plan is None:
        cap, full = cache.raw_cap, start - valid_from >= window - 1   # full: every row sees `window` rows
        if M > SMALL_ROWS:
            raw = ops.array([[(p - b) % cap if p - b >= valid_from else -1 for b in range(window)] for p in pos])
        else:
            raw = ring_rows(ops, cap, window, pos) if full else early_ring_rows(ops, cap, window, pos, valid_from)
        n_raw = (window,) * M if fixed or full else tuple(max(0, min(window, p - valid_from + 1)) for p in pos)
        raw_plan = Plan(ops.array(list(pos)) if fixed else int_range(ops, start, M), residues(ops, pos, cap), raw,
                        n_raw)
    plan = raw_plan
    ratio = cache.ratio
    if not ratio:
        return plan
    visible = tuple((p + 1) // ratio for p in pos)
    capacity = cache.comp_capacity()
    width = capacity if fixed else max(visible)
    comp = None
    if ratio != 4:
        comp = kept_array(ops, ("comp", cache.raw_cap, width, visible),
                          lambda: [[cache.raw_cap + c if c < v else -1 for c in range(width)] for v in visible])
    return Plan(plan.pos, plan.raw_slots, plan.raw_rows, plan.n_raw, (width,) * M if fixed else visible,
                kept_array(ops, ("visible", visible), lambda: list(visible)), comp,
                plan_compressor(ops, pos, ratio, cache.comp_cap, capacity if fixed else None))


def logit_index(ops: OpSet, rows: Sequence[int] | None) -> Array | None:
    """The LM-head rows of a forward as a device array, made before the step (a captured step copies nothing
    from the host); kept per row list."""
    return None if rows is None else kept_array(ops, ("logit_rows", tuple(rows)), lambda: list(rows))


class DeepseekV4:
    """The trunk: embedding, n_layers blocks with mHC, HC head, final norm and LM head."""

    def __init__(self, args: ModelArgs, weights: Mapping[str, QTensor], ops: OpSet | None = None):
        self.args, self.ops = args, ops or OpSet()
        self._compiled_run = None
        self.owned = (owned_experts(args.n_experts, self.ops.rank, self.ops.world) if self.ops.parallel
                      else range(args.n_experts))   # the routed experts this rank holds
        self.tensor_parallel = self.ops.parallel == "tp"
        self.split = tensor_split(args, self.ops.rank, self.ops.world) if self.tensor_parallel else None
        self.vocab = self.split.part(args.vocab_size) if self.split else range(args.vocab_size)  # embedding rows held
        g = bind(weights, {k: v for k, v in model_shapes(args).items() if not k.startswith("blk.")}, "", self.ops,
                 split=self.split)
        self.embedding, self.output = g["token_embd.weight"], g["output.weight"]
        self.head = HCHead(g["output_hc_fn.weight"], g["output_hc_scale.weight"], g["output_hc_base.weight"],
                           g["output_norm.weight"])
        self.layers = []
        for i in range(args.n_layers):
            prefix, hashed = f"blk.{i}.", i < args.n_hash_layers
            shapes = block_shapes(args, prefix, args.ratio(i), hashed)
            w = bind(weights, shapes, prefix, self.ops, OPTIONAL, args.n_experts, self.owned, self.split)
            self.layers.append(make_block(args, self.ops, w, args.ratio(i), hashed, args.clamp(i), self.owned.start))
        shared: dict[bool, Array] = {}   # the RoPE frequencies depend only on whether a layer compresses: one array
        for L in self.layers:            # per kind, so a backend can reuse a step's cos/sin across layers
            L.freqs = shared.setdefault(bool(L.ratio), L.freqs)

    # ---- caches -------------------------------------------------------------------------------

    def new_cache(self, ratio: int, ctx: int, chunk: int) -> LayerCache:
        """Empty state for a layer of compression `ratio`, for `ctx` tokens fed `chunk` at a time at most,
        allocated on the OpSet's device."""
        a, hd, zeros = self.args, self.args.head_dim, self.ops.zeros
        raw_cap = a.window + chunk
        n_comp = ctx // ratio + 1 if ratio else 0  # ctx // ratio blocks at most, then the scratch row
        cache = LayerCache(ratio, raw_cap, zeros(raw_cap + n_comp, hd))
        if ratio:
            coff = 2 if ratio == 4 else 1
            cache.comp_cap = 2 * ratio + chunk
            cache.comp_kv = zeros(cache.comp_cap, coff * hd)
            cache.comp_score = zeros(cache.comp_cap, coff * hd)
        if ratio == 4:
            di = a.index_head_dim
            cache.index_rows = zeros(n_comp, di)
            cache.index_kv = zeros(cache.comp_cap, 2 * di)
            cache.index_score = zeros(cache.comp_cap, 2 * di)
        return cache

    def cache_bytes(self, ratio: int, ctx: int, chunk: int) -> int:
        """Bytes `new_cache(ratio, ctx, chunk)` allocates (float32), computed without allocating."""
        a, hd = self.args, self.args.head_dim
        n_comp = ctx // ratio + 1 if ratio else 0
        floats = (a.window + chunk + n_comp) * hd
        if ratio:
            floats += 2 * (2 * ratio + chunk) * (2 if ratio == 4 else 1) * hd
        if ratio == 4:
            floats += n_comp * a.index_head_dim + 2 * (2 * ratio + chunk) * 2 * a.index_head_dim
        return 4 * floats

    def new_caches(self, ctx: int, chunk: int) -> list[LayerCache]:
        """Empty state of every trunk layer."""
        return [self.new_cache(L.ratio, ctx, chunk) for L in self.layers]

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, ids: Sequence[int], start: int, caches: list[LayerCache],
                logit_rows: Sequence[int] | None = None, step: str = "eager",
                runner: Callable | None = None) -> tuple[Array, Array | None]:
        """Run tokens `ids` at positions start..start+M-1; returns the final HC states [M, S, D] and the
        logits of `logit_rows` (indices into ids; None: no LM head at all). `step`: "eager"; "fixed"
        (eager, with the fixed-capacity plan); "compiled" (fixed plan, run by the compiled step). `runner`
        replaces `run` on the fixed plan (a session's CUDA graphs, ds4/cuda_graphs.py)."""
        if step not in STEPS:
            raise ValueError(f"step must be one of {STEPS}, got {step!r}")
        plans = self.plan(start, len(ids), caches, fixed=step != "eager")
        run = runner or (self.compiled_step() if step == "compiled" else self.run)
        # an eager decode's token id from a kept array (a compiled step's or graph's inputs stay arrays of their own)
        one = len(ids) == 1 and step == "eager" and runner is None
        token_ids = int_range(self.ops, int(ids[0]), 1) if one else self.ops.array(list(ids))
        return run(token_ids, plans, caches, logit_index(self.ops, logit_rows))

    def compiled_step(self):
        """`run` compiled by the OpSet, built once per model (a graph per row count, traced on first use)."""
        if self._compiled_run is None:
            self._compiled_run = self.ops.compile(self.run)
        return self._compiled_run

    def plan(self, start: int, M: int, caches: list[LayerCache], fixed: bool = False) -> dict[int, Plan]:
        """The position plan of each compression ratio for rows start..start+M-1."""
        plans: dict[int, Plan] = {}
        raw_plans: dict[int, Plan] = {}  # the raw-window arrays, shared by the ratios of one raw ring size
        for L, cache in zip(self.layers, caches, strict=False):
            if L.ratio not in plans:
                plans[L.ratio] = plan_positions(self.ops, start, M, self.args.window, cache, fixed=fixed,
                                                raw_plan=raw_plans.get(cache.raw_cap))
                p = plans[L.ratio]
                raw_plans.setdefault(cache.raw_cap, Plan(p.pos, p.raw_slots, p.raw_rows, p.n_raw))
        return plans

    def run(self, token_ids: Array, plans: dict[int, Plan], caches: list[LayerCache],
            logit_rows: Array | None = None) -> tuple[Array, Array | None]:
        """The forward of `token_ids` [M] under `plans` (everything on the device, the LM-head rows `logit_rows`
        included; what a compiled step or a CUDA graph captures)."""
        ops = self.ops
        x = self.embed(token_ids)[:, None, :]
        X = ops.cat([x] * self.args.hc_mult, dim=1)
        pending = None      # a block's FFN output, post and comb: its HC post runs in the next block's first op
        for L, cache in zip(self.layers, caches, strict=False):
            X, pending = self.open_block(L, X, token_ids, plans[L.ratio], cache, pending)
        if pending is not None:
            X = ops.hc_post(X, *pending)
        logits = None if logit_rows is None else self.logits(X[logit_rows], self.head)
        return X, logits

    def logits(self, X: Array, head: HCHead) -> Array:
        """HC collapse, final norm and the LM head on HC states [M, S, D] -> [M, vocab]."""
        a, ops = self.args, self.ops
        x = ops.hc_head(X, head.fn, head.scale, head.base, a.rms_eps, a.hc_eps)
        logits = ops.qmatmul(ops.rms_norm(x, head.norm, a.rms_eps), self.output)
        return ops.all_gather(logits) if self.tensor_parallel else logits   # the ranks' vocabulary slices (tp)

    def embed(self, token_ids: Array) -> Array:
        """Token embeddings [M, D]; under tp each rank looks up the ids in its vocabulary rows (zeros for the
        others') and the ranks' rows are summed."""
        if not self.tensor_parallel:
            return self.ops.embed(self.embedding, token_ids)
        local = token_ids - self.vocab.start
        held = (local >= 0) & (local < len(self.vocab))
        x = self.ops.embed(self.embedding, self.ops.where(held, local, 0))
        return self.ops.all_reduce(self.ops.where(held[:, None], x, 0.0))

    def tp_sum(self, x: Array) -> Array:
        """Under tp, the sum over ranks of a partial result (attention, indexer scores, FFN); else `x`."""
        return self.ops.all_reduce(x) if self.tensor_parallel else x

    def block(self, L: Block, X: Array, ids: Array, plan: Plan, cache: LayerCache) -> Array:
        """One decoder block: attention then FFN, each wrapped in HC pre/post (the attention's post and the FFN's pre
        in one op)."""
        X, pending = self.open_block(L, X, ids, plan, cache)
        return self.ops.hc_post(X, *pending)

    def open_block(self, L: Block, X: Array, ids: Array, plan: Plan, cache: LayerCache,
                   before: tuple[Array, Array, Array] | None = None) -> tuple[Array, tuple[Array, Array, Array]]:
        """`block` up to its FFN's HC post: the state after the attention's HC post and the FFN's (output, post,
        comb), whose hc_post the caller runs (`run`: in the next block's first op). `before`: the previous block's
        pending (output, post, comb), applied in the same op as this block's HC pre step (ops.hc_post_pre_norm, the
        bits of hc_post then hc_pre_norm)."""
        a, hc = self.args, L.hc_ffn
        if before is None:
            x, post, comb = self.hc_pre(X, L.hc_attn, L.attn_norm)
        else:
            h = L.hc_attn
            X, x, post, comb = self.ops.hc_post_pre_norm(X, *before, h.fn, h.scale, h.base, L.attn_norm,
                                                         a.hc_sinkhorn_iters, a.hc_eps, a.rms_eps)
        X, x, post, comb = self.ops.hc_post_pre_norm(X, self.attention(L, x, plan, cache), post, comb, hc.fn, hc.scale,
                                                     hc.base, L.ffn_norm, a.hc_sinkhorn_iters, a.hc_eps, a.rms_eps)
        if self.ops.parallel:   # the ranks' routed experts summed (ep), with their shared expert rows too (tp)
            routed, shared = self.ops.moe(x, ids, L.experts), self.ops.shared_expert(x, *L.shared, L.shared_clamp)
            ffn = self.tp_sum(routed + shared) if self.tensor_parallel else self.ops.all_reduce(routed) + shared
        else:
            ffn = self.ops.ffn(x, ids, L.experts, *L.shared, L.shared_clamp)
        return X, (ffn, post, comb)

    def hc_pre(self, X: Array, hc: HyperConnection, norm: Array) -> tuple[Array, Array, Array]:
        """HC pre step of a sub-layer, returning the normed sub-layer input, post and comb."""
        a = self.args
        return self.ops.hc_pre_norm(X, hc.fn, hc.scale, hc.base, norm, a.hc_sinkhorn_iters, a.hc_eps, a.rms_eps)

    def kv_rounding(self) -> tuple[int, bool]:
        """How KV rows are stored (store_rows' fp8_dims and f16): FP8-simulated no-RoPE dims (switch kv_fp8_sim),
        optionally F16-rounded."""
        a = self.args
        return a.head_dim - a.rope_dim if a.kv_fp8_sim else 0, a.f16_cache

    def store_kv(self, cache_rows: Array, slots: Array, kv: Array) -> Array:
        """KV rows as stored (`kv_rounding`)."""
        return self.ops.store_rows(cache_rows, slots, kv, *self.kv_rounding())

    def index_sim(self, x: Array) -> Array:
        """Indexer query/key as scored: Hadamard + FP4 simulation (switch indexer_fp4_sim)."""
        return self.ops.fp4_sim(self.ops.hadamard(x)) if self.args.indexer_fp4_sim else x

    def store_index(self, cache_rows: Array, slots: Array, k: Array) -> Array:
        """Indexer key rows as stored: `index_sim`, optionally F16-rounded."""
        return self.ops.store_rows(cache_rows, slots, self.index_sim(k), 0, self.args.f16_cache)

    def attention(self, L: Block, a_in: Array, plan: Plan, cache: LayerCache) -> Array:
        """Attention sub-layer output [M, D] for normed inputs `a_in` [M, D]."""
        args, ops = self.args, self.ops
        M, hd, eps = a_in.shape[0], args.head_dim, args.rms_eps
        q_lat, q, cache.rows = ops.attention_input(a_in, L.q_a, L.q_a_norm, L.q_b, L.kv, L.kv_norm, eps, hd, plan.pos,
                                                   L.freqs, cache.rows, plan.raw_slots, *self.kv_rounding())
        q = q.reshape(M, -1, hd)  # this rank's heads

        rows = AttnRows(plan.raw_rows, plan.n_raw)
        if L.ratio:
            cp = plan.compressor
            cache.comp_kv, cache.comp_score, cache.rows = self.compress(
                L, L.compressor, a_in, cp, cache.comp_kv, cache.comp_score, cache.rows, cache.raw_cap,
                hd, self.store_kv)
            if L.ratio == 4:
                cache.index_kv, cache.index_score, cache.index_rows = self.compress(
                    L, L.indexer.compressor, a_in, cp, cache.index_kv, cache.index_score, cache.index_rows, 0,
                    args.index_head_dim, self.store_index)
                chosen = self.indexer(L, a_in, q_lat, plan, cache)
                comp = ops.where(chosen >= 0, chosen + cache.raw_cap, -1)
                rows = AttnRows(plan.raw_rows, plan.n_raw, comp, tuple(min(args.index_topk, v) for v in plan.visible))
            else:
                rows = AttnRows(plan.raw_rows, plan.n_raw, plan.comp_rows, plan.visible)

        o = ops.sparse_attention(q, cache.rows, rows, L.sinks, 1 / math.sqrt(hd))
        groups = L.output_a.shape[0] // args.o_lora_rank
        return self.tp_sum(ops.attention_output(o, plan.pos, L.freqs, L.output_a, L.output_b, groups))

    def compress(self, L: Block, c: Compressor, a_in: Array, plan: CompressorPlan, kv_ring: Array,
                 score_ring: Array, out_rows: Array, out_offset: int, d: int, store) -> tuple[Array, Array, Array]:
        """Record each row's compressor inputs in the rings and store the pooled row of every block these
        rows complete at `out_offset + block` of `out_rows`; returns the updated (kv_ring, score_ring,
        out_rows)."""
        ops, ratio = self.ops, L.ratio
        kv_ring, score_ring = ops.compressor_store(a_in, c.kv, c.gate, c.ape, plan.ape, plan.slots, kv_ring, score_ring)
        if plan.blocks is None:
            return kv_ring, score_ring, out_rows
        if plan.lanes is not None:  # overlapping, every block after the first: both lanes' rows in one gather each
            kv, score = kv_ring.reshape(-1, d)[plan.lanes], score_ring.reshape(-1, d)[plan.lanes]
        else:
            kv, score = kv_ring[plan.tokens], score_ring[plan.tokens]
            if ratio == 4:  # overlapping: previous block's lane 0 (none before the first block), this block's lane 1
                prev_score = ops.where(plan.prev_valid, score_ring[plan.prev][..., :d], float("-inf"))
                prev_kv = ops.where(plan.prev_valid, kv_ring[plan.prev][..., :d], 0.0)
                kv = ops.cat([prev_kv, kv[..., d:]], dim=1)
                score = ops.cat([prev_score, score[..., d:]], dim=1)
        pooled = ops.rms_norm(ops.compress(kv, score), c.norm, self.args.rms_eps)
        slots = plan.blocks + out_offset if out_offset else plan.blocks
        return kv_ring, score_ring, store(out_rows, slots, ops.rope_tail(pooled, plan.block_pos, L.freqs))

    def indexer(self, L: Block, a_in: Array, q_lat: Array, plan: Plan, cache: LayerCache) -> Array:
        """Compressed rows [M, top_k] each query attends to (−1 = none), chosen by the lightning indexer."""
        args, ops, ix = self.args, self.ops, L.indexer
        Hi, di = args.index_n_heads, args.index_head_dim
        q, w = ops.indexer_query(q_lat, a_in, ix.q_b, ix.proj, di, plan.pos, L.freqs, args.indexer_fp4_sim,
                                 math.sqrt(Hi * di))    # this rank's heads
        scores = self.tp_sum(ops.index_scores(q, cache.index_rows, w, plan.visible))   # every rank ranks alike
        return ops.indexer_topk(scores, args.index_topk, plan.visible_rows)
