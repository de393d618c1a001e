"""The public API: `ds4.load(...)` returns an Engine that tokenizes, generates and opens sessions."""
from __future__ import annotations

import functools
import hashlib
import numbers
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from backends.registry import OpSet
from ds4 import distributed
from ds4.chat import chat_ids
from ds4.errors import BackendUnavailable, ModelFileError, UsageError
from ds4.formats import gguf, layouts
from ds4.sampling import Sampler, SamplingParams
from ds4.session import Session, check_cuda_graphs, check_size, step_graphs
from ds4.speculative import SpecMetrics, check_draft, generate_ids
from ds4.tiny import DEFAULT_MODEL_DIR
from ds4.tokenizer import StreamDecoder, Tokenizer
from ds4.weights import WeightsReport, mem_available, plan, repack_at_load
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4
from models.mtp import MTPHead

MODEL_ID_BYTES = 1 << 20  # bytes read from each end of a model file for Engine.model_id


def default_model_paths() -> tuple[str, str]:
    """The embedded default model (trained by scripts/train_tiny.py, shipped in the package): base and MTP GGUFs."""
    base, mtp = DEFAULT_MODEL_DIR / "tiny.gguf", DEFAULT_MODEL_DIR / "tiny-mtp.gguf"
    for path in (base, mtp):  # a file missing or cut short (a broken install) says how to fix it
        if not path.is_file():
            raise ModelFileError(f"the embedded default model is missing ({path}); reinstall ds4py or pass --model")
        try:
            gguf.open(path)
        except ModelFileError as e:
            raise ModelFileError(f"{e} -- the embedded default model is damaged: reinstall ds4py or pass --model") \
                from None
    return str(base), str(mtp)


