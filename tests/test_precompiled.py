"""Compiled steps saved whole (backends/precompiled.py): one AOTInductor package per argument signature, reused by a
later step object, replaced with a warning when unreadable; the key follows the traced sources, inductor's settings and
the weights' layout."""
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
    assert signature((x.t().contiguous().t(),)) != signature((torch.zeros(2, 3),))     # strides: other code


def test_an_edit_of_the_traced_sources_or_inductor_settings_changes_the_file(tmp_path, monkeypatch):
    step = PrecompiledStep(double_plus_one, tmp_path)
    sig = signature((torch.zeros(1),))
    before = step.path(sig)
    monkeypatch.setattr(precompiled, "source_hash", lambda: "edited")
    edited = step.path(sig)
    assert edited != before
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")     # inductor's settings: other code
    assert step.path(sig) != edited
    monkeypatch.delenv("TORCHINDUCTOR_MAX_AUTOTUNE")
    assert step.path(sig) == edited


def test_a_torch_without_aot_inductor_is_refused_by_name(monkeypatch):
    from backends.arrays import TorchArrays
    from ds4.errors import BackendUnavailable
    monkeypatch.delattr(torch._C, "_aoti")
    with pytest.raises(BackendUnavailable, match="AOTInductor"):
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


class Model:
    """A step's owner: weights in a record, a list and a dict, found and swapped in by the step."""

    def __init__(self):
        self.scale = torch.full((3,), 2.0)
        self.layers = [{"bias": torch.ones(3)}]

    def run(self, x: torch.Tensor, cache: list[torch.Tensor]) -> tuple[torch.Tensor, None]:
        cache[0].copy_(x)      # written in place, as a session's caches are
        return x * self.scale + self.layers[0]["bias"], None

    def replace(self, x: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        cache[0] = x + 1       # a new tensor where the argument's was: not a step
        return x


def test_a_saved_step_takes_its_models_weights_is_loaded_by_the_next_step_object_and_a_bad_file_replaced(
        tmp_path, monkeypatch):
    """The weights are the package's inputs, not constants in it (a later change to a weight is seen); the outputs
    keep their None; a cache written in place is written; a second step object loads the file; an unreadable file is
    compiled again with a warning (here a stand-in compile writing the good package back); a step replacing a tensor
    instead of writing it is refused."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model, x, cache = Model(), torch.tensor([1.0, 2.0, 3.0]), [torch.zeros(3)]
    assert [s.path for s in precompiled.weight_slots(model)] == [".scale", ".layers[0]['bias']"]
    first = PrecompiledStep(model.run, tmp_path / "steps")
    y, none = first(x, cache)
    assert torch.equal(y, x * 2 + 1) and none is None and torch.equal(cache[0], x)
    assert (first.compiled, first.loaded) == (1, 0)
    model.scale.fill_(3.0)
    assert torch.equal(first(x, cache)[0], x * 3 + 1)
    files = list((tmp_path / "steps").glob("*.pt2"))
    assert len(files) == 1

    second = PrecompiledStep(model.run, tmp_path / "steps")
    assert torch.equal(second(2 * x, cache)[0], 2 * x * 3 + 1) and torch.equal(cache[0], 2 * x)
    assert (second.compiled, second.loaded) == (0, 1)

    package = files[0].read_bytes()
    files[0].write_bytes(b"not a step")
    monkeypatch.setattr(precompiled, "compile_package", lambda fn, slots, args, path: path.write_bytes(package))
    third = PrecompiledStep(model.run, tmp_path / "steps")
    with pytest.warns(RuntimeWarning, match="not reused"):
        assert torch.equal(third(x, cache)[0], x * 3 + 1)
    assert third.compiled == 1 and files[0].read_bytes() == package
    monkeypatch.undo()

    with pytest.raises(TypeError, match="in place"):
        PrecompiledStep(model.replace, tmp_path / "steps")(x, [torch.zeros(3)])
    assert torch.equal(model.scale, torch.full((3,), 3.0))      # the weights put back after the trace


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
    with config.patch({"cpp.vec_isa_ok": None}):     # put back after (monkeypatch hides the setting)
        assert precompiled.pin_vec_isa() and config.cpp.vec_isa_ok is True and len(probes) == 1
        record = tmp_path / "inductor" / "vec_isa.json"
        assert json.loads(record.read_text())["picked"] == "avx512"

        config.cpp.vec_isa_ok = None     # a later process: the record, no probe
        assert precompiled.pin_vec_isa() and len(probes) == 1

        config.cpp.vec_isa_ok = None     # the probe picked other than the flags: probe each time
        monkeypatch.setattr(precompiled, "flags_choice", lambda: "avx512 avx512_vnni amx_tile")
        assert not precompiled.pin_vec_isa() and config.cpp.vec_isa_ok is None and len(probes) == 1

        record.write_text(json.dumps({"machine": "another machine", "picked": "avx2"}))
        monkeypatch.setattr(precompiled, "flags_choice", lambda: "avx512")
        assert precompiled.pin_vec_isa() and len(probes) == 2     # probed again, for this machine

        config.cpp.vec_isa_ok = False    # the user's TORCHINDUCTOR_VEC_ISA_OK=0
        assert not precompiled.pin_vec_isa() and config.cpp.vec_isa_ok is False and len(probes) == 2
