"""`int_range` (models/deepseek_v4.py): a decode's positions, token id and completed block from slices of kept arrays
equal the arrays built from lists, across the kept blocks' edges (a block of 8 values here), above SMALL_ROWS and
below 0; the plan of every start around those edges is the listed plan (tests/test_plan_kept.py's oracle)."""
from __future__ import annotations

import torch

from backends.registry import OpSet
from models import deepseek_v4
from models.deepseek_v4 import int_range, plan_positions
from tests.test_plan_kept import cache, listed_plan, same_plan


def test_int_range_is_the_listed_range(monkeypatch):
    monkeypatch.setattr(deepseek_v4, "INT_BLOCK", 8)
    ops = OpSet("torch")
    for start in (-3, 0, 5, 7, 8, 15, 16, 30):
        for M in (1, 2, 6, 16, 17):
            got = int_range(ops, start, M)
            assert got.dtype == torch.int64 and torch.equal(got, torch.arange(start, start + M)), (start, M)


def test_plans_across_kept_blocks_are_the_listed_plans(monkeypatch):
    monkeypatch.setattr(deepseek_v4, "INT_BLOCK", 8)
    ops = OpSet("torch")
    for ratio in (0, 4):
        c = cache(ratio)
        for start in range(0, 40):
            for M in (1, 3):
                assert same_plan(plan_positions(ops, start, M, 8, c), listed_plan(ops, start, M, 8, c)), (ratio, start)