def check_device(device: Any) -> str:
    """`device` if this machine has it (cpu, meta, cuda[:N] with that GPU, mps when built in), else
    BackendUnavailable naming it."""
    import torch
    if not isinstance(device, str):
        raise UsageError(f"--device must be a string such as cpu or cuda:0, got {type(device).__name__}")
    if device.split(":")[0] == "mlx":  # MLX devices are the MLX backend's to check
        return device
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"--device {device!r}: not a device ({str(e).splitlines()[0][:80]})") from None
    if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
        raise BackendUnavailable(f"--device {device}: no such CUDA device here "
                                 f"({torch.cuda.device_count() if torch.cuda.is_available() else 0} available)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise BackendUnavailable(f"--device {device}: MPS is not available here")
    if dev.type not in ("cpu", "cuda", "mps", "meta"):
        raise BackendUnavailable(f"--device {device}: ds4py runs on cpu, cuda[:N] or mps")
    return str(device)


def check_text(name: str, text: Any) -> str:
    """User text must be a str of valid Unicode (undecodable command-line bytes arrive as lone surrogates)."""
    if not isinstance(text, str):
        raise UsageError(f"{name} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{name} is not valid UTF-8 text (undecodable byte at character {e.start})") from None
    return text


@dataclass
class Token:
    """One generated token and the text it completes (may be empty mid-character)."""

    id: int
    text: str


@dataclass
class RunStats:
    """Timings and counters of the last `generate` call."""

    prompt_ids: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)
    spec: SpecMetrics = field(default_factory=SpecMetrics)

    @property
    def prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_ids)

    @property
    def generated_tokens(self) -> int:
        """Tokens generated so far (counted by the decoder)."""
        return self.spec.generated_tokens

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        tps = self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0
        return {"prompt_ids": self.prompt_ids, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens,
                "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                "decode_tokens_per_s": round(tps, 2), "counters": self.counters, "speculative": self.spec.as_dict()}


class Engine:
    """A loaded model (+ optional MTP head), its tokenizer and the ops it runs on."""

    def __init__(self, model: DeepseekV4, tokenizer: Tokenizer, mtp: MTPHead | None, *, ctx: int,
                 prefill_chunk: int, paths: tuple[str, str | None], compile: bool = False, cuda_graphs: bool = False,
                 world: distributed.World | None = None, weights: WeightsReport | None = None):
        self.model, self.tokenizer, self.mtp, self.world = model, tokenizer, mtp, world
        self.weights = weights  # how load held the files (mapped or read into memory), or None
        self.ctx, self.prefill_chunk, self.paths, self.compile = ctx, prefill_chunk, paths, compile
        self.cuda_graphs = cuda_graphs
        self.stats = RunStats()

    @property
    def args(self) -> ModelArgs:
        """The model's hyperparameters and switches."""
        return self.model.args

    @property
    def ops(self) -> OpSet:
        """The registry view the model calls; `engine.ops.report()` says which kernels ran."""
        return self.model.ops

    @functools.cached_property
    def model_id(self) -> str:
        """SHA-256 of the model files' sizes, first and last MiB: tells a session file saved from another model
        file (say, another fine-tune of the same layout) from one of this model."""
        h = hashlib.sha256()
        for path in filter(None, self.paths):
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(0)
                h.update(f"{size}:".encode() + f.read(MODEL_ID_BYTES))
                f.seek(max(0, size - MODEL_ID_BYTES))
                h.update(f.read(MODEL_ID_BYTES))
        return h.hexdigest()

    def session(self, ctx: int | None = None, prefill_chunk: int | None = None) -> Session:
        """A fresh session (KV state) for experiments: prefill / decode / forward / snapshot / restore."""
        return Session(self.model, self.ctx if ctx is None else ctx,
                       self.prefill_chunk if prefill_chunk is None else prefill_chunk, self.mtp, self.compile,
                       self.model_id, self.cuda_graphs)

    def session_from_file(self, path: str | os.PathLike[str], ctx: int | None = None) -> Session:
        """The session saved to `path` (`Session.save`), continuing on this model with its prefill chunk and `ctx`
        (default the engine's); SessionFileError when the file is damaged or from another model, layout or
        prefill chunk, or holds more than `ctx` allows."""
        session = Session.load(path, self.model, self.mtp, self.ctx if ctx is None else ctx, self.compile,
                               self.model_id, self.prefill_chunk)
        if self.cuda_graphs:
            session.graphs = step_graphs(self.model, self.mtp)
        return session

    def encode(self, prompt: str | Sequence[int], *, system: str | None = None, think: bool = False,
               raw: bool = False) -> list[int]:
        """Prompt ids: a list of ids passes through; text gets the chat template unless `raw`."""
        if system is not None:
            check_text("the system prompt", system)
        if hasattr(prompt, "tolist"):  # a numpy array or torch tensor of ids
            prompt = prompt.tolist()
        if not isinstance(prompt, str):
            if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Sequence):
                raise UsageError(f"the prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
            wrong = [t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
            if wrong:
                raise UsageError(f"prompt token ids must be integers, got {wrong[0]!r}")
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.args.vocab_size]
            if bad:
                raise UsageError(f"prompt ids {bad[:5]} are outside the vocabulary [0, {self.args.vocab_size})")
            return ids
        check_text("the prompt", prompt)
        if raw:
            return self.tokenizer.encode(prompt)
        return chat_ids(self.tokenizer, [{"role": "user", "content": prompt}], think=think, system=system)

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 256, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                 system: str | None = None, think: bool = False, raw: bool = False, ctx: int | None = None,
                 prefill_chunk: int | None = None, mtp_draft: int | str | None = None, strict: bool = False,
                 continuous: bool = True, spec_log: Callable[[dict], None] | None = None,
                 on_logits: Callable[[Any], None] | None = None) -> Iterator[Token]:
        """Yield generated tokens with their text as they are committed; stats land in `self.stats`.

        Every argument is checked when this is called (UsageError), before the first token is asked for."""
        if self.world is not None and seed is None and temperature > 0:  # every rank must draw alike
            seed = distributed.shared_seed(self.world)
        sampler = Sampler(SamplingParams(temperature, top_k, top_p, min_p, seed))
        ids = self.encode(prompt, system=system, think=think, raw=raw)
        ctx = self.ctx if ctx is None else check_size("ctx (--ctx)", ctx, 2)
        max_tokens = check_size("max_tokens (-n)", max_tokens, 0)
        if not ids:
            raise UsageError("the prompt is empty")
        if strict and self.ops.cpu_dot != "exact":
            raise UsageError(f"--strict promises the reference's tokens; --cpu-dot {self.ops.cpu_dot} rounds "
                             "activations to 8 bits (drop one of them)")
        if len(ids) >= ctx:
            raise UsageError(f"the prompt has {len(ids)} tokens but the context is {ctx} (--ctx)")
        for name, hook in (("spec_log", spec_log), ("on_logits", on_logits)):
            if hook is not None and not callable(hook):
                raise UsageError(f"{name} must be a function or None, got {type(hook).__name__}")
        if mtp_draft == 0 and not isinstance(mtp_draft, bool):
            mtp_draft = None  # 0: speculation off, even with an MTP head loaded
        else:
            mtp_draft = check_draft(mtp_draft)
            if mtp_draft is not None and self.mtp is None:
                raise UsageError("--mtp-draft needs an MTP head: pass --mtp PATH (mtp_path=...)")
            if mtp_draft is None and self.mtp is not None:
                mtp_draft = 1  # ds4 #371: continuous depth-1 speculation is the default with an MTP head
        session = self.session(ctx, prefill_chunk)
        return self._stream(session, ids, sampler, max_tokens, mtp_draft, strict, continuous, spec_log, on_logits)

    def _stream(self, session: Session, ids: list[int], sampler: Sampler, max_tokens: int,
                mtp_draft: int | str | None, strict: bool, continuous: bool,
                spec_log: Callable[[dict], None] | None, on_logits: Callable[[Any], None] | None) -> Iterator[Token]:
        """The generation `generate` set up, as a generator (across ranks: a failed collective is a
        ParallelError; with $DS4_DIST_CHECK=1 every committed token is compared across ranks)."""
        if self.world is None:
            yield from self._tokens(session, ids, sampler, max_tokens, mtp_draft, strict, continuous, spec_log,
                                    on_logits)
            return
        with distributed.collective_errors(self.world):
            for n, token in enumerate(self._tokens(session, ids, sampler, max_tokens, mtp_draft, strict, continuous,
                                                   spec_log, on_logits)):
                if self.world.check_tokens:
                    distributed.check_same(self.world, token.id, f"generated token {n}")
                yield token

    def _tokens(self, session: Session, ids: list[int], sampler: Sampler, max_tokens: int,
                mtp_draft: int | str | None, strict: bool, continuous: bool,
                spec_log: Callable[[dict], None] | None, on_logits: Callable[[Any], None] | None) -> Iterator[Token]:
        """The committed tokens of one generation, with their text."""
        self.stats = stats = RunStats(prompt_ids=ids)
        decoder = StreamDecoder(self.tokenizer)
        long_prompt = len(ids) > session.prefill_chunk
        bar = tqdm(total=len(ids), desc="prefill", unit="tok", leave=False, disable=None if long_prompt else True)
        session.on_chunk = bar.update
        t0 = time.perf_counter()
        stream = generate_ids(session, ids, max_tokens=max_tokens, sampler=sampler, eos_id=self.tokenizer.eos_id,
                              draft=mtp_draft, strict=strict, continuous=continuous, spec_log=spec_log,
                              metrics=stats.spec, on_logits=on_logits)
        for n, token in enumerate(stream):
            now = time.perf_counter()
            if n == 0:
                stats.prefill_s, t1 = now - t0, now
                bar.close()
                session.on_chunk = None
            stats.decode_s = now - t1
            stats.counters = dict(session.counters)
            yield Token(token, decoder.push(token))
        tail = decoder.flush()
        if tail:
            yield Token(-1, tail)


