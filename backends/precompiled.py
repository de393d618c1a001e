"""Compiled steps saved whole across processes (`--compile`'s warm start, docs/cpu.md "The compiled step").

A step is exported once per argument signature (the shapes, strides, dtypes and host values of its arguments) with
`torch.export` (non-strict), as a function of flat tensors: the weights reachable from the model (its "slots") and the
arguments' tensors, so that no weight is copied into the compiled code. AOTInductor compiles the exported program into a
package (`aoti_compile_and_package`: one shared library whose C++ wrapper runs the whole step), and a later process
loads it with torch's C++ loader (`torch._C._aoti.AOTIModelPackageLoader`) and runs it: no trace, no compile, and
neither dynamo nor inductor imported (~1.9 s of CPU here). A file is keyed by the function, its argument signature, the
model's sizes, the quant type and layout of each of its weights (two mixes of the same sizes keep a file each), torch's
version, the CPU's flags, inductor's TORCHINDUCTOR_* settings and a hash of the sources a step traces (ops/, backends/,
models/), so an edit to any of them compiles afresh instead of loading a stale step; a file that cannot be loaded is
compiled again and replaced, with a warning. The signature is ours to check (the loader checks nothing): the key holds
every tensor's shape, stride and dtype and every host value, which the compiled code is specialised on.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import os
import platform
import sys
import threading
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TRACED_SOURCES = ("ops", "backends", "models")   # what a compiled step's code depends on
STEP_KERNEL = "backends.cpu.step_kernel"   # defines the torch ops a step may call (ds4::qgemv), its kernel in C++
# inductor's settings for a step: no size, stride and alignment assertions around every op call of the generated code
# (the fake kernels' shapes are the ops' contracts, tested against the ops)
STEP_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
_chosen: str | None = None      # the TORCHINDUCTOR_CACHE_DIR this process set (use_compile_cache)


def compile_cache_dir() -> Path:
    """Where compiled steps are cached across processes: $TORCHINDUCTOR_CACHE_DIR if set, unless to inductor's /tmp
    default (which inductor itself writes into the environment once imported), else $DS4_CACHE/inductor (default
    ~/.cache/ds4py/inductor). Imports nothing of inductor."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    defaults = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if chosen and (chosen == _chosen or defaults is None
                   or os.path.abspath(chosen) != os.path.abspath(defaults.default_cache_dir())):
        return Path(chosen)
    return Path(os.environ.get("DS4_CACHE", Path.home() / ".cache" / "ds4py")) / "inductor"


def use_compile_cache() -> Path:
    """Point inductor's caches (its FX graphs, kernels and vector-instruction probes) at `compile_cache_dir()`, so a
    later process finds them; returns it."""
    global _chosen
    cache = compile_cache_dir()
    _chosen = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    return cache


def machine_isa_key() -> str:
    """What inductor's probe of the vector instructions depends on: torch's version, the CPU's flags as torch reads
    them, the architecture and the C++ compiler asked for."""
    from torch._inductor.cpu_vec_isa import x86_isa_checker
    return repr((torch.__version__, platform.machine(), sorted(x86_isa_checker()), os.environ.get("CXX")))


def flags_choice() -> str:
    """The instruction set inductor picks when it trusts the CPU's flags (`cpp.vec_isa_ok`): the first of its list
    whose flags the CPU has."""
    from torch._inductor.cpu_vec_isa import supported_vec_isa_list, x86_isa_checker
    have = x86_isa_checker()
    return next((str(isa) for isa in supported_vec_isa_list if all(f in have for f in str(isa).split())), "")


_pinned = threading.Lock()


