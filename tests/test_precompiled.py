"""Compiled steps saved whole (backends/precompiled.py): one file per argument signature, reused by a later
step object, replaced with a warning when unreadable; the key follows the traced sources."""
from __future__ import annotations

import json

import pytest
import torch

from backends import precompiled
from backends.precompiled import PrecompiledStep, signature


def double_plus_one(x: torch.Tensor) -> torch.Tensor:
    """A step small enough to compile in seconds."""
    return torch.sigmoid(x) * 2 + 1


def test_signature_sees_shapes_dtypes_and_host_values():
    x = torch.zeros(2, 3)
    assert signature((x, [1, 2])) == signature((torch.ones(2, 3), [1, 2]))
    assert signature((x, [1, 2])) != signature((torch.zeros(3, 3), [1, 2]))
    assert signature((x, [1, 2])) != signature((x.double(), [1, 2]))
    assert signature((x, [1, 2])) != signature((x, [1, 3]))


def test_a_saved_step_is_loaded_by_the_next_step_object_and_a_bad_file_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    x = torch.randn(4, 8)
    first = PrecompiledStep(double_plus_one, tmp_path / "steps")
    assert torch.allclose(first(x), double_plus_one(x))
    assert (first.compiled, first.loaded) == (1, 0)
    files = list((tmp_path / "steps").glob("*.step"))
    assert len(files) == 1

    second = PrecompiledStep(double_plus_one, tmp_path / "steps")
    assert torch.allclose(second(x), double_plus_one(x))
    assert (second.compiled, second.loaded) == (0, 1)
    second(torch.randn(2, 8))                      # another shape: its own step and file
    assert second.compiled == 1 and len(list((tmp_path / "steps").glob("*.step"))) == 2

    files[0].write_bytes(b"not a step")
    third = PrecompiledStep(double_plus_one, tmp_path / "steps")
    with pytest.warns(RuntimeWarning, match="not reused"):
        assert torch.allclose(third(x), double_plus_one(x))
    assert third.compiled == 1 and files[0].read_bytes() != b"not a step"


def test_an_edit_of_the_traced_sources_or_inductor_settings_changes_the_file(tmp_path, monkeypatch):
    step = PrecompiledStep(double_plus_one, tmp_path)
    sig = signature((torch.zeros(1),))
    before = step.path(sig)
    monkeypatch.setattr(precompiled, "source_hash", lambda: "edited")
    edited = step.path(sig)
    assert edited != before
    from torch._inductor import config
    with config.patch(cpp_wrapper=not config.cpp_wrapper):     # TORCHINDUCTOR_CPP_WRAPPER: other code
        assert step.path(sig) != edited
    assert step.path(sig) == edited


def test_a_torch_without_aot_compile_is_refused_by_name(monkeypatch):
    from backends.arrays import TorchArrays
    from ds4.errors import BackendUnavailable
    monkeypatch.delattr(torch.compiler, "load_compiled_function")
    with pytest.raises(BackendUnavailable, match="aot_compile"):
        TorchArrays("cpu").compile(double_plus_one)


def test_two_mixes_of_the_same_sizes_keep_a_file_each(tmp_path):
    from dataclasses import dataclass

    from ops.quants import QTensor

    @dataclass
    class Model:
        args: tuple
        layers: list

        def run(self, x: torch.Tensor) -> torch.Tensor:
            return x

    def weight(qtype: str) -> QTensor:
        return QTensor.quantize(torch.zeros(1, 256), qtype, "w")

    sig = signature((torch.zeros(1),))
    q4, q2 = Model((1, 2), [weight("Q4_K")]), Model((1, 2), [weight("Q2_K")])
    path = PrecompiledStep(q4.run, tmp_path).path(sig)
    assert PrecompiledStep(q2.run, tmp_path).path(sig) != path
    assert PrecompiledStep(Model((1, 2), [weight("Q4_K")]).run, tmp_path).path(sig) == path


