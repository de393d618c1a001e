"""Compiled steps saved whole across processes (`--compile`'s warm start, docs/cpu.md "The compiled step").

torch.compile's ahead-of-time path (`aot_compile`, torch >= 2.10) captures a step once per input signature
(the shapes, dtypes and host values of its arguments) as dynamo's guards and bytecode plus inductor's code,
and `save_compiled_function` writes that to one file: a later process loads it with
`torch.compiler.load_compiled_function` and runs it without tracing the step again (the warm start that
inductor's caches alone leave to a ~10 s dynamo trace). A file is keyed by the function, its argument
signature, the model's sizes and the quant type of each of its weights (two mixes of the same sizes keep a file
each), torch's version, inductor's settings and a hash of the sources a step traces (ops/, backends/, models/),
so an edit to any of them compiles afresh instead of loading a stale step; a loaded step whose guards still reject
the arguments (another model of the same signature) is compiled again and its file replaced, with a warning.

`warm_up()` starts in the background what the first step of a process otherwise waits for (dynamo's and inductor's
runtime imported, inductor's probe of the CPU's vector instructions), so that it overlaps the loading of the weights;
the probe itself runs once per machine (`pin_vec_isa`: its choice kept beside the steps). A step is compiled without
inductor's size and alignment assertions (`STEP_OPTIONS`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import os
import platform
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TRACED_SOURCES = ("ops", "backends", "models")   # what a compiled step's code depends on
PROBE_MODULES = ("torch._inductor.cpu_vec_isa", "torch._inductor.codecache", "torch.utils.cpp_extension")
RUNTIME_MODULES = ("torch._dynamo.aot_compile", "torch._functorch._aot_autograd.aot_autograd_result",
                   "torch._inductor.output_code", "torch._inductor.async_compile", "torch._inductor.select_algorithm",
                   "torch._inductor.codegen.memory_planning")   # what loading a saved step and its code imports
# inductor's settings for a step: no size, stride and alignment assertions around every op call of the generated code
# (~340 a step on the 89M model; the fake kernels' shapes are the ops' contracts, tested against the ops)
STEP_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
_warming: threading.Thread | None = None


def compile_cache_dir() -> Path:
    """Where compiled steps are cached across processes: $TORCHINDUCTOR_CACHE_DIR if set to other than
    inductor's /tmp default (which inductor itself writes into the environment once used), else
    $DS4_CACHE/inductor (default ~/.cache/ds4py/inductor). Imports inductor only to compare with its default."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        if os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
            return Path(chosen)
    return Path(os.environ.get("DS4_CACHE", Path.home() / ".cache" / "ds4py")) / "inductor"


def use_compile_cache() -> Path:
    """Point inductor's caches (its FX graphs, kernels and vector-instruction probes) at `compile_cache_dir()`, so a
    later process finds them; returns it."""
    cache = compile_cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    return cache


def warm_up() -> None:
    """Start, once per process, a background thread importing what a saved step's load needs (RUNTIME_MODULES, ~1.9 s
    of CPU on this project's VM) while a second one runs inductor's probe of the CPU's vector instruction sets
    (`pick_vec_isa`: ten child processes loading test libraries, ~1.3 s), so that both overlap the loading of the
    weights; `wait_warm_up` joins them before this process imports anything of dynamo or inductor itself (two
    threads importing those packages' circular imports at once could deadlock)."""
    global _warming
    if _warming is None:
        use_compile_cache()     # before the probe writes its test libraries
        _warming = threading.Thread(target=_warm, name="ds4-compile-warm-up", daemon=True)
        _warming.start()


def _warm() -> None:
    """The warm-up thread: the probe's modules, then the probe (or its record, `pin_vec_isa`) on a thread of its own
    beside the other imports."""
    for name in PROBE_MODULES:
        importlib.import_module(name)
    probe = threading.Thread(target=pin_vec_isa, name="ds4-vec-isa-probe", daemon=True)
    probe.start()
    for name in RUNTIME_MODULES:
        importlib.import_module(name)
    probe.join()


