"""A session owns all KV state of one sequence: the trunk's per-layer caches and the MTP window.

Every state tensor is indexed by absolute position (raw window and compressor inputs in rings with
`prefill_chunk` slots of slack, compressed rows append-only), so a later forward never overwrites a row
an earlier position still needs. Rolling back is therefore only a change of position: `truncate(n)`
and `restore(snapshot)` are O(1) and exact, as long as no more than `prefill_chunk` positions were
written past the rollback point (the speculative decoder verifies far fewer).

MTP rows are keyed by the position j of the token they consume (t_j), predicting t_{j+1}; the HC state
paired with t_j is the trunk's H_{j-1} ("official") or H_j ("ds4"), see models/mtp.py. Every trunk
forward catches the MTP cache up on its rows (no LM head) unless `mtp_paused`; `mtp_draft` then drafts
recursively.
"""
from __future__ import annotations

import itertools
import math
import numbers
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ds4 import session_file
from ds4.cuda_graphs import StepGraphs
from ds4.errors import NonFiniteError, SessionFileError, UsageError
from models.deepseek_v4 import DeepseekV4
from models.mtp import MTPHead

COMPILED_ROWS = 16  # compiled (or graphed) sessions make a step per row count up to this (decode, verify, MTP)
KEPT_STATES = 32  # trunk/MTP output states kept for the latest positions, so truncate() can resume MTP


@dataclass(frozen=True)
class Snapshot:
    """What `restore` needs: the position and the two [S, D] states the MTP continues from."""

    pos: int
    mtp_from: int
    trunk_tail: torch.Tensor | None
    mtp_tail: torch.Tensor | None
    owner: int = -1  # the id of the session that took it (restore refuses another session's snapshot)


_session_ids = itertools.count()


def check_size(name: str, value, lo: int = 1) -> int:
    """An int argument (not a bool or float) >= lo, else UsageError naming it."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise UsageError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < lo:
        raise UsageError(f"{name} must be >= {lo}, got {value}")
    return int(value)


def available_bytes(device: str) -> int | None:
    """Memory free for new arrays on `device` (host: MemAvailable), or None when unknown."""
    try:
        if str(device).startswith("cuda"):
            return torch.cuda.mem_get_info(torch.device(device))[0]
        if str(device) == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None
    return None


def gib(n: int) -> str:
    """Bytes as a short human size."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def state_bytes(model: DeepseekV4, ctx: int, prefill_chunk: int, mtp: MTPHead | None = None) -> int:
    """Bytes of KV state a session of `ctx` tokens fed `prefill_chunk` at a time allocates."""
    chunk = min(prefill_chunk, ctx)
    return sum(model.cache_bytes(L.ratio, ctx, chunk) for L in model.layers) + \
        (model.cache_bytes(0, ctx, chunk) if mtp else 0)


def check_finite(logits: torch.Tensor, positions: list[int], what: str) -> None:
    """Read back after a forward (never inside one): NonFiniteError naming the first position whose row of
    `logits` [rows, V] holds NaN or Inf."""
    if logits.is_meta or math.isfinite(logits.sum().item()):  # meta: no values; a finite sum has no NaN/Inf
        return
    finite = torch.isfinite(logits).all(-1)
    if not bool(finite.all()):
        pos = positions[int((~finite).nonzero()[0, 0])]
        raise NonFiniteError(f"non-finite {what} at position {pos}: the model produced NaN/Inf "
                             "(damaged weights, or values beyond float range)")


def check_cuda_graphs(device: str, compile: bool) -> None:
    """UsageError unless CUDA graphs can record steps on `device`: a CUDA device, without --compile."""
    if not str(device).startswith("cuda"):
        raise UsageError(f"--cuda-graphs records CUDA kernels, but the model is on {device!r}; use --device cuda "
                         "on a machine with a CUDA GPU (on a CPU, --compile speeds up steps)")
    if compile:
        raise UsageError("--cuda-graphs and --compile are exclusive (--compile is for the CPU)")