def open_model(path: str | gguf.GGUFFile, ops: OpSet | None = None, **switches: Any) -> DeepseekV4:
    """The trunk of a ds4-layout GGUF (a path or an opened file), its weights placed on the OpSet's device
    in their stored blocks; a bad file raises ModelFileError naming it."""
    f = path if isinstance(path, gguf.GGUFFile) else gguf.open(path)
    try:
        layouts.check_types(f)
        md, _ = layouts.ds4_metadata(f.metadata, f.tensors)  # llama.cpp's spelling read as ds4's
        return DeepseekV4(ModelArgs.from_metadata(md, **switches), {n: f.raw(n) for n in f.tensors}, ops)
    except ModelFileError as e:
        raise ModelFileError(e if str(e).startswith(str(f.path)) else f"{f.path}: {e}") from None


def open_mtp(trunk: DeepseekV4, path: str | gguf.GGUFFile) -> MTPHead:
    """The MTP head in an MTP GGUF (a path or an opened file) of ds4's layout (`mtp.0.*`) or llama.cpp's
    (`blk.L.nextn.*`, also a llama.cpp base GGUF that carries its nextn block), bound to `trunk` without copying
    its tensors."""
    f = path if isinstance(path, gguf.GGUFFile) else gguf.open(path)
    gguf.check_architecture(f, keys=())
    try:
        weights, _ = layouts.mtp_weights(f, trunk.args.dim)
        return MTPHead(trunk, weights)
    except ModelFileError as e:
        raise ModelFileError(e if str(e).startswith(str(f.path)) else f"{f.path}: {e}") from None