def wait_warm_up() -> None:
    """Wait for `warm_up`'s threads, if started (an import they failed is repeated by the caller, which reports it),
    then make sure inductor's vector instructions are pinned (`pin_vec_isa`) before a step's key is made."""
    if _warming is not None:
        _warming.join()
    use_compile_cache()     # where the probe writes its test libraries and its record
    pin_vec_isa()


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
    where it picked another set than the flags' (a compiler that cannot build one), nothing is set and every process
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


def inductor_settings() -> str:
    """sha256 of inductor's settings (`save_config_portable`: its TORCHINDUCTOR_* switches such as the C++ wrapper),
    which shape the code a step compiles to."""
    from torch._inductor import config
    return hashlib.sha256(repr(sorted(config.save_config_portable().items())).encode()).hexdigest()


def signature(value: Any) -> tuple:
    """What a compiled graph specializes on: every tensor's shape and dtype and every host value inside
    `value` (dataclasses, objects, dicts, lists and tuples walked in order)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.device.type)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, signature(v)) for k, v in value.items()))
    if dataclasses.is_dataclass(value):
        return (type(value).__name__, *(signature(getattr(value, f.name)) for f in dataclasses.fields(value)))
    if hasattr(value, "__dict__"):
        return (type(value).__name__, signature(vars(value)))
    return (repr(value),)


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


class PrecompiledStep:
    """`fn` compiled ahead of time once per argument signature, each compiled step saved under `directory` and
    loaded from there by later processes (see the module docstring)."""

    def __init__(self, fn: Callable, directory: Path):
        self.fn, self.directory = fn, directory
        self.owner = getattr(fn, "__self__", None)    # a bound method's object: the compiled step's first argument
        self.steps: dict[tuple, Callable] = {}
        self.loaded = self.compiled = 0               # steps read from disk / compiled in this process

    def __getstate__(self) -> dict:
        """Pickled without its steps (dynamo pickles the objects a step reaches, e.g. an MTP head's trunk, whose
        compiled step holds unpicklable guards)."""
        return {"fn": self.fn, "directory": self.directory}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["fn"], state["directory"])

    def __call__(self, *args):
        sig = signature(args)
        step = self.steps.get(sig)
        if step is None:
            step = self.steps[sig] = self.load_or_compile(sig, args)
        return step(*self.bound(args))

    def bound(self, args: tuple) -> tuple:
        """The compiled step's arguments: the bound method's object first."""
        return args if self.owner is None else (self.owner, *args)

    def path(self, sig: tuple) -> Path:
        """The file of the step of signature `sig`."""
        sizes = self.owner.args if hasattr(self.owner, "args") else None     # a model's sizes
        types = weight_types(self.owner) if self.owner is not None else None
        from backends.registry import step_ops  # the ops a step calls as they are: another graph
        key = repr((getattr(self.fn, "__qualname__", repr(self.fn)), sig, signature(sizes), types, source_hash(),
                    inductor_settings(), sorted(STEP_OPTIONS.items()), step_ops()))
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.step"

    def load_or_compile(self, sig: tuple, args: tuple) -> Callable:
        """The step of signature `sig`: loaded from its file when one is there and its guards accept `args`,
        else compiled (aot_compile) and saved."""
        wait_warm_up()          # and the vector instructions pinned: part of inductor's settings in the key
        path = self.path(sig)
        if path.exists():
            try:
                with path.open("rb") as f:
                    step = torch.compiler.load_compiled_function(f)
                accepted = step.guard_check(*self.bound(args))
            except Exception as e:     # an unreadable file (another torch, a truncated write): compile afresh
                warnings.warn(f"compiled step {path} not reused ({type(e).__name__}: {str(e)[:200]}); "
                              "compiling it again", RuntimeWarning, stacklevel=3)
            else:
                if accepted:
                    self.loaded += 1
                    return step
                warnings.warn(f"compiled step {path} does not fit these arguments (its guards reject them); "
                              "compiling it again", RuntimeWarning, stacklevel=3)
        step = torch.compile(self.fn, dynamic=False, fullgraph=True, options=STEP_OPTIONS).aot_compile((args, {}))
        self.directory.mkdir(parents=True, exist_ok=True)
        step.save_compiled_function(str(path))
        self.compiled += 1
        return step