def test_the_warm_up_names_modules_that_exist_and_joins():
    """warm_up's module lists follow torch's layout (a renamed module would fail the background import)."""
    import importlib.util
    import sys
    for name in precompiled.PROBE_MODULES + precompiled.RUNTIME_MODULES:
        assert importlib.util.find_spec(name) is not None, name
    precompiled.warm_up()
    precompiled.wait_warm_up()
    assert all(name in sys.modules for name in precompiled.RUNTIME_MODULES)


EAGER_RUN = """
import sys
import ds4
engine = ds4.load()
ids = [t.id for t in engine.generate("def f(x):", max_tokens=2, raw=True)]
print(len(ids), "torch._dynamo" in sys.modules, "torch._inductor" in sys.modules)
"""


def test_an_eager_run_imports_neither_dynamo_nor_inductor():
    """Only --compile pays for importing torch.compile's machinery (~1 s of CPU on this project's VM)."""
    import os
    import subprocess
    import sys
    root = precompiled.ROOT
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", EAGER_RUN], env=env, cwd=root, check=True, capture_output=True,
                         text=True).stdout.split()
    assert out == ["2", "False", "False"]


def test_a_saved_step_whose_guards_reject_the_arguments_warns_and_is_compiled_again(tmp_path, monkeypatch):
    """Another model of the same signature finds the file but not its guards' assumptions: said on stderr (here
    torch's load and compile stand-ins, no inductor compile)."""
    class Step:
        def __init__(self, accepts: bool):
            self.accepts = accepts

        def guard_check(self, *args) -> bool:
            return self.accepts

        def save_compiled_function(self, path: str) -> None:
            open(path, "w").close()

        def __call__(self, x):
            return x + 1

    class Compiled:
        def aot_compile(self, example):
            return Step(True)

    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda f: Step(False))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: Compiled())
    step = PrecompiledStep(double_plus_one, tmp_path)
    x = torch.zeros(2)
    step.path(signature((x,))).write_bytes(b"a step of another model")
    with pytest.warns(RuntimeWarning, match="guards reject"):
        assert torch.equal(step(x), x + 1)
    assert (step.loaded, step.compiled) == (0, 1)
    assert step.path(signature((x,))).read_bytes() == b""


def test_the_vector_instruction_probe_runs_once_per_machine(tmp_path, monkeypatch):
    """pin_vec_isa probes once and keeps the choice: a later process with the record trusts the CPU's flags
    (inductor's cpp.vec_isa_ok) without probing; a record whose probe picked another set, or a value set by the user,
    leaves inductor's setting alone."""
    from torch._inductor import config, cpu_vec_isa
    monkeypatch.setenv("DS4_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(precompiled.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(precompiled, "flags_choice", lambda: "avx512")
    probes = []
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: probes.append(1) or "avx512")
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    assert precompiled.pin_vec_isa() and config.cpp.vec_isa_ok is True and len(probes) == 1
    record = tmp_path / "inductor" / "vec_isa.json"
    assert json.loads(record.read_text())["picked"] == "avx512"

    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)     # a later process: the record, no probe
    assert precompiled.pin_vec_isa() and len(probes) == 1

    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)     # the probe picked other than the flags: probe each time
    monkeypatch.setattr(precompiled, "flags_choice", lambda: "avx512 avx512_vnni amx_tile")
    assert not precompiled.pin_vec_isa() and config.cpp.vec_isa_ok is None and len(probes) == 1

    record.write_text(json.dumps({"machine": "another machine", "picked": "avx2"}))
    monkeypatch.setattr(precompiled, "flags_choice", lambda: "avx512")
    assert precompiled.pin_vec_isa() and len(probes) == 2     # probed again, for this machine

    monkeypatch.setattr(config.cpp, "vec_isa_ok", False)    # the user's TORCHINDUCTOR_VEC_ISA_OK=0
    assert not precompiled.pin_vec_isa() and config.cpp.vec_isa_ok is False and len(probes) == 2
