"""Op registry: each op has a PyTorch reference (`ops/<op>.py`, the `torch` backend, the fallback
and the oracle) and optional backend implementations registered with `@register(op, backend)`.

Resolution for an `OpSet(backend=..., overrides=...)`:
- an explicit backend that cannot run here raises `BackendUnavailable` (never a silent fallback);
- an explicit backend that lacks an op serves it with the reference unless `strict=True`,
  and `report()` shows that fallback;
- `auto` picks the first backend in `AUTO_ORDER` that has the op and runs on the OpSet's `device`
  (where the model keeps its tensors), else the reference: Triton only for CUDA tensors, never the
  CPU interpreter (far slower than the reference); MLX for every op on an MLX device; `cpu`
  (backends/cpu, docs/cpu.md) only for CPU tensors.
- devices come in two families: torch (`cpu`, `cuda`, `cuda:N`; backends torch and triton) and MLX
  (`mlx`, `mlx:cpu`, `mlx:gpu`; backend mlx). A backend asked for on the other family's device raises
  `BackendUnavailable` (its ops could not read the arrays); `backend="mlx"` without a device means `mlx`.
Per-op overrides (`{"qmatmul": "torch"}` or `DS4_OPS=qmatmul:torch,moe:triton`) pin single ops.
`cpu_dot="q8"` has the cpu backend's weight ops (CPU_DOT_OPS) round activations to 8 bits per block as
llama.cpp does (docs/cpu.md); it is refused where those ops would not run on the cpu backend.
Besides the ops, an OpSet carries its device's array primitives (`zeros`, `array`, `cat`, `where`,
`place`, `to_torch`, `compile`; see backends/arrays.py), so the model allocates and places everything
through it, and the collectives `all_reduce` (the sum over ranks) and `all_gather` (the ranks' slices
concatenated), both the identity in one process. A parallel OpSet (`parallel="ep"` or `"tp"`, made under an
initialised torch.distributed group, see ds4/distributed.py) knows its `rank` and `world` size; MLX refuses one.
"""
from __future__ import annotations

import importlib
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from backends.arrays import TorchArrays
from ds4.errors import BackendUnavailable

BACKENDS = ("torch", "triton", "mlx", "cpu")
PARALLEL = ("ep", "tp")  # how a model splits over ranks (docs/distributed.md): ep = routed experts by index;
# tp = also vocabulary (embedding, LM head), attention and indexer heads, and the shared expert
AUTO_ORDER = ("triton", "mlx", "cpu", "torch")
OPS = (
    "qmatmul", "moe", "indexer_topk", "verify_argmax",
    "embed", "rms_norm", "rope_tail", "hc_pre", "hc_post", "hc_head", "compress", "index_scores",
    "sparse_attention", "store_rows", "shared_expert", "fp8_sim", "fp4_sim", "hadamard", "grouped_qmatmul",
    "hc_pre_norm", "hc_post_pre_norm", "qmatmul_norm_rope", "attention_output", "compressor_store",   # fused: a
    "attention_input", "indexer_query", "ffn",  # sequence of the ops above in one call (docs/cpu.md, "Fused
)                                               # decode ops")

WEIGHT_OPS = ("qmatmul", "moe", "shared_expert", "embed", "hc_head", "grouped_qmatmul", "hc_pre_norm",   # ops
              "hc_post_pre_norm", "qmatmul_norm_rope", "attention_output", "compressor_store",  # reading weights
              "attention_input", "indexer_query", "ffn")
CPU_DOTS = ("exact", "q8")   # the cpu backend's dot products: exact float (default), 8-bit activations
CPU_DOT_OPS = ("qmatmul", "moe", "shared_expert", "grouped_qmatmul", "hc_pre_norm", "hc_post_pre_norm",  # the cpu
               "qmatmul_norm_rope", "attention_output", "compressor_store", "attention_input",  # ops taking
               "indexer_query", "ffn")  # `dot=`


@dataclass(frozen=True)
class Impl:
    """One implementation of an op."""

    op: str
    backend: str
    fn: Callable
    batch_invariant: bool = False  # row r of an M-row call equals the 1-row call bit for bit
    step: Callable | None = None   # what a compiled step calls instead of tracing `fn` (set_step)


_IMPLS: dict[str, dict[str, Impl]] = {}
_NOTES: dict[str, Callable[[], str | None]] = {}


def add_note(backend: str, note: Callable[[], str | None]) -> None:
    """Have `format_report` print `note()` (when not None) below the ops `backend` served, e.g. why its
    compiled kernels are unavailable and it runs slower paths."""
    _NOTES[backend] = note
