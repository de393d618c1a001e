"""The cpu backend's ops as opaque torch ops in a compiled step (`--compile` with DS4_COMPILE_C_OPS=1, docs/cpu.md "The
compiled step with the C calls as custom ops"). Dynamo cannot trace a ctypes call, so a traced cpu op takes its torch
path inside a compiled step, and inductor compiles the references' sequences instead of the C calls eager makes (the
fused ops, the routed experts, the norms, the products on bound weights). Here each op is a torch op `ds4_step::<op>`
whose CPU kernel is the cpu op itself, run eagerly (so with the C calls and its own fallbacks, the eager bits), and
whose fake kernel gives the output shapes; a compiled step calls it as one opaque node and inductor fuses only the
model's elementwise glue between them (`use_c_ops`, through `registry.set_step`). Opt-in: measured slower than the
traced step, the dispatcher's boxing of each call's arguments costing more than eager's Python between its calls.

The op's arguments are flattened by their annotations: a QTensor becomes its blocks, type name, shape and name (the
kernel rebuilds it once per block tensor, so the cpu backend's per-weight bindings are kept across calls), a record
(`Experts`, `AttnRows`) its fields, a tuple of ints an int list. `store_rows`, `compressor_store` and
`attention_input` write their caches in place (annotated as mutated) and return them (attention_input after its new
tensors). Defined with `torch.library.Library` (a plain schema, 5-13 us of dispatch a call here) rather than
`torch.library.custom_op`, whose Python wrapper costs more."""
from __future__ import annotations

import dataclasses
import inspect
import operator
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backends.cpu.repack import REPACKED
from backends.registry import implementation, set_step
from ops.quants import TYPES, QTensor

LIBRARY = torch.library.Library("ds4_step", "DEF")
MUTATED = {"store_rows": ("cache",), "compressor_store": ("kv_ring", "score_ring"),     # written in place, returned
           "attention_input": ("cache",)}                                                 # last


def _float32(*shapes: tuple[int, ...]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(s), torch.float32) for s in shapes]


def _hc_shapes(X: torch.Tensor) -> list:
    M, S, D = X.shape
    return _float32((M, D), (M, S), (M, S, S))


# The output shapes and dtypes of each op from its (fake) arguments; the op's own contract in ops/<op>.py.
SHAPES: dict[str, Callable[..., list]] = {
    "qmatmul": lambda x, w, dot="exact": _float32((x.shape[0], w.shape[-2])),
    "grouped_qmatmul": lambda x, w, dot="exact": _float32((x.shape[0], w.shape[0])),
    "moe": lambda x, ids, experts, dot="exact": _float32(x.shape),
    "shared_expert": lambda x, gate, up, down, clamp, dot="exact": _float32((x.shape[0], down.shape[-2])),
    "ffn": lambda x, ids, experts, gate, up, down, clamp, dot="exact": _float32(x.shape),
    "embed": lambda table, ids: _float32((ids.shape[0], table.shape[1])),
    "rms_norm": lambda x, weight=None, eps=1e-6: _float32(x.shape),
    "rope_tail": lambda x, positions, freqs, inverse=False: _float32(x.shape),
    "hadamard": lambda x: _float32(x.shape),
    "fp4_sim": lambda x, block=32: _float32(x.shape),
    "hc_pre": lambda X, mixes, scale, base, iters, eps: _hc_shapes(X),
    "hc_post": lambda X, y, post, comb: _float32(X.shape),
    "hc_head": lambda X, fn, scale, base, rms_eps, hc_eps: _float32((X.shape[0], X.shape[2])),
    "sparse_attention": lambda q, kv, rows, sinks, scale: _float32(q.shape),
    "index_scores": lambda q, keys, w, visible: _float32((q.shape[0], keys.shape[0])),
    "indexer_topk": lambda scores, k, visible: [((scores.shape[0], k), torch.int64)],
    "hc_pre_norm": lambda X, *rest, **kw: _hc_shapes(X),
    "hc_post_pre_norm": lambda X, *rest, **kw: _float32(X.shape) + _hc_shapes(X),
    "qmatmul_norm_rope": lambda x, w, *rest, **kw: _float32((x.shape[0], w.shape[0])),
    "attention_output": lambda o, positions, freqs, wa, wb, *rest, **kw: _float32((o.shape[0], wb.shape[0])),
    "store_rows": lambda *args, **kw: [],
    "compressor_store": lambda *args, **kw: [],
    "indexer_query": lambda q_lat, x, q_b, proj, head_dim, *rest, **kw: _float32(
        (x.shape[0], proj.shape[0], head_dim), (x.shape[0], proj.shape[0])),
    "attention_input": lambda x, q_a, q_a_norm, q_b, *rest, **kw: _float32((x.shape[0], q_a.shape[0]),
                                                                          (x.shape[0], q_b.shape[0])),
}


