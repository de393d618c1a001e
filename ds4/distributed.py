"""Multi-process runs under torchrun (docs/distributed.md): the process group (gloo on CPUs, NCCL on GPUs),
the start-up check that every rank loaded the same files with the same options, and the guards that keep
every rank's decisions equal. The model itself only calls `ops.all_reduce` (backends/arrays.py)."""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds4.errors import ParallelError, UsageError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_ENV = "DS4_DIST_TIMEOUT"   # seconds a collective waits for the other ranks (default 120)
CHECK_ENV = "DS4_DIST_CHECK"       # 1: every rank compares each committed token with the others (debug)
SAMPLES, SAMPLE_BYTES = 16, 1 << 16  # a file's fingerprint reads 16 slices of 64 KiB spread over it


@dataclass(frozen=True)
class World:
    """This process's place in the run: rank, number of ranks, GPU index on its host, collective backend."""

    rank: int
    size: int
    local_rank: int
    backend: str
    timeout_s: float
    check_tokens: bool = False

    @property
    def is_main(self) -> bool:
        """Whether this rank prints and streams (rank 0)."""
        return self.rank == 0


def timeout_s() -> float:
    """Seconds a collective may wait for the other ranks ($DS4_DIST_TIMEOUT, default 120)."""
    text = os.environ.get(TIMEOUT_ENV, "120")
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{TIMEOUT_ENV} must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise UsageError(f"{TIMEOUT_ENV} must be > 0, got {text!r}")
    return value


def start(parallel: str, device: str | None) -> tuple[World, str]:
    """Join the run torchrun started (initialising the process group once) and return this rank's World and
    its device: `cuda:LOCAL_RANK` on a GPU host, else the CPU (or the `device` given)."""
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise UsageError(f"--parallel {parallel} runs one process per rank, started by torchrun (missing "
                         f"{', '.join(missing)}): torchrun --nproc-per-node N scripts/generate.py ... "
                         f"--parallel {parallel} (docs/distributed.md)")
    rank, size, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    elif device == "cuda":
        device = f"cuda:{local}"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    wait = timeout_s()
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(torch.device(device))
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=wait))
        except (RuntimeError, ValueError) as e:
            raise ParallelError(f"rank {rank}: could not join the run of {size} ranks at "
                                f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {wait:g}s: "
                                f"{first_line(e)}") from None
    elif (dist.get_rank(), dist.get_world_size()) != (rank, size):
        raise ParallelError(f"torch.distributed is initialised as rank {dist.get_rank()} of "
                            f"{dist.get_world_size()}, but torchrun says rank {rank} of {size}")
    world = World(rank, size, local, dist.get_backend(), wait, os.environ.get(CHECK_ENV) == "1")
    return world, device


def stop() -> None:
    """Leave the process group (end of a run)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (gloo's carry a long trace)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


@contextmanager
def collective_errors(world: World) -> Iterator[None]:
    """Turn a collective that failed (a rank died, the timeout passed) into one ParallelError naming this rank."""
    try:
        yield
    except dist.DistError as e:
        raise ParallelError(f"rank {world.rank} of {world.size}: a collective failed (a rank stopped or did not "
                            f"answer within {world.timeout_s:g}s, {TIMEOUT_ENV}): {first_line(e)}") from None
    except RuntimeError as e:
        if "gloo" not in str(e).lower() and "nccl" not in str(e).lower():
            raise
        raise ParallelError(f"rank {world.rank} of {world.size}: a collective failed (a rank stopped or did not "
                            f"answer within {world.timeout_s:g}s, {TIMEOUT_ENV}): {first_line(e)}") from None


def gather(world: World, value: Any) -> list[Any]:
    """Every rank's `value` (picklable), in rank order."""
    out: list[Any] = [None] * world.size
    with collective_errors(world):
        dist.all_gather_object(out, value)
    return out


def fingerprint(path: str | os.PathLike) -> str:
    """A short digest of a file: its size and 16 slices of 64 KiB spread over it (cheap on an 81 GB file,
    and any two model files of the same shapes but other weights differ in it)."""
    size = Path(path).stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(SAMPLES):
            f.seek(max(0, size - SAMPLE_BYTES) * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def check_same_run(world: World, facts: dict[str, Any]) -> None:
    """Every rank must have the same `facts` (file fingerprints, parallel mode, options): else one
    ParallelError on every rank naming what differs, within the timeout (never a hang)."""
    every = gather(world, facts)
    wrong = [(r, key) for r, theirs in enumerate(every) for key in facts if theirs.get(key) != facts[key]]
    if wrong:
        key = wrong[0][1]
        seen = "; ".join(f"rank {r}: {theirs.get(key)!r}" for r, theirs in enumerate(every))
        raise ParallelError(f"the ranks of this run disagree on {key} ({seen}); start every rank with the same "
                            "files and options")


def check_same(world: World, value: Any, what: str) -> None:
    """Debug guard: every rank holds the same `value` (e.g. a committed token), else ParallelError."""
    every = gather(world, value)
    if any(v != every[0] for v in every):
        raise ParallelError(f"the ranks diverged at {what}: " + ", ".join(f"rank {r}: {v!r}"
                                                                        for r, v in enumerate(every)))


def shared_seed(world: World) -> int:
    """A random sampling seed drawn on rank 0 and sent to every rank (so sampling ranks draw alike)."""
    seed = [int(torch.randint(0, 2**62, ()).item())]
    with collective_errors(world):
        dist.broadcast_object_list(seed, src=0)
    return seed[0]