def step_graphs(model: DeepseekV4, mtp: MTPHead | None, compile: bool = False,
                capture: bool = True) -> dict[str, StepGraphs]:
    """CUDA graphs for a session's trunk and MTP steps (UsageError where they cannot record); `capture=False`
    keeps the static buffers without recording, which is what a CPU can check."""
    if capture:
        check_cuda_graphs(model.ops.device, compile)
    graphs = {"trunk": StepGraphs(model.run, state_arg=2, capture=capture)}
    if mtp:
        graphs["mtp"] = StepGraphs(mtp.run, state_arg=3, capture=capture)
    return graphs


class Session:
    """KV state plus prefill / decode / batched forward / MTP drafting / rollback for one sequence."""

    def __init__(self, model: DeepseekV4, ctx: int, prefill_chunk: int = 2048, mtp: MTPHead | None = None,
                 compile: bool = False, model_id: str | None = None, cuda_graphs: bool = False):
        ctx = check_size("ctx (--ctx)", ctx)
        prefill_chunk = check_size("prefill_chunk (--prefill-chunk)", prefill_chunk)
        prefill_chunk = min(prefill_chunk, ctx)  # a longer chunk could never be filled
        self.model, self.mtp, self.ctx, self.prefill_chunk = model, mtp, ctx, prefill_chunk
        self.model_id = model_id  # names the model file in saved sessions (Engine.model_id), so loads can check it
        self._id = next(_session_ids)
        need, free = state_bytes(model, ctx, prefill_chunk, mtp), available_bytes(model.ops.device)
        if free is not None and need > free:
            per_k = state_bytes(model, ctx + 1024, prefill_chunk, mtp) - need
            raise UsageError(f"a context of {ctx} tokens (prefill chunk {prefill_chunk}) needs {gib(need)} of KV "
                             f"state (about {gib(per_k)} per 1024 tokens), but only {gib(free)} is free on "
                             f"{model.ops.device}; lower --ctx / --prefill-chunk")
        try:
            self.caches = model.new_caches(ctx, prefill_chunk)
            self.mtp_cache = mtp.new_cache(ctx, prefill_chunk) if mtp else None
        except (MemoryError, torch.OutOfMemoryError) as e:
            raise UsageError(f"a context of {ctx} tokens needs {gib(need)} of KV state, which could not be "
                             f"allocated on {model.ops.device} ({type(e).__name__}); lower --ctx") from None
        self.tokens: list[int] = []
        self.mtp_from = 0        # MTP cache rows are valid for positions [mtp_from, pos)
        self.mtp_before_pause: tuple[int, int] | None = None  # [from, to): the rows written before the last pause
        self.high_water = 0      # highest position ever written + 1 (bounds what rollback may reach)
        self.n_drafted = 0       # MTP draft rows written past pos since the last forward
        self.recent: dict[str, tuple[int, torch.Tensor] | None] = {"trunk": None, "mtp": None}  # last rows
        self.recent_buffers: dict[str, torch.Tensor] = {}   # what `recent`'s torch rows are views of (_appended)
        self.trunk_tail: torch.Tensor | None = None  # H_{pos-1}
        self.mtp_tail: torch.Tensor | None = None    # MTP output state of row pos-1
        self.logits_at: dict[int, torch.Tensor] = {}  # logits rows of the last forward, by position
        self.counters: Counter[str] = Counter()  # forward_rows, lm_head_rows, mtp_rows, mtp_lm_head_rows
        self.mtp_paused = False  # True: forwards skip the MTP catch-up (no draft will read it)
        self.on_chunk: Callable[[int], None] | None = None  # called with each forward chunk's size (progress)
        self.compiled = compile  # decode, verify and MTP rows (M <= COMPILED_ROWS) run the compiled step
        if compile:
            model.compiled_step()
            if mtp:
                mtp.compiled_step()
        self.graphs: dict[str, StepGraphs] = {}  # "trunk", "mtp": recorded decode/verify steps (--cuda-graphs)
        if cuda_graphs:
            self.graphs = step_graphs(model, mtp, compile)

    @classmethod
    def load(cls, path, model: DeepseekV4, mtp: MTPHead | None = None, ctx: int | None = None,
             compile: bool = False, model_id: str | None = None, prefill_chunk: int | None = None) -> Session:
        """A session continuing exactly where the one saved to `path` (`save`) stopped; `ctx` and `prefill_chunk`
        default to the saved ones. A damaged file or one from another model, layout, prefill chunk or a context
        too small for it raises SessionFileError."""
        saved = session_file.read(path)
        ctx = saved.header["ctx"] if ctx is None else check_size("ctx (--ctx)", ctx)
        chunk = saved.header["prefill_chunk"] if prefill_chunk is None else check_size("prefill_chunk", prefill_chunk)
        chunk = min(chunk, ctx)
        saved.check(model, mtp, ctx, chunk, model_id, str(path))
        session = cls(model, ctx, chunk, mtp, compile, model_id)
        try:
            saved.apply(session)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:  # a well-formed file holding the wrong parts
            raise SessionFileError(f"{path}: malformed session file ({type(e).__name__}: {e})") from None
        return session

    def save(self, path) -> None:
        """Write the whole state to `path` (atomically) so that `Session.load` continues it bit for bit."""
        session_file.save(self, path, self.model_id)

    @property
    def last_logits(self) -> torch.Tensor | None:
        """Logits [V] of the last position when the forward that wrote it computed them, else None."""
        return self.logits_at.get(self.pos - 1)

    def batch_invariant(self) -> bool:
        """Whether a forward of M <= SMALL_M rows gives each row the one-row forward's result bit for bit:
        every op resolves to a batch-invariant implementation and no compiled step runs (inductor
        generates different kernels per row count; a CUDA graph replays the eager kernels, so it keeps it)."""
        return self.model.ops.batch_invariant() and not self.compiled

    @property
    def pos(self) -> int:
        """Number of tokens in the sequence (the next token's position)."""
        return len(self.tokens)

    # ---- forward --------------------------------------------------------------------------------

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Feed a prompt in chunks of `prefill_chunk` (never through the compiled step); logits [V] of its
        last row only."""
        ids = self._check_ids(ids)
        if len(ids) == 0:
            raise UsageError("prefill needs at least one token")
        mtp_min = self.pos + len(ids) - self.model.args.window  # older MTP rows are never attended
        return self.forward(ids, [len(ids) - 1], mtp_min=mtp_min, eager=True)[0]

    def decode(self, token: int) -> torch.Tensor:
        """Feed one token; its logits [V]."""
        return self._forward_rows(self._check_ids([token]), [0], 0, False)[0]

    def forward(self, ids: Sequence[int], logit_rows: Sequence[int] | str | None = "all",
                mtp_min: int = 0, eager: bool = False) -> torch.Tensor | None:
        """Feed `ids` (e.g. a verify batch [first, d1..dk]) and return logits [len(rows), V] of
        `logit_rows` (indices into ids, "all", "last", or None for no LM head). The MTP cache is caught
        up on rows at positions >= mtp_min. A compiled session runs chunks of at most COMPILED_ROWS rows
        through the compiled step unless `eager`."""
        ids = self._check_ids(ids)
        n = len(ids)
        if logit_rows is None or isinstance(logit_rows, str):
            named = {"all": list(range(n)), "last": [n - 1], None: []}
            if logit_rows not in named:
                raise UsageError(f"logit_rows must be 'all', 'last', None or row indices, got {logit_rows!r}")
            rows = named[logit_rows]
        else:
            rows = list(logit_rows)
            if any(not isinstance(r, numbers.Integral) or isinstance(r, bool) or not 0 <= r < n for r in rows):
                raise UsageError(f"logit_rows must be indices into the {n} ids, got {rows}")
        return self._forward_rows(ids, rows, mtp_min, eager)

    def _forward_rows(self, ids: list[int], rows: list[int], mtp_min: int, eager: bool) -> torch.Tensor | None:
        """`forward` of checked ids and logit row indices."""
        n = len(ids)
        if self.pos + n > self.ctx:
            raise UsageError(f"{self.pos + n} tokens do not fit the context of {self.ctx} (--ctx)")
        out = []
        for s in range(0, n, self.prefill_chunk):
            chunk = ids[s:s + self.prefill_chunk]
            local = [r - s for r in rows if s <= r < s + len(chunk)]
            out.append(self._forward_chunk(chunk, local or None, mtp_min, eager))
            if self.on_chunk:
                self.on_chunk(len(chunk))
        logits = [x for x in out if x is not None]
        if not logits:
            self.logits_at = {}
            return None
        logits = self.model.ops.to_torch(logits[0] if len(logits) == 1 else self.model.ops.cat(logits))
        positions = [self.pos - n + r for r in rows]
        check_finite(logits, positions, "logits")
        self.logits_at = {positions[i]: logits[i] for i in range(max(0, len(rows) - KEPT_STATES), len(rows))}
        return logits

    def _check_ids(self, ids) -> list[int]:
        """`ids` as a list of python ints in the vocabulary, else UsageError."""
        if type(ids) is list and len(ids) == 1 and type(ids[0]) is int and 0 <= ids[0] < self.model.args.vocab_size:
            return [ids[0]]     # a decode's token: what the checks below give, without their generic tests
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
            raise UsageError(f"token ids must be a sequence of integers, got {type(ids).__name__}")
        ids = list(ids)
        if any(not isinstance(i, numbers.Integral) or isinstance(i, bool) for i in ids):
            raise UsageError("token ids must be integers")
        if any(not 0 <= i < self.model.args.vocab_size for i in ids):
            raise UsageError(f"token ids must be in [0, {self.model.args.vocab_size})")
        return [int(i) for i in ids]

    def step_for(self, rows: int, eager: bool = False) -> str:
        """How a forward of `rows` rows runs: "eager", "compiled" (see DeepseekV4.forward) or "graph" (a CUDA
        graph of the fixed-plan step)."""
        if eager or rows > COMPILED_ROWS:
            return "eager"
        return "compiled" if self.compiled else "graph" if self.graphs else "eager"

    def _step_args(self, kind: str, step: str) -> dict:
        """The model forward's `step` and `runner` for a session step (a graph runs the fixed plan)."""
        return {"step": "fixed", "runner": self.graphs[kind]} if step == "graph" else {"step": step}

    def _forward_chunk(self, ids: list[int], logit_rows: list[int] | None, mtp_min: int, eager: bool):
        """One model forward of at most prefill_chunk tokens, then the MTP catch-up."""
        start, M = self.pos, len(ids)
        step = self.step_for(M, eager)
        X, logits = self.model.forward(ids, start, self.caches, logit_rows, **self._step_args("trunk", step))
        self.counters["forward_rows"] += M
        self.counters["compiled_rows"] += M if step == "compiled" else 0
        self.counters["graph_rows"] += M if step == "graph" else 0
        self.counters["lm_head_rows"] += 0 if logit_rows is None else len(logit_rows)
        previous_tail = self.trunk_tail
        self.tokens.extend(ids)
        self.high_water = max(self.high_water, self.pos)
        self.trunk_tail, self.n_drafted = X[-1], 0
        self._keep_recent("trunk", start, X)
        if self.mtp and not self.mtp_paused:
            self._mtp_catch_up(ids, X, previous_tail, start, mtp_min, eager)
        elif self.mtp:  # rows not written: the MTP window restarts after them
            if self.mtp_from < start:
                self.mtp_before_pause = (self.mtp_from, start)
            self.mtp_from = self.pos
        return logits

    def _mtp_catch_up(self, ids: list[int], X, previous_tail, start: int, mtp_min: int, eager: bool) -> None:
        """Write the MTP rows of the tokens just fed (pairing per ModelArgs.mtp_pairing), no LM head."""
        if self.model.args.mtp_pairing == "official":  # row j: (H_{j-1}, t_j)
            states = X[:-1] if previous_tail is None else self.model.ops.cat([previous_tail[None], X[:-1]])
            first = start if previous_tail is not None else start + 1
        else:  # "ds4", row j: (H_j, t_j)
            states, first = X, start
        j0 = max(first, mtp_min)
        keep = j0 - first
        if j0 >= self.pos:  # no row to write: the MTP window restarts after these tokens
            self.mtp_from = self.pos
            return
        if j0 != start or start < self.mtp_from:
            self.mtp_from = j0
        rows = ids[j0 - start:]
        Y, _ = self.mtp.forward(states[keep:], rows, j0, self.mtp_cache, self.mtp_from,
                                **self._step_args("mtp", self.step_for(len(rows), eager)))
        self.counters["mtp_rows"] += Y.shape[0]
        self.mtp_tail = Y[-1]
        self._keep_recent("mtp", j0, Y)

    def _keep_recent(self, kind: str, start: int, rows: torch.Tensor) -> None:
        """Remember the output states of the last KEPT_STATES positions (contiguous history only)."""
        old = self.recent[kind]
        if old is not None and old[0] <= start <= old[0] + old[1].shape[0]:
            kept = old[1] if start == old[0] + old[1].shape[0] else old[1][:start - old[0]]  # a decode keeps all
            rows = self._appended(kind, kept, rows)
            start = old[0]
        drop = max(0, rows.shape[0] - KEPT_STATES)
        self.recent[kind] = (start + drop, rows[drop:])

    def _appended(self, kind: str, kept: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`kept` then `rows`: torch rows are written after `kept` in a buffer of 2·KEPT_STATES rows that `kept` is
        a view of (its `_base`; a decode step copies its own row, not the 32 kept ones: ~0.5 ms of a full-width
        step), a new buffer when that one is full; other arrays are concatenated."""
        if not isinstance(rows, torch.Tensor) or not isinstance(kept, torch.Tensor):
            return self.model.ops.cat([kept, rows])
        buf, n = self.recent_buffers.get(kind), rows.shape[0]
        if buf is not None and kept._base is buf and kept.shape[1:] == buf.shape[1:] and kept.dtype == buf.dtype:
            end = (kept.storage_offset() - buf.storage_offset()) // buf.stride(0) + kept.shape[0]  # buf: contiguous
            if end + n <= buf.shape[0]:
                buf[end:end + n] = rows
                return buf[end - kept.shape[0]:end + n]
        buf = torch.empty((max(2 * KEPT_STATES, kept.shape[0] + n), *rows.shape[1:]), dtype=rows.dtype,
                          device=rows.device)
        buf[:kept.shape[0]] = kept
        buf[kept.shape[0]:kept.shape[0] + n] = rows
        self.recent_buffers[kind] = buf
        return buf[:kept.shape[0] + n]

    # ---- MTP drafting -----------------------------------------------------------------------------

    def mtp_first_state(self) -> torch.Tensor:
        """The [S, D] state the first draft after the last forward starts from: H_{pos-1} ("official")
        or the MTP output state of row pos-1 ("ds4")."""
        self._need_mtp()
        state = self.trunk_tail if self.model.args.mtp_pairing == "official" else self.mtp_tail
        if state is None:
            raise UsageError("no MTP state yet: feed at least one token first")
        return state

    def mtp_draft(self, token: int, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step consuming `token` (the next token to verify, then each draft in turn) with
        `state` (default `mtp_first_state()`; then the state this method returned). Returns
        (logits [V] for the token after `token`, new state [S, D]). Writes a speculative MTP row that
        the next forward or rollback discards."""
        self._need_mtp()
        token = self._check_ids([token])[0]
        state = self.mtp_first_state() if state is None else state
        j = self.pos + self.n_drafted
        if j >= self.ctx:
            raise UsageError(f"MTP draft at position {j} exceeds the context of {self.ctx}")
        if self.n_drafted >= self.prefill_chunk:
            raise UsageError(f"at most prefill_chunk ({self.prefill_chunk}) drafts between forwards")
        Y, logits = self.mtp.forward(state[None], [token], j, self.mtp_cache, self.mtp_from, [0],
                                     **self._step_args("mtp", self.step_for(1)))
        self.n_drafted += 1
        self.high_water = max(self.high_water, j + 1)
        self.counters["mtp_rows"] += 1
        self.counters["mtp_lm_head_rows"] += 1
        logits = self.model.ops.to_torch(logits)
        check_finite(logits, [j], "MTP draft logits")
        return logits[0], Y[0]

    def _need_mtp(self) -> None:
        if self.mtp is None:
            raise UsageError("this session has no MTP head (load one with --mtp)")

    # ---- rollback ---------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """O(1) record of the current state for an exact `restore`."""
        return Snapshot(self.pos, self.mtp_from, self.trunk_tail, self.mtp_tail, self._id)

    def restore(self, snap: Snapshot) -> None:
        """Return exactly to `snap` (taken earlier on this sequence, at most prefill_chunk positions back)."""
        if not isinstance(snap, Snapshot) or snap.owner != self._id:
            raise UsageError("restore() needs a snapshot taken from this session (snapshot())")
        self._check_rollback(snap.pos)
        del self.tokens[snap.pos:]
        self.mtp_from, self.trunk_tail, self.mtp_tail, self.n_drafted = snap.mtp_from, snap.trunk_tail, snap.mtp_tail, 0
        self.high_water = max(self.high_water, self.pos)

    def truncate(self, n_tokens: int) -> None:
        """Keep only the first `n_tokens` tokens (the MTP needs the states of position n_tokens-1,
        kept for the last KEPT_STATES positions; further back use snapshot()/restore())."""
        self._check_rollback(n_tokens)
        if n_tokens < self.pos:
            self.trunk_tail = self._row("trunk", n_tokens - 1)
            self.mtp_tail = self._row("mtp", n_tokens - 1)
            mtp_from = min(self.mtp_from, n_tokens)  # rows paused past n_tokens: as a cold start, when intact
            if self.mtp_before_pause and self.mtp_before_pause[0] <= n_tokens <= self.mtp_before_pause[1]:
                mtp_from = self.mtp_before_pause[0]
            mtp_row_written = n_tokens - 1 >= mtp_from  # else the MTP window restarts at n_tokens
            if self.mtp and n_tokens > 0 and (self.trunk_tail is None or self.mtp_tail is None and mtp_row_written):
                raise UsageError(f"cannot truncate to {n_tokens} tokens: the states at position "
                                 f"{n_tokens - 1} are gone; use snapshot()/restore()")
            del self.tokens[n_tokens:]
            self.mtp_from = mtp_from
        self.n_drafted = 0

    def _row(self, kind: str, p: int) -> torch.Tensor | None:
        """The kept output state of position p, if still kept."""
        kept = self.recent[kind]
        return kept[1][p - kept[0]] if kept is not None and kept[0] <= p < kept[0] + kept[1].shape[0] else None

    def _check_rollback(self, n: int) -> None:
        check_size("the rollback point", n, 0)
        if not 0 <= n <= self.pos:
            raise UsageError(f"cannot roll back to {n} tokens: the sequence has {self.pos}")
        if self.high_water - n > self.prefill_chunk:
            raise UsageError(f"cannot roll back to {n} tokens: positions up to {self.high_water} were "
                             f"written, more than prefill_chunk ({self.prefill_chunk}) past it")

    # ---- inspection -------------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every logical state tensor (rows a future token may read), by name, as torch tensors for equality
        tests (an MLX session's are converted)."""
        pos, W, ops = self.pos, self.model.args.window, self.model.ops

        def arange(lo: int, hi: int):
            return ops.array(list(range(lo, hi)))

        p = arange(max(0, pos - W), pos)
        out = {"pos": torch.tensor([pos])}
        for i, c in enumerate(self.caches):
            out[f"blk.{i}.raw"] = c.rows[p % c.raw_cap]
            r = c.ratio
            if r:
                out[f"blk.{i}.comp"] = c.rows[c.raw_cap:c.raw_cap + pos // r]
                pending = arange(max(0, pos // r * r - (r if r == 4 else 0)), pos) % c.comp_cap
                out[f"blk.{i}.compressor_kv"] = c.comp_kv[pending]
                out[f"blk.{i}.compressor_score"] = c.comp_score[pending]
            if r == 4:
                out[f"blk.{i}.index_comp"] = c.index_rows[:pos // r]
                out[f"blk.{i}.index_kv"] = c.index_kv[pending]
                out[f"blk.{i}.index_score"] = c.index_score[pending]
        if self.mtp:
            mp = arange(max(self.mtp_from, pos - W), pos)
            out["mtp.raw"] = self.mtp_cache.rows[mp % self.mtp_cache.raw_cap]
            out["mtp.first_state"] = self.mtp_first_state() if pos else torch.empty(0)
        return {name: ops.to_torch(x) for name, x in out.items()}
