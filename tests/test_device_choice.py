"""Where the tests run (tests/devices.py): the choice DS4_TEST_DEVICE and the machine make, the one clear error
when CUDA is asked for and cannot be had, and the mode that places `on_device` tests' tensors."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.devices import DEVICE, FactoriesOn, choose_device

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("env,gpu,want", [
    ({}, False, ("cpu", None)),
    ({}, True, ("cuda", None)),
    ({"TRITON_INTERPRET": "1"}, True, ("cpu", None)),
    ({"DS4_TEST_DEVICE": "cpu"}, True, ("cpu", None)),
    ({"DS4_TEST_DEVICE": "CUDA"}, True, ("cuda", None)),
])
def test_the_device_follows_the_environment_and_the_machine(monkeypatch, env, gpu, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert choose_device(env) == want


@pytest.mark.parametrize("env,gpu,message", [
    ({"DS4_TEST_DEVICE": "cuda"}, False, "DS4_TEST_DEVICE=cuda, but torch sees no CUDA GPU"),
    ({"DS4_TEST_DEVICE": "cuda", "TRITON_INTERPRET": "1"}, True, "unset TRITON_INTERPRET"),
    ({"DS4_TEST_DEVICE": "gpu"}, True, "DS4_TEST_DEVICE='gpu': use one of cpu, cuda"),
])
def test_a_device_that_cannot_be_had_is_named(monkeypatch, env, gpu, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    device, error = choose_device(env)
    assert device == "cpu" and message in error


def test_cuda_without_a_gpu_stops_pytest_with_one_message():
    """No test runs, no pile of failures: pytest's usage error (exit status 4) with the reason, once."""
    env = {**os.environ, "DS4_TEST_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton_sims.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 4, out
    assert out.count("DS4_TEST_DEVICE=cuda, but torch sees no CUDA GPU") == 1
    assert "passed" not in out and "failed" not in out


def test_factory_calls_land_on_the_device_with_the_cpu_draws():
    """`meta` stands in for CUDA: seeded CPU draws are moved, other factories placed, explicit devices kept."""
    want = torch.randn(3, generator=torch.Generator().manual_seed(0))
    with FactoriesOn("meta"):
        drawn = torch.randn(3, generator=torch.Generator().manual_seed(0))
        assert drawn.device.type == torch.zeros(2).device.type == torch.tensor([1]).device.type == "meta"
        assert torch.arange(4).device.type == "meta" and torch.zeros(2, device="cpu").device.type == "cpu"
    with FactoriesOn("cpu"):
        assert torch.equal(torch.randn(3, generator=torch.Generator().manual_seed(0)), want)


@pytest.mark.on_device
def test_on_device_tests_make_their_tensors_on_the_test_device(device):
    assert device == DEVICE and torch.zeros(1).device.type == DEVICE