def qtensor(data: torch.Tensor, qtype: str, shape: list[int], name: str) -> QTensor:
    """The QTensor of blocks `data`, made once per block tensor and kept on it (weight bindings follow the QTensor)."""
    kept = data.__dict__.get("_ds4_qtensor")
    if kept is None or kept.qtype.name != qtype or kept.shape != tuple(shape):
        kept = QTensor(TYPES[qtype], tuple(shape), data, name)
        data._ds4_qtensor = kept     # a reference cycle through the blocks: freed with them
    return kept


@dataclass(frozen=True)
class Arg:
    """One argument of an op, flattened into `schema` entries (name and type each)."""

    name: str
    kind: str                   # "value", "qtensor", "ints" or "record"
    schema: tuple[str, ...]     # its entries of the torch op's schema
    record: type | None = None  # kind "record": the dataclass
    fields: tuple[Arg, ...] = ()

    def flatten(self, value: typing.Any, out: list) -> None:
        """Append the entries of `value`."""
        if self.kind == "qtensor":
            out += [value.data, value.qtype.name, list(value.shape), value.name]
        elif self.kind == "record":
            for f in self.fields:
                f.flatten(getattr(value, f.name), out)
        else:
            out.append(list(value) if self.kind == "ints" else value)

    def builder(self, at: int, fake: bool) -> tuple[Callable[[tuple], typing.Any], int]:
        """A function rebuilding the argument from the entries (its own start at `at`), and where the next one
        starts; `fake`: weights rebuilt afresh (fake tensors) instead of kept on their blocks."""
        if self.kind == "qtensor":
            make = (lambda d, t, s, n: QTensor(TYPES[t], tuple(s), d, n)) if fake else qtensor
            return (lambda flat: make(flat[at], flat[at + 1], flat[at + 2], flat[at + 3])), at + 4
        if self.kind == "record":
            parts = []
            for f in self.fields:
                part, at = f.builder(at, fake)
                parts.append(part)
            return (lambda flat: self.record(*(part(flat) for part in parts))), at
        return operator.itemgetter(at), at + 1


SCALARS = {torch.Tensor: "Tensor", int: "int", float: "float", bool: "bool", str: "str"}


def describe(name: str, hint: typing.Any, alias: str = "") -> Arg:
    """The flattening of an argument annotated `hint` (`alias`: the letter of a tensor written in place)."""
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
    inner = next(h for h in typing.get_args(hint) if h is not type(None)) if optional else hint
    if typing.get_origin(hint) is types.UnionType and set(typing.get_args(hint)) <= {QTensor, *REPACKED}:
        inner = QTensor     # a step's weights are stored blocks: ds4.load repacks none under --compile
    if inner is QTensor and not optional:
        return Arg(name, "qtensor", (f"Tensor {name}", f"str {name}_type", f"int[] {name}_shape", f"str {name}_name"))
    if typing.get_origin(inner) is tuple and typing.get_args(inner)[:1] == (int,):
        return Arg(name, "ints", (f"int[] {name}",))
    if dataclasses.is_dataclass(inner) and not optional:
        hints = typing.get_type_hints(inner)    # each field under its own name, its entries under name_field
        fields = tuple(dataclasses.replace(describe(f"{name}_{f.name}", hints[f.name]), name=f.name)
                       for f in dataclasses.fields(inner))
        return Arg(name, "record", tuple(e for f in fields for e in f.schema), inner, fields)
    if inner not in SCALARS:
        raise TypeError(f"custom_ops: no flattening for argument {name}: {hint}")
    kind = SCALARS[inner] + ("?" if optional else "") + (f"({alias}!)" if alias else "")
    return Arg(name, "value", (f"{kind} {name}",))


