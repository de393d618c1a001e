"""Collect an importance matrix: run the model over a text and sum, per input column of every matmul weight, the squares
of the rows fed to it (llama.cpp's `llama-imatrix`, llama.cpp #4861 and #9400 for the file).

`RecordingOps` wraps the model's OpSet: each `qmatmul`, `grouped_qmatmul`, `moe` and `shared_expert` call (`ffn` as
those two) records its inputs (the fused `qmatmul_norm_rope`, `attention_input`, `indexer_query`, `hc_pre_norm`,
`hc_post_pre_norm`, `attention_output` and `compressor_store` those of their products) and then calls the wrapped op
unchanged, so the forward's numerics are the plain model's."""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from backends.registry import is_mlx_device
from ds4.engine import Engine
from ds4.errors import UsageError
from ds4.formats.imatrix import Imatrix
from ops.grouped_qmatmul import group_rows, grouped_qmatmul
from ops.moe import Experts, route
from ops.qmatmul import qmatmul
from ops.quants import QTensor
from ops.rms_norm import rms_norm
from ops.rope_tail import rope_tail

_ROWS = re.compile(r"^(?P<name>.+)\[(?P<start>\d+):(?P<stop>\d+)\]$")  # row views (ops.grouped_qmatmul): "W[a:b]"


class RecordingOps:
    """An OpSet stand-in that records matmul inputs into `imatrix` before calling the wrapped OpSet's op."""

    def __init__(self, inner: Any, imatrix: Imatrix, process_output: bool = False):
        self._inner, self.imatrix, self.process_output = inner, imatrix, process_output

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _rows(self, x: Any) -> torch.Tensor:
        x = self._inner.to_torch(x)
        return x.reshape(-1, x.shape[-1]).to(torch.float32)

    def record(self, w: QTensor, x: Any) -> None:
        """Add the rows of `x` as inputs of weight `w` (a `W[a:b]` row view counts as matrix a/(b-a) of W)."""
        name, matrix = w.name, 0
        m = _ROWS.match(name)
        if m:
            start, stop = int(m["start"]), int(m["stop"])
            name, matrix = m["name"], start // (stop - start)
        if name == "output.weight" and not self.process_output:
            return
        self.imatrix.add(name, self._rows(x), matrix, matrix + 1)

    def qmatmul(self, x: Any, w: QTensor) -> Any:
        self.record(w, x)
        return self._inner.qmatmul(x, w)

    def qmatmul_norm_rope(self, x: Any, w: QTensor, *args: Any) -> Any:
        self.record(w, x)
        return self._inner.qmatmul_norm_rope(x, w, *args)

    def attention_input(self, x: Any, q_a: QTensor, q_a_norm: Any, q_b: QTensor, kv: QTensor, *args: Any) -> Any:
        self.record(q_a, x)
        self.record(kv, x)
        out = self._inner.attention_input(x, q_a, q_a_norm, q_b, kv, *args)
        self.record(q_b, out[0])    # q_b's rows: the query latent
        return out

    def indexer_query(self, q_lat: Any, x: Any, q_b: QTensor, proj: QTensor, *args: Any) -> Any:
        self.record(q_b, q_lat)
        self.record(proj, x)
        return self._inner.indexer_query(q_lat, x, q_b, proj, *args)

    def hc_pre_norm(self, X: Any, fn: QTensor, scale: Any, base: Any, norm: Any, iters: int, hc_eps: float,
                    rms_eps: float) -> Any:
        rows = self._rows(X.reshape(X.shape[0], -1))
        self.record(fn, rms_norm(rows, None, rms_eps))
        return self._inner.hc_pre_norm(X, fn, scale, base, norm, iters, hc_eps, rms_eps)

    def hc_post_pre_norm(self, *args: Any) -> Any:
        out = self._inner.hc_post_pre_norm(*args)
        fn, rms_eps = args[4], args[10]
        self.record(fn, rms_norm(self._rows(out[0].reshape(out[0].shape[0], -1)), None, rms_eps))   # the new state
        return out

    def attention_output(self, o: Any, positions: Any, freqs: Any, wa: QTensor, wb: QTensor, groups: int) -> Any:
        torch_of = self._inner.to_torch
        rotated = rope_tail(torch_of(o), torch_of(positions), torch_of(freqs), inverse=True).reshape(o.shape[0],
                                                                                                      groups, -1)
        for g in range(groups):
            self.record(group_rows(wa, g, groups), rotated[:, g])
        self.record(wb, grouped_qmatmul(rotated, wa))
        return self._inner.attention_output(o, positions, freqs, wa, wb, groups)

    def compressor_store(self, x: Any, kv: QTensor, gate: QTensor, *args: Any) -> Any:
        self.record(kv, x)
        self.record(gate, x)
        return self._inner.compressor_store(x, kv, gate, *args)

    def grouped_qmatmul(self, x: Any, w: QTensor) -> Any:
        groups = x.shape[1]
        for g in range(groups):
            self.record(group_rows(w, g, groups), x[:, g])
        return self._inner.grouped_qmatmul(x, w)

    def shared_expert(self, x: Any, gate: QTensor, up: QTensor, down: QTensor, clamp: float | None) -> Any:
        rows = self._rows(x)
        self.record(gate, rows)
        self.record(up, rows)
        g, u = qmatmul(rows, gate), qmatmul(rows, up)
        if clamp is not None:
            g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
        self.record(down, F.silu(g) * u)
        return self._inner.shared_expert(x, gate, up, down, clamp)

    def ffn(self, x: Any, ids: Any, ex: Experts, gate: QTensor, up: QTensor, down: QTensor, clamp: float | None) -> Any:
        return self.moe(x, ids, ex) + self.shared_expert(x, gate, up, down, clamp)   # the bits of ffn (ops/ffn.py)

    def moe(self, x: Any, ids: Any, ex: Experts) -> Any:
        rows = self._rows(x)
        self.imatrix.add(ex.router.name, rows)
        chosen, _ = route(rows, self._inner.to_torch(ids), ex)
        n_exp = ex.gate.shape[0]
        for e in torch.unique(chosen).tolist():
            r, _ = torch.nonzero(chosen == e, as_tuple=True)
            xe = rows[r]
            g = qmatmul(xe, _expert(ex.gate, e)).clamp(max=ex.clamp)
            u = qmatmul(xe, _expert(ex.up, e)).clamp(-ex.clamp, ex.clamp)
            for w in (ex.gate, ex.up):
                self.imatrix.add(w.name, xe, e, n_exp)
            self.imatrix.add(ex.down.name, F.silu(g) * u, e, n_exp)
        return self._inner.moe(x, ids, ex)