def pin_vec_isa() -> bool:
    """Skip inductor's probe of the vector instructions where this machine's record says it picks what the CPU's flags
    say: `cpp.vec_isa_ok` set to True (inductor's own setting, TORCHINDUCTOR_VEC_ISA_OK=1), which trusts the flags.
    The probe (`pick_vec_isa`: a test library built and loaded by a child process per instruction set, ~1.3 s of CPU
    here) runs once per machine, torch and compiler, and its choice is kept in `compile_cache_dir()/vec_isa.json`;
    where it picked another set than the flags' (a compiler that cannot build one), nothing is set and every compile
    probes. A value set by the user is left alone. x86-64 only. Returns whether the flags are trusted."""
    from torch._inductor import config
    with _pinned:
        if config.cpp.vec_isa_ok is not None or platform.machine() not in ("x86_64", "AMD64"):
            return bool(config.cpp.vec_isa_ok)
        record, key = compile_cache_dir() / "vec_isa.json", machine_isa_key()
        try:
            kept = json.loads(record.read_text())
        except (OSError, ValueError):
            kept = {}
        if kept.get("machine") != key:
            from torch._inductor.cpu_vec_isa import pick_vec_isa
            kept = {"machine": key, "picked": str(pick_vec_isa())}
            record.parent.mkdir(parents=True, exist_ok=True)
            temporary = record.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(kept))
            temporary.replace(record)
        if kept.get("picked") == flags_choice():
            config.cpp.vec_isa_ok = True
        return bool(config.cpp.vec_isa_ok)