_QUANTS: dict[str, dict[str, str]] = {}  # backend -> quant type -> how it is served ("unsupported here" if not)
UNSUPPORTED_HERE = "unsupported here"


def register(op: str, backend: str, *, batch_invariant: bool = False) -> Callable:
    """Decorator registering `fn` as `backend`'s implementation of `op`."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(OPS)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")

    def wrap(fn: Callable) -> Callable:
        _IMPLS.setdefault(op, {})[backend] = Impl(op, backend, fn, batch_invariant)
        return fn

    return wrap


def implementation(op: str, backend: str) -> Impl | None:
    """`backend`'s registered implementation of `op`, None if it has none (imports nothing)."""
    return _IMPLS.get(op, {}).get(backend)


def set_step(op: str, backend: str, step: Callable | None) -> None:
    """Have a compiled step call `step` (the arguments of `backend`'s implementation of `op`) instead of tracing that
    implementation, or (None) trace it again; the cpu backend's C calls as opaque torch ops use it (custom_ops.py in
    backends/cpu). OpSets bind an op's calls when first used: set it before making one."""
    _IMPLS[op][backend] = replace(_IMPLS[op][backend], step=step)


def step_ops() -> tuple[str, ...]:
    """`op:backend` of every implementation a compiled step calls as it is (`set_step`): part of a saved step's key."""
    return tuple(sorted(f"{op}:{b}" for op, impls in _IMPLS.items() for b, impl in impls.items() if impl.step))


def declare_quants(backend: str, served: dict[str, str], unsupported: frozenset[str] = frozenset()) -> None:
    """Record how `backend`'s weight ops serve each quant type (`served`: type -> how) and the types it refuses."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    _QUANTS[backend] = {**served, **dict.fromkeys(unsupported, UNSUPPORTED_HERE)}


def quant_support(backend: str) -> dict[str, str]:
    """How `backend` serves each quant type (the reference serves all; a runnable backend is imported first)."""
    if backend == "torch":
        from ops import quants
        return dict.fromkeys(quants.TYPES, "reference")
    backend_status(backend)
    return dict(_QUANTS.get(backend, {}))


def format_quant_support(backend: str) -> str:
    """One line per way `backend` serves quant types, e.g. `triton kernel: F32 F16 ...`."""
    by_how: dict[str, list[str]] = {}
    for name, how in quant_support(backend).items():
        by_how.setdefault(how, []).append(name)
    return "\n".join(f"{backend} {how}: {' '.join(names)}" for how, names in by_how.items())


def reference(op: str) -> Impl:
    """The PyTorch reference of `op`: the function named `op` in `ops/<op>.py`."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(OPS)}")
    impl = _IMPLS.get(op, {}).get("torch")
    if impl is None:
        module = importlib.import_module(f"ops.{op}")
        fn = getattr(module, op)
        impl = Impl(op, "torch", fn, getattr(module, "BATCH_INVARIANT", False))
        _IMPLS.setdefault(op, {})["torch"] = impl
    return impl


def backend_status(backend: str) -> tuple[bool, str]:
    """Whether `backend` can run on this machine, and why not if it cannot."""
    if backend == "torch":
        return True, ""
    if backend == "triton":
        try:
            import torch
            import triton  # noqa: F401
        except ImportError as e:
            return False, f"triton is not installed ({e}); pip install 'ds4py[triton]'"
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            return False, "triton needs a CUDA GPU, or TRITON_INTERPRET=1 to run kernels on the CPU (slow)"
    elif backend == "mlx":
        try:
            import mlx.core  # noqa: F401
        except ImportError as e:
            return False, f"mlx is not installed ({e}); pip install 'ds4py[mlx]'"
    elif backend != "cpu":
        return False, f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}"
    try:
        importlib.import_module(f"backends.{backend}")
    except ImportError as e:
        return False, f"backends.{backend} failed to import: {e}"
    return True, ""


def is_mlx_device(device: str | None) -> bool:
    """Whether `device` names the MLX family (mlx, mlx:cpu, mlx:gpu)."""
    return device is not None and (device == "mlx" or device.startswith("mlx:"))


def family(backend: str) -> str:
    """The device family whose arrays `backend`'s ops take: "mlx" or "torch"."""
    return "mlx" if backend == "mlx" else "torch"


def serves_device(backend: str, device: str) -> bool:
    """Whether `auto` may give `backend` tensors on `device` (Triton: CUDA only; tests ask for its interpreter;
    MLX: MLX devices only, and nothing else may; the cpu backend: CPU tensors only)."""
    if is_mlx_device(device) != (family(backend) == "mlx"):
        return False
    if backend == "cpu":
        return device == "cpu"
    return backend != "triton" or device.startswith("cuda")