def load(model_path: str | None = None, mtp_path: str | None = None, backend: str = "auto", *,
         ops: dict[str, str] | None = None, strict_backend: bool = False, ctx: int = 4096,
         prefill_chunk: int = 2048, device: str | None = None, compile: bool = False, cuda_graphs: bool = False,
         parallel: str | None = None, cpu_dot: str = "exact", weights: str = "auto",
         **switches: Any) -> Engine:
    """Load a ds4-layout GGUF (default: the embedded tiny model) and optionally its MTP GGUF.

    `backend`: auto | torch | triton | mlx | cpu; `ops`: per-op overrides {"qmatmul": "torch"};
    `device`: where weights and caches live (cpu, cuda, cuda:N, mlx, mlx:cpu, mlx:gpu; default: `mlx` for
    the mlx backend, else the best available, see backends.registry.default_device);
    `compile`: run decode, verify and MTP steps through a compiled step (torch.compile, CPU; docs/cpu.md; across
    ranks the step holds its all_reduces);
    `cuda_graphs`: record decode, verify and MTP steps in CUDA graphs and replay them (CUDA only; docs/kernels.md);
    `parallel`: "ep" splits the routed experts over the ranks torchrun started (one process each; every
    rank calls load with the same arguments; docs/distributed.md), "tp" also the vocabulary, the attention
    and indexer heads and the shared expert; None runs in this process alone;
    `cpu_dot`: "exact" (default) or "q8": the cpu backend rounds activations to 8 bits per block for its
    quantized products, as llama.cpp does (faster, not the reference's numbers; docs/cpu.md);
    `weights`: "mmap" maps the files, "memory" reads them into anonymous memory with huge pages (faster CPU
    kernels; llama.cpp's --no-mmap), "auto" (default) reads them in on the CPU when they fit in the available
    memory with a margin, else maps them (ds4/weights.py, docs/cpu.md "Weights in memory"); the choice and its
    reason are `engine.weights`, printed on stderr when asked for or when the files are large;
    `switches`: model switches such as indexer_fp4_sim, kv_fp8_sim, shared_swiglu_clamp, mtp_pairing.
    """
    for label, path in (("model_path", model_path), ("mtp_path", mtp_path)):
        if path is not None and not isinstance(path, str | os.PathLike):
            raise UsageError(f"{label} must be a path, got {type(path).__name__}")
    if model_path is None:
        model_path, default_mtp = default_model_paths()
        mtp_path = default_mtp if mtp_path is None else mtp_path
    for label, path in (("model", model_path), ("MTP", mtp_path)):
        if path is not None and not Path(path).is_file():
            raise ModelFileError(f"{label} file not found: {path}")
    ctx, prefill_chunk = check_size("ctx (--ctx)", ctx, 2), check_size("prefill_chunk (--prefill-chunk)", prefill_chunk)
    world = None
    if parallel is not None:
        if parallel not in ("ep", "tp"):
            raise UsageError(f"--parallel must be ep or tp, got {parallel!r}")
        if compile and parallel == "tp":
            raise UsageError("--compile runs across ranks with --parallel ep only so far: drop it with --parallel tp")
        if cuda_graphs:
            raise UsageError("--cuda-graphs does not run across ranks yet: drop it with --parallel")
        world, device = distributed.start(parallel, device)
        distributed.check_same_run(world, {
            "model file": distributed.fingerprint(model_path),
            "MTP file": mtp_path and distributed.fingerprint(mtp_path), "number of ranks": world.size,
            "parallel mode": parallel, "backend": backend, "cpu dot": cpu_dot, "switches": sorted(switches.items())})
    if device:
        check_device(device)
    if cpu_dot != "exact" and strict_backend:
        raise UsageError(f"--cpu-dot {cpu_dot} changes the reference's numbers: it cannot run with --strict-backend")
    opset = OpSet(backend, ops, strict=strict_backend, device=device, parallel=parallel, cpu_dot=cpu_dot)
    nbytes = sum(Path(p).stat().st_size for p in (model_path, mtp_path) if p)
    how = plan(weights, nbytes, opset.device, parallel, mem_available())
    with tqdm(total=3, desc="loading", unit="step", leave=False, disable=None) as bar:
        t0 = time.perf_counter()
        f = gguf.open(model_path, how.mode)
        fm = gguf.open(mtp_path, how.mode) if mtp_path else None
        report = WeightsReport(how, nbytes, time.perf_counter() - t0, f.huge_pages and (fm is None or fm.huge_pages))
        if weights != "auto" or nbytes >= gguf.LARGE_FILE:
            tqdm.write(report.line(), file=sys.stderr)
        gguf.check_architecture(f, keys=())
        model = open_model(f, opset, **switches)
        if how.mode == "memory" and cpu_dot == "q8" and not compile and str(opset.device).startswith("cpu"):
            repack_at_load(model)
        bar.update()
        try:
            tokenizer = Tokenizer.from_metadata(f.metadata)
        except ModelFileError as e:
            raise ModelFileError(f"{model_path}: {e}") from None
        if tokenizer.vocab_size != model.args.vocab_size:  # every id the model can produce must decode
            raise ModelFileError(f"{model_path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                                 f"vocabulary (deepseek4.vocab_size) is {model.args.vocab_size}")
        bar.update()
        mtp = open_mtp(model, fm) if fm else None
        bar.update()
    if compile:  # an unsupported device fails here, before any generation
        model.compiled_step()
    if cuda_graphs:
        check_cuda_graphs(opset.device, compile)
    return Engine(model, tokenizer, mtp, ctx=ctx, prefill_chunk=prefill_chunk, paths=(model_path, mtp_path),
                  compile=compile, cuda_graphs=cuda_graphs, world=world, weights=report)
