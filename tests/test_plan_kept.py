"""The position plan with its ring arrays kept and sliced (models/deepseek_v4.py: `kept_array`, `ring_rows`,
`residues`) equals the plan built afresh from Python lists, for every start around the ring and block boundaries
(ratios 4 and 16), row counts 1..6 and 20, late MTP windows and fixed plans."""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from backends.registry import OpSet
from models import deepseek_v4
from models.deepseek_v4 import CompressorPlan, LayerCache, Plan, logit_index, plan_positions


def listed_compressor(ops, pos: range, ratio: int, cap: int, scratch: int | None = None) -> CompressorPlan:
    """The compressor plan as it was built before the arrays were kept: every array from Python lists."""
    slots, ape = ops.array([p % cap for p in pos]), ops.array([p % ratio for p in pos])
    if scratch is None:
        blocks = [(p + 1) // ratio - 1 for p in pos if (p + 1) % ratio == 0]
        if not blocks:
            return CompressorPlan(slots, ape)
        targets = blocks
    else:
        blocks = [p // ratio for p in pos]
        targets = [b if (p + 1) % ratio == 0 else scratch for p, b in zip(pos, blocks, strict=True)]
    tokens = [[b * ratio + i for i in range(ratio)] for b in blocks]
    prev = [[t - ratio for t in row] for row in tokens]
    lanes = None
    if ratio == 4 and scratch is None and all(t >= 0 for row in prev for t in row):
        lanes = ops.array([[2 * (t % cap) for t in p] + [2 * (t % cap) + 1 for t in row] for p, row in zip(prev, tokens,
                                                                                                         strict=True)])
    return CompressorPlan(slots, ape, ops.array(targets), ops.array([b * ratio for b in blocks]),
                          ops.array([[t % cap for t in row] for row in tokens]),
                          ops.array([[t % cap for t in row] for row in prev]),
                          ops.array([[[t >= 0] for t in row] for row in prev], "bool"), lanes)


def listed_plan(ops, start: int, M: int, window: int, cache: LayerCache, valid_from: int = 0,
                fixed: bool = False) -> Plan:
    """plan_positions as it was before the arrays were kept."""
    pos = range(start, start + M)
    raw = [[(p - b) % cache.raw_cap if p - b >= valid_from else -1 for b in range(window)] for p in pos]
    n_raw = (window,) * M if fixed else tuple(max(0, min(window, p - valid_from + 1)) for p in pos)
    plan = Plan(ops.array(list(pos)), ops.array([p % cache.raw_cap for p in pos]), ops.array(raw), n_raw)
    if not cache.ratio:
        return plan
    ratio, capacity = cache.ratio, cache.comp_capacity()
    visible = tuple((p + 1) // ratio for p in pos)
    width = capacity if fixed else max(visible)
    comp = None
    if ratio != 4:
        comp = ops.array([[cache.raw_cap + c if c < v else -1 for c in range(width)] for v in visible])
    return dataclasses.replace(plan, visible=(width,) * M if fixed else visible, visible_rows=ops.array(list(visible)),
                               comp_rows=comp,
                               compressor=listed_compressor(ops, pos, ratio, cache.comp_cap,
                                                            capacity if fixed else None))


def same_plan(a, b) -> bool:
    """Equal fields: arrays by value, dtype and shape; records field by field."""
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same_plan(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def cache(ratio: int, window: int = 8, chunk: int = 5, ctx: int = 100) -> LayerCache:
    n_comp = ctx // ratio + 1 if ratio else 0
    c = LayerCache(ratio, window + chunk, torch.zeros(window + chunk + n_comp, 4))
    c.comp_cap = 2 * ratio + chunk if ratio else 0
    return c


@pytest.mark.parametrize("ratio", (0, 4, 16))
def test_kept_plan_is_the_listed_plan(ratio, monkeypatch):
    """Starts 0..70 (the 13-slot raw ring wraps five times, ratio-4 and -16 blocks complete), M = 1..6 and 20 (above
    SMALL_ROWS: built afresh), MTP windows starting at 0, 3 and 17, eager and fixed; with a store of 64 arrays, so
    it is also cleared and refilled on the way."""
    monkeypatch.setattr(deepseek_v4, "KEPT_ARRAYS", 64)
    ops, c = OpSet("torch"), cache(ratio)
    for start in range(71):
        for M in (1, 2, 3, 6, 20):
            for valid_from in (0, 3, 17):
                for fixed in (False, True):
                    if start + M > 100 or valid_from > start:
                        continue
                    got = plan_positions(ops, start, M, 8, c, valid_from, fixed)
                    want = listed_plan(ops, start, M, 8, c, valid_from, fixed)
                    assert same_plan(got, want), (start, M, valid_from, fixed)
    assert 0 < len(deepseek_v4._KEPT[id(ops)]) <= 64
    assert torch.equal(logit_index(ops, [0, 2]), torch.tensor([0, 2])) and logit_index(ops, None) is None
    key = id(ops)
    del ops
    gc.collect()
    assert key not in deepseek_v4._KEPT     # the OpSet's arrays go with it