def default_device(backend: str) -> str:
    """Where the model lives when no device is given: `mlx` for the mlx backend; else the first CUDA GPU,
    else MLX's GPU on a Mac (auto only, when mlx is installed), else the CPU."""
    if backend == "mlx":
        return "mlx"
    from backends.arrays import best_device
    best = best_device()
    if backend == "auto" and best == "cpu":
        try:
            import mlx.core as mx
            if mx.metal.is_available():
                return "mlx"
        except ImportError:
            pass
    return best


def implementations(op: str) -> dict[str, Impl]:
    """Every implementation of `op` that is registered, importing runnable backends first."""
    reference(op)
    for backend in BACKENDS[1:]:
        backend_status(backend)
    return dict(_IMPLS[op])


def parse_overrides(text: str | None) -> dict[str, str]:
    """Parse `op:backend,op:backend` (the DS4_OPS syntax)."""
    overrides = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        op, sep, backend = item.partition(":")
        if not sep or op not in OPS or backend not in BACKENDS:
            raise BackendUnavailable(
                f"bad op override {item!r}: expected op:backend with op in {OPS} and backend in {BACKENDS}")
        overrides[op] = backend
    return overrides


class OpSet:
    """The ops a model calls, resolved once per op, and the array primitives of its device;
    `report()` says which implementation ran each op."""

    def __init__(self, backend: str | None = None, overrides: dict[str, str] | None = None,
                 strict: bool = False, device: str | None = "cpu", parallel: str | None = None,
                 cpu_dot: str = "exact"):
        self.backend = backend or os.environ.get("DS4_BACKEND", "auto")
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise BackendUnavailable(f"unknown backend {self.backend!r}; choose auto or one of {BACKENDS}")
        self.overrides = {**parse_overrides(os.environ.get("DS4_OPS")), **(overrides or {})}
        self.strict, self.device = strict, device or default_device(self.backend)
        for name in {self.backend, *self.overrides.values()} - {"auto"}:
            if is_mlx_device(self.device) != (family(name) == "mlx"):
                raise BackendUnavailable(
                    f"backend {name!r} cannot run on device {self.device!r}: "
                    + ("MLX arrays need --backend mlx (or auto)" if is_mlx_device(self.device)
                       else "the mlx backend needs --device mlx (or no --device)"))
        if parallel is not None and parallel not in PARALLEL:
            raise BackendUnavailable(f"unknown parallel mode {parallel!r}; known: {', '.join(PARALLEL)}")
        self.parallel = parallel
        if is_mlx_device(self.device):
            if parallel is not None:
                raise BackendUnavailable("MLX runs in one process: --parallel needs the torch family "
                                         "(--backend torch, cpu or triton on a CPU or CUDA device)")
            ok, why = backend_status("mlx")
            if not ok:
                raise BackendUnavailable(f"device {self.device!r} needs the mlx backend, which cannot run: {why}")
            from backends.mlx.arrays import MLXArrays
            self.arrays = MLXArrays(self.device)
        else:
            self.arrays = TorchArrays(self.device, distributed=parallel is not None)
        self.zeros, self.array, self.cat = self.arrays.zeros, self.arrays.array, self.arrays.cat
        self.where, self.place, self.to_torch = self.arrays.where, self.arrays.place, self.arrays.to_torch
        self.all_reduce, self.all_gather = self.arrays.all_reduce, self.arrays.all_gather
        self.rank, self.world = self.arrays.rank, self.arrays.world
        for name in {self.backend, *self.overrides.values()} - {"auto"}:
            ok, why = backend_status(name)
            if not ok:
                raise BackendUnavailable(f"backend {name!r} was asked for but cannot run: {why}")
        self.calls: Counter[str] = Counter()
        self._resolved: dict[str, tuple[Impl, str]] = {}
        self.cpu_dot = "exact"
        self.cpu_dot = self._check_cpu_dot(cpu_dot)
        self._resolved.clear()    # resolved again with the dot product chosen

    def _check_cpu_dot(self, cpu_dot: str) -> str:
        """`cpu_dot` when every op taking it runs on the cpu backend with its kernels; else BackendUnavailable."""
        if cpu_dot not in CPU_DOTS:
            raise BackendUnavailable(f"unknown cpu dot {cpu_dot!r}; choose one of {', '.join(CPU_DOTS)}")
        if cpu_dot == "exact":
            return cpu_dot
        backends = {op: self.resolve(op)[0].backend for op in CPU_DOT_OPS}
        elsewhere = {op: b for op, b in backends.items() if b != "cpu"}
        if elsewhere:
            served = ", ".join(f"{op} on {b}" for op, b in elsewhere.items())
            raise BackendUnavailable(f"--cpu-dot {cpu_dot} needs the cpu backend (CPU tensors, --backend cpu or "
                                     f"auto), but this run serves {served}")
        from backends.cpu import kernels
        if not kernels.built():
            raise BackendUnavailable(f"--cpu-dot {cpu_dot} needs the cpu kernel library, which cannot be built here "
                                     f"({kernels.unavailable_note() or 'DS4_CPU_KERNELS=0'})")
        return cpu_dot

    def resolve(self, op: str) -> tuple[Impl, str]:
        """The implementation serving `op` and a note on how it was chosen."""
        if op in self._resolved:
            return self._resolved[op]
        wanted = self.overrides.get(op, self.backend)
        impls = implementations(op)
        if wanted == "auto":
            runnable = [b for b in AUTO_ORDER
                        if b in impls and serves_device(b, self.device) and backend_status(b)[0]]
            if not runnable:
                raise BackendUnavailable(f"no backend serves op {op!r} on device {self.device!r}")
            impl, note = impls[runnable[0]], "auto"
        elif wanted in impls:
            impl, note = impls[wanted], "requested"
        elif self.strict or is_mlx_device(self.device):
            why = "strict mode" if self.strict else f"the reference cannot read {self.device} arrays"
            raise BackendUnavailable(f"backend {wanted!r} has no implementation of op {op!r} ({why})")
        else:
            impl, note = impls["torch"], f"fallback: {wanted} has no {op}"
        if self.cpu_dot != "exact" and impl.backend == "cpu" and op in CPU_DOT_OPS:
            impl = replace(impl, fn=partial(impl.fn, dot=self.cpu_dot),
                           step=None if impl.step is None else partial(impl.step, dot=self.cpu_dot))
            note = f"{note}; --cpu-dot {self.cpu_dot}"
        self._resolved[op] = (impl, note)
        return impl, note

    def __getattr__(self, op: str) -> Callable:
        if op not in OPS:
            raise AttributeError(f"no op named {op!r}; known ops: {', '.join(OPS)}")
        impl, calls, compiling = self.resolve(op)[0], self.calls, torch.compiler.is_compiling
        fn, step = impl.fn, impl.step or impl.fn

        def call(*args, **kwargs):
            if compiling():  # a compiled step's calls are counted by its caller
                return step(*args, **kwargs)
            calls[op] += 1
            return fn(*args, **kwargs)

        if type(self).__getattr__ is OpSet.__getattr__:  # later lookups skip this method (a subclass may wrap calls)
            self.__dict__[op] = call
        return call

    def compile(self, fn: Callable) -> Callable:
        """`fn` compiled by the device's arrays (backends/arrays.py), every op bound first: resolving an op
        imports its module, which a compiled step cannot trace (an op left unresolvable fails where it is called)."""
        for op in OPS:
            try:
                getattr(self, op)
            except BackendUnavailable:
                pass
        return self.arrays.compile(fn)

    def batch_invariant(self) -> bool:
        """Whether every op resolves to a batch-invariant implementation (bit-exact rows for M <= 16)."""
        try:
            return all(self.resolve(op)[0].batch_invariant for op in OPS)
        except BackendUnavailable:
            return False

    def report(self) -> dict[str, dict]:
        """For each op called so far: backend that served it, how it was chosen, and call count."""
        out = {}
        for op in OPS:
            if self.calls[op]:
                impl, note = self.resolve(op)
                out[op] = {"backend": impl.backend, "how": note, "calls": self.calls[op],
                           "batch_invariant": impl.batch_invariant}
        return out

    def format_report(self) -> str:
        """The report as an aligned text table."""
        rows = [f"{'op':<18}{'backend':<9}{'calls':>8}  how"]
        report = self.report()
        for op, r in report.items():
            rows.append(f"{op:<18}{r['backend']:<9}{r['calls']:>8}  {r['how']}")
        for backend in sorted({r["backend"] for r in report.values()} & _NOTES.keys()):
            note = _NOTES[backend]()
            if note:
                rows.append(note)
        if self.cpu_dot != "exact":
            from backends.cpu import kernels
            prefill = (f", and Q8_0 at prefill (the 8-bit GEMM, {kernels.gemm8_path()})"
                       if kernels.gemm8_available("Q8_0") else "")
            rows.append(f"cpu dot {self.cpu_dot}: activations rounded to 8 bits per block (llama.cpp's Q8_K/Q8_0) "
                        f"for {' '.join(kernels.Q8_TYPES)} weights, M <= 16{prefill}; other types exact")
        weight_backends = {r["backend"] for op, r in report.items() if op in WEIGHT_OPS} - {"torch"}
        rows += [format_quant_support(b) for b in sorted(weight_backends)]
        return "\n".join(rows)