@functools.cache
def source_hash() -> str:
    """sha256 of every Python and C source under TRACED_SOURCES (read once per process)."""
    h = hashlib.sha256(torch.__version__.encode())
    for top in TRACED_SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".c"):
                h.update(str(path.relative_to(ROOT)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def cpu_flags() -> str:
    """The CPU's instruction-set flags (the compiled library's code uses the vector instructions they name)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def inductor_settings() -> str:
    """sha256 of what shapes the code a step compiles to besides the step: inductor's TORCHINDUCTOR_* switches, the
    C++ compiler asked for, the machine and its CPU flags (read without importing inductor: a warm start imports none
    of it)."""
    chosen = sorted((k, v) for k, v in os.environ.items()
                    if k.startswith("TORCHINDUCTOR_") and k != "TORCHINDUCTOR_CACHE_DIR")
    return hashlib.sha256(repr((chosen, os.environ.get("CXX"), platform.machine(), cpu_flags())).encode()).hexdigest()


def flatten(value: Any, tensors: list[torch.Tensor]) -> tuple:
    """What a compiled step specializes on: every tensor's shape, stride and dtype and every host value inside
    `value` (dataclasses, objects, dicts, lists and tuples walked in order); its tensors appended to `tensors`."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("tensor", tuple(value.shape), value.stride(), str(value.dtype), value.device.type)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(flatten(v, tensors) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, flatten(v, tensors)) for k, v in value.items()))
    if dataclasses.is_dataclass(value):
        return (type(value).__name__, *(flatten(getattr(value, f.name), tensors) for f in dataclasses.fields(value)))
    if hasattr(value, "__dict__"):
        return (type(value).__name__, flatten(vars(value), tensors))
    return (repr(value),)


def signature(value: Any) -> tuple:
    """`flatten`'s signature of `value` alone."""
    return flatten(value, [])


def rebuild(value: Any, tensors) -> Any:
    """`value` with its tensors (in `flatten`'s order) taken from the iterator `tensors`: new lists, tuples, dicts and
    dataclasses around them; another object holding a tensor cannot be rebuilt (TypeError)."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, (list, tuple)):
        return type(value)(rebuild(v, tensors) for v in value)
    if isinstance(value, dict):
        return {k: rebuild(v, tensors) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: rebuild(getattr(value, f.name), tensors)
                                             for f in dataclasses.fields(value) if f.init})
    if hasattr(value, "__dict__"):
        inside: list[torch.Tensor] = []
        flatten(vars(value), inside)
        if inside:
            raise TypeError(f"precompiled: cannot pass the tensors inside a {type(value).__name__} to a compiled step")
    return value


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where a weight tensor of a step's model sits: `owner[key]` (a list or dict) or `owner.key` (an object)."""

    owner: Any
    key: Any
    path: str

    def get(self) -> torch.Tensor:
        return self.owner[self.key] if isinstance(self.owner, (list, dict)) else getattr(self.owner, self.key)

    def put(self, tensor: torch.Tensor) -> None:
        if isinstance(self.owner, (list, dict)):
            self.owner[self.key] = tensor
        else:
            object.__setattr__(self.owner, self.key, tensor)     # frozen records (QTensor) too


def weight_slots(owner: Any) -> list[Slot]:
    """Every tensor reachable from `owner`'s attributes, records, lists and dicts, in a fixed order (a step's
    weights: inputs of the compiled step rather than constants copied into it). Not walked: functions, classes,
    modules, compiled steps and the OpSet (`owner.ops`). A tensor inside a tuple cannot be swapped (TypeError)."""
    slots: list[Slot] = []
    seen: set[int] = set()
    todo: list[tuple[str, Any]] = [("", owner)]
    while todo:
        path, value = todo.pop()
        if id(value) in seen or isinstance(value, (str, bytes, int, float, type(None), type, types.ModuleType,
                                                   PrecompiledStep)) or callable(value):
            continue
        seen.add(id(value))
        if isinstance(value, (list, tuple, dict)):
            items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
            children = [(f"{path}[{k!r}]", v, k) for k, v in items]
        elif hasattr(value, "__dict__"):
            children = [(f"{path}.{k}", v, k) for k, v in vars(value).items() if not (value is owner and k == "ops")]
        else:
            continue
        for child, v, k in children:
            if isinstance(v, torch.Tensor):
                if isinstance(value, tuple):
                    raise TypeError(f"precompiled: the weight {child} sits in a tuple, which a step cannot swap")
                slots.append(Slot(value, k, child))
        todo += [(child, v) for child, v, _ in reversed(children) if not isinstance(v, torch.Tensor)]
    return slots


def weight_types(owner: Any) -> str:
    """sha256 of the quant type of every weight (QTensor) reachable from `owner`'s attributes, records, lists and
    dicts, by attribute path: two mixes of the same sizes (q2, q4) trace different kernels."""
    from ops.quants import QTensor
    h, seen, todo = hashlib.sha256(), set(), [("", owner)]
    while todo:
        path, value = todo.pop()
        if id(value) in seen or isinstance(value, (torch.Tensor, str, bytes, int, float, type(None))):
            continue
        seen.add(id(value))
        if isinstance(value, QTensor):
            h.update(f"{path}={value.qtype.name};".encode())
        elif isinstance(value, (list, tuple)):
            todo += [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, dict):
            todo += [(f"{path}[{k!r}]", v) for k, v in value.items()]
        elif hasattr(value, "__dict__") and not callable(value):
            todo += [(f"{path}.{k}", v) for k, v in sorted(vars(value).items(), reverse=True)]
    return h.hexdigest()


def exported(fn: Callable, slots: list[Slot], args: tuple, traced: dict) -> torch.nn.Module:
    """`fn` on `args`' structure as a module of flat tensors, for torch.export: the weights in `slots` (swapped in for
    the call, put back after), then the arguments' tensors; the outputs' pattern recorded in `traced["outputs"]` (per
    output, tensor or None; None: a single tensor). Its state is in a closure: export copies a module's attributes."""

    class Exported(torch.nn.Module):
        def forward(self, *flat):
            weights, rest = flat[:len(slots)], flat[len(slots):]
            kept = [slot.get() for slot in slots]
            for slot, tensor in zip(slots, weights, strict=True):
                slot.put(tensor)
            try:
                rebuilt = rebuild(args, iter(rest))
                out = fn(*rebuilt)
                written: list[torch.Tensor] = []
                flatten(rebuilt, written)
                replaced = [slot.path for slot, tensor in zip(slots, weights, strict=True) if slot.get() is not tensor]
                if replaced or any(a is not b for a, b in zip(written, rest, strict=True)):
                    raise TypeError(f"precompiled: the step replaces a tensor of its model or arguments "
                                    f"({replaced[:3]}) instead of writing it in place; a compiled step cannot do that")
            finally:
                for slot, tensor in zip(slots, kept, strict=True):
                    slot.put(tensor)
            if isinstance(out, torch.Tensor):
                traced["outputs"] = None
                return (out,)
            traced["outputs"] = [o is not None for o in out]
            return tuple(o for o in out if o is not None)

    return Exported()


@dataclasses.dataclass
class Step:
    """A loaded step: the package's C++ runner, the model's weights it takes first, its outputs' pattern and what runs
    before it (the C++ kernel's thread count set)."""

    runner: Any
    weights: list[torch.Tensor]
    outputs: list[bool] | None
    before: Callable[[], None]

    def __call__(self, tensors: list[torch.Tensor]):
        self.before()
        out = iter(self.runner.run(self.weights + tensors))
        if self.outputs is None:
            return next(out)
        return tuple(next(out) if present else None for present in self.outputs)


class PrecompiledStep:
    """`fn` compiled ahead of time once per argument signature, each compiled step saved under `directory` and
    loaded from there by later processes (see the module docstring)."""

    def __init__(self, fn: Callable, directory: Path):
        self.fn, self.directory = fn, directory
        self.owner = getattr(fn, "__self__", None)    # a bound method's object: whose weights the step takes
        self.steps: dict[tuple, Step] = {}
        self.loaded = self.compiled = 0               # steps read from disk / compiled in this process

    def __getstate__(self) -> dict:
        """Pickled without its steps."""
        return {"fn": self.fn, "directory": self.directory}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["fn"], state["directory"])

    def __call__(self, *args):
        tensors: list[torch.Tensor] = []
        sig = flatten(args, tensors)
        step = self.steps.get(sig)
        if step is None:
            step = self.steps[sig] = self.load_or_compile(sig, args)
        return step(tensors)

    def path(self, sig: tuple, slots: list[Slot] | None = None) -> Path:
        """The file of the step of signature `sig` on the weights `slots` (default: the owner's)."""
        owner = self.owner
        slots = weight_slots(owner) if slots is None and owner is not None else slots or []
        sizes = owner.args if hasattr(owner, "args") else None     # a model's sizes
        types_ = weight_types(owner) if owner is not None else None
        layout = [(s.path, flatten(s.get(), [])) for s in slots]
        from backends.registry import step_ops  # the ops a step calls as they are: another graph
        key = repr((getattr(self.fn, "__qualname__", repr(self.fn)), sig, signature(sizes), types_, layout,
                    source_hash(), inductor_settings(), sorted(STEP_OPTIONS.items()), step_ops()))
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pt2"

    def load_or_compile(self, sig: tuple, args: tuple) -> Step:
        """The step of signature `sig`: loaded from its file when there, else exported, compiled and saved."""
        importlib.import_module(STEP_KERNEL).load()     # built once: a failure to build is raised, not retried
        slots = weight_slots(self.owner) if self.owner is not None else []
        path = self.path(sig, slots)
        weights = [slot.get() for slot in slots]
        if path.exists():
            try:
                step = load(path, weights)
            except Exception as e:     # an unreadable file (another torch, a truncated write): compile afresh
                warnings.warn(f"compiled step {path} not reused ({type(e).__name__}: {str(e)[:200]}); "
                              "compiling it again", RuntimeWarning, stacklevel=3)
            else:
                self.loaded += 1
                return step
        compile_package(self.fn, slots, args, path)
        self.compiled += 1
        return load(path, weights)


def compile_package(fn: Callable, slots: list[Slot], args: tuple, path: Path) -> None:
    """Export `fn` on `args` as a function of the weights in `slots` and the arguments' tensors, compile it with
    AOTInductor and write the package to `path` (atomically)."""
    use_compile_cache()     # inductor's caches beside the steps, before inductor is imported
    pin_vec_isa()
    traced: dict = {}
    module = exported(fn, slots, args, traced)
    tensors: list[torch.Tensor] = []
    flatten(args, tensors)
    program = torch.export.export(module, (*(s.get() for s in slots), *tensors), strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp.pt2")
    metadata = {"ds4_outputs": json.dumps(traced["outputs"])}
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(temporary),
        inductor_configs={**STEP_OPTIONS, "aot_inductor.metadata": metadata})
    temporary.replace(path)


def load(path: Path, weights: list[torch.Tensor]) -> Step:
    """The package at `path` loaded by torch's C++ loader (the torch ops it calls defined first, ds4::qgemv's kernel in
    C++: STEP_KERNEL)."""
    kernel = importlib.import_module(STEP_KERNEL)
    runner = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    return Step(runner, weights, json.loads(runner.get_metadata()["ds4_outputs"]), kernel.sync_threads)