class StepOp:
    """A cpu op as the torch op `ds4_step::<op>`: `__call__` (traced by dynamo) flattens the op's arguments and calls
    it; `kernel` (run by the compiled step) rebuilds them and calls the eager op; `fake` gives the output shapes."""

    def __init__(self, op: str, fn: Callable):
        self.op, self.fn, self.mutated = op, fn, MUTATED.get(op, ())
        hints, params = typing.get_type_hints(fn), list(inspect.signature(fn).parameters.values())
        self.names = [p.name for p in params]
        self.defaults = [p.default for p in params]
        letters = dict(zip(self.mutated, "abcdefgh", strict=False))
        self.args = [describe(p.name, hints[p.name], letters.get(p.name, "")) for p in params]
        entries = [e for a in self.args for e in a.schema]
        schema = ", ".join(entries)
        self.tensors = [i for i, e in enumerate(entries) if e.startswith("Tensor")]    # entries holding tensors
        self.build, self.build_fake = self.builders(fake=False), self.builders(fake=True)
        self.plain = all(a.kind == "value" for a in self.args)     # the entries are the arguments
        self.mutated_at = [self.names.index(name) for name in self.mutated]
        returned = typing.get_args(hints["return"]) or (hints["return"],)
        self.single = returned == (torch.Tensor,)
        # an op writing caches returns its new tensors (if any) before them; the torch op returns only those, as a
        # tuple (functionalization refuses a list from an op that writes an input)
        self.fresh = len(returned) - len(self.mutated) if self.mutated else None
        self.returns = self.fresh != 0
        outputs = "Tensor[]" if self.fresh is None else f"({', '.join(['Tensor'] * (self.fresh or 0))})"
        LIBRARY.define(f"{op}({schema}) -> {outputs}")
        LIBRARY.impl(op, self.kernel, "CPU")
        torch.library.register_fake(f"ds4_step::{op}", self.fake, lib=LIBRARY)
        self.torch_op = getattr(torch.ops.ds4_step, op)

    def bind(self, args: tuple, kwargs: dict) -> list:
        """The op's arguments in order, defaults filled in."""
        values = list(args) + self.defaults[len(args):]
        for k, v in kwargs.items():
            values[self.names.index(k)] = v
        return values

    def __call__(self, *args, **kwargs):
        values = self.bind(args, kwargs)
        flat: list = []
        for a, v in zip(self.args, values, strict=True):
            a.flatten(v, flat)
        out = self.torch_op(*flat)
        if self.mutated:
            kept = tuple(values[at] for at in self.mutated_at)
            return (*out, *kept) if self.fresh else kept[0] if self.single else kept
        return out[0] if self.single else tuple(out)

    def builders(self, fake: bool) -> list[Callable[[tuple], typing.Any]]:
        """Per argument, the function rebuilding it from the schema's entries."""
        made, at = [], 0
        for a in self.args:
            build, at = a.builder(at, fake)
            made.append(build)
        return made

    def kernel(self, *flat):
        """The eager op on the rebuilt arguments; a mutated cache that came back as another tensor is copied in, an
        output that is an input tensor is copied out (a torch op's outputs may not alias its inputs)."""
        values = flat if self.plain else [build(flat) for build in self.build]
        out = self.fn(*values)
        outs = [out] if self.single else list(out)
        if self.mutated:
            for at, got in zip(self.mutated_at, outs[self.fresh:], strict=True):
                cache = values[at]
                if got is not cache:
                    cache.copy_(got)
            outs = outs[:self.fresh]
        if not self.returns:
            return None
        outs = [o.clone() if any(o is flat[i] for i in self.tensors) else o.contiguous() for o in outs]
        return outs if self.fresh is None else tuple(outs)

    def fake(self, *flat):
        """Empty outputs of the op's shapes and dtypes."""
        if not self.returns:
            return None
        values = [build(flat) for build in self.build_fake]
        outs = [torch.empty(shape, dtype=dtype) for shape, dtype in SHAPES[self.op](*values)]
        return outs if self.fresh is None else tuple(outs)


STEP_OPS: dict[str, StepOp] = {}    # made on first use, kept for the process (a torch op is defined once)
WANTED = os.environ.get("DS4_COMPILE_C_OPS") == "1"     # asked for (the cpu package then imports this and turns it on)


def use_c_ops(on: bool) -> None:
    """Whether compiled steps call the cpu backend's ops (those of SHAPES it implements, imported before) as the torch
    ops `ds4_step::<op>` (on) or trace their torch paths (off, the default: measured faster, docs/cpu.md). For OpSets
    made after the call."""
    for op in SHAPES:
        if implementation(op, "cpu") is not None:
            set_step(op, "cpu", step_op(op) if on else None)


def step_op(op: str) -> StepOp:
    """The StepOp of the cpu backend's `op`, made on first use (a saved step calls the torch op by name)."""
    if op not in STEP_OPS:
        STEP_OPS[op] = StepOp(op, implementation(op, "cpu").fn)
    return STEP_OPS[op]
