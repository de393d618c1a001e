"""Benchmark suites behind `python scripts/bench.py SUITE` (printed as tables or CSV, the reference beside each
figure). A suite is one module here with `add_args(parser, on_gpu)` and `rows(args, device) -> list[dict]`;
adding one is a new module and one line in SUITES. The top of the tree with the server: nothing imports a
suite but scripts/bench.py and the tests."""
from __future__ import annotations

import importlib
from types import ModuleType

SUITES = {  # suite name -> module in ds4/bench/
    "qmatmul": "qmatmul",
    "moe": "kernels",
    "indexer": "kernels",
    "argmax": "kernels",
    "model": "model",
    "spec": "spec",
    "traffic": "traffic",
    "compile": "compile",
    "cpu": "cpu",
    "gpu": "gpu",
    "kvdisk": "kvdisk",
    "quants": "quants",
    "grammar": "grammar",
    "ranks": "ranks",
    "amx-rows": "amx_rows",
}


def suite(name: str) -> ModuleType:
    """The module of suite `name` (imported on demand: the cpu suite needs transformers)."""
    return importlib.import_module(f"ds4.bench.{SUITES[name]}")