def _expert(w: QTensor, e: int) -> QTensor:
    return QTensor(w.qtype, tuple(w.shape[1:]), w.data[e], w.name)


def collect(engine: Engine, ids: Sequence[int], chunk: int, *, process_output: bool = False,
            dataset: str = "", on_chunk: Callable[[int], None] = lambda i: None) -> Imatrix:
    """The importance matrix of `engine`'s trunk over `ids`, run in independent chunks of `chunk` tokens (a
    shorter tail is dropped, as llama-imatrix does)."""
    n_chunks = len(ids) // chunk
    if chunk < 2 or n_chunks < 1:
        raise UsageError(f"the text has {len(ids)} tokens: too few for one chunk of {chunk} (lower --ctx)")
    model = engine.model
    if is_mlx_device(model.ops.device):
        raise UsageError("imatrix collection runs on torch devices (cpu, cuda); load the model without --backend mlx")
    im = Imatrix(datasets=[dataset] if dataset else [], chunk_size=chunk)
    recorder = RecordingOps(model.ops, im, process_output)
    model.ops = recorder
    try:
        for i in range(n_chunks):
            session = engine.session(ctx=chunk, prefill_chunk=chunk)
            session.forward(list(ids[i * chunk:(i + 1) * chunk]), logit_rows=None, eager=True)
            im.chunk_count = i + 1
            on_chunk(i)
    finally:
        model.ops = recorder._inner
    return im

