"""CUDA graphs of decode and verify steps (`--cuda-graphs`, `ds4.load(cuda_graphs=True)`).

A session's decode, verify and MTP forwards of at most 16 rows run on the fixed-capacity plan (the one the
CPU `--compile` path uses, docs/cpu.md): its shapes and host counts depend only on the row count, so each
(row count, LM-head row count) is one step whose launches can be recorded once and replayed. The first call
of a step runs it eagerly on static copies of its inputs (token ids, the plan's index arrays, LM-head rows;
this also JIT-compiles every kernel), then records it with `torch.cuda.CUDAGraph` without running it
again; later calls copy their inputs into those static buffers and replay. The caches are the session's own
tensors, recorded by address, so graphs belong to one session. A step run twice on the same inputs writes
the same cache rows, which is why the eager first call and the replays agree bit for bit.

Without a GPU (`capture=False`) the same static buffers are filled and `run` is called on them instead of a
replay: the tests check everything but the recording itself there.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor inside `value` (dataclasses, dicts, lists and tuples walked in order)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in tensors(getattr(value, f.name))]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensors(v)]
    return []


def layout(value: Any) -> Any:
    """A hashable description of `value`: tensors by shape and dtype, host values as they are (a replay needs
    all of it unchanged)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if dataclasses.is_dataclass(value):
        return (type(value).__name__, *((f.name, layout(getattr(value, f.name))) for f in dataclasses.fields(value)))
    if isinstance(value, dict):
        return ("dict", *((k, layout(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, *(layout(v) for v in value))
    return value


def cloned(value: Any) -> Any:
    """`value` with every tensor inside it copied (the structure rebuilt around the copies)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: cloned(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {k: cloned(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(cloned(v) for v in value)
    return value


@dataclass
class Step:
    """One recorded step: its static input buffers, the arguments made of them, the graph and its outputs."""

    inputs: list[torch.Tensor]
    args: tuple
    graph: torch.cuda.CUDAGraph | None = None
    outputs: Any = None


class StepGraphs:
    """The recorded steps of one forward function (`DeepseekV4.run`, `MTPHead.run`) on one session's state.

    `state_arg` is the position of the argument holding the caches: passed as is, never copied. Every other
    argument is copied into the step's static buffers on each call."""

    def __init__(self, run: Callable, state_arg: int, capture: bool = True):
        self.run, self.state_arg, self.capture = run, state_arg, capture
        self.steps: dict[Any, Step] = {}
        self.replays = 0
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for all steps

    def __call__(self, *args):
        """The outputs of `run(*args)`, from a replay of the recorded step (recorded on first use)."""
        moving = [a for i, a in enumerate(args) if i != self.state_arg]
        key = layout(moving)
        step = self.steps.get(key)
        if step is None:
            static = tuple(a if i == self.state_arg else cloned(a) for i, a in enumerate(args))
            step = Step(tensors([a for i, a in enumerate(static) if i != self.state_arg]), static)
            self.steps[key] = step
            return self._record(step)
        for buffer, value in zip(step.inputs, tensors(moving), strict=True):
            buffer.copy_(value)
        self.replays += 1
        if step.graph is None:
            return cloned(self.run(*step.args))
        step.graph.replay()
        return cloned(step.outputs)  # the next replay of any step may reuse the pool's memory

    def _record(self, step: Step):
        """Run the step eagerly on its static buffers (its result, and every kernel compiled), then record it."""
        if not self.capture:
            return cloned(self.run(*step.args))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            result = cloned(self.run(*step.args))
        torch.cuda.current_stream().wait_stream(side)
        step.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(step.graph, pool=self.pool):
            step.outputs = self.run(*step.args)
        return result
