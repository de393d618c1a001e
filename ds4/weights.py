"""Where a model's weights live (`--weights`, `ds4.load(weights=...)`): mapped from the file's page cache, or read
into anonymous memory with huge pages, which the CPU kernels read faster (docs/cpu.md "Weights in memory")."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ds4.errors import UsageError

CHOICES = ("auto", "mmap", "memory")
MIN_LEFT = 2 * 10**9     # `auto` reads the files into memory only when this much stays available afterwards,
SHARE_LEFT = 0.10        # and this share of what is available now
HELP = ("how the model files are held: memory reads them into RAM with huge pages (faster CPU kernels; llama.cpp's "
        "--no-mmap), mmap maps them from the page cache, auto (default) reads them in on the CPU when they fit in the "
        "available memory with 2 GB or 10%% to spare, else maps them (docs/cpu.md)")


@dataclass(frozen=True)
class WeightsPlan:
    """How the model files are to be held, "mmap" or "memory", and why."""

    mode: str
    reason: str


def gb(nbytes: float) -> str:
    """Bytes as GB (MB below 1 GB), for messages."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable) in bytes; None where unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "MemAvailable":
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def margin(available: int) -> int:
    """Bytes that must stay available after the weights are read in."""
    return max(MIN_LEFT, int(SHARE_LEFT * available))


def plan(requested: str, nbytes: int, device: str, parallel: str | None, available: int | None) -> WeightsPlan:
    """The plan for `requested` (auto | mmap | memory) for model files of `nbytes` placed on `device`.

    `auto` reads into memory on the CPU (where the kernels read the weights in place) when the files fit in
    `available` with the margin left, else maps them; it maps on other devices (the weights are copied there
    anyway) and under `parallel` ranks (each would copy the whole file). `memory` asked for but not fitting,
    or under ranks, is a UsageError, raised before anything is read."""
    if requested not in CHOICES:
        raise UsageError(f"--weights must be one of {', '.join(CHOICES)}, got {requested!r}")
    fits = available is not None and nbytes + margin(available) <= available
    if requested == "memory":
        if parallel is not None:
            raise UsageError("--weights memory would copy the whole model file into every rank: use --weights mmap "
                             "(or auto) with --parallel (each rank then reads only the pages of its share)")
        if available is not None and not fits:
            raise UsageError(f"--weights memory: the model files ({gb(nbytes)}) do not fit in the {gb(available)} "
                             f"available with {gb(margin(available))} to spare; use --weights mmap")
        return WeightsPlan("memory", "asked for")
    if requested == "mmap":
        return WeightsPlan("mmap", "asked for")
    if parallel is not None:
        return WeightsPlan("mmap", f"--parallel {parallel}: each rank reads only the pages of its share")
    if device != "cpu":
        return WeightsPlan("mmap", f"the weights are copied to {device}")
    if available is None:
        return WeightsPlan("mmap", "available memory unknown")
    if not fits:
        return WeightsPlan("mmap", f"files {gb(nbytes)} > {gb(available - margin(available))} available "
                                   f"with {gb(margin(available))} to spare")
    return WeightsPlan("memory", f"files {gb(nbytes)} fit in {gb(available)} available")


@dataclass(frozen=True)
class WeightsReport:
    """What loading did: the plan, the files' bytes, the seconds opening them took, huge pages taken."""

    plan: WeightsPlan
    nbytes: int
    seconds: float
    huge_pages: bool

    def line(self) -> str:
        """The one line printed at load."""
        if self.plan.mode == "mmap":
            return f"weights: mapped from the file, {gb(self.nbytes)} ({self.plan.reason})"
        pages = "huge pages" if self.huge_pages else "no huge pages"
        took = f"{self.seconds:.1f} s" if self.seconds >= 1 else f"{1e3 * self.seconds:.0f} ms"
        return (f"weights: read into memory, {gb(self.nbytes)} in {took} ({pages}; "
                f"{self.plan.reason})")


def repack_experts(layers: list) -> None:
    """Repack in place the routed experts' stacks of a repackable type (Q4_K, Q2_K, IQ2_XXS: backends/cpu/repack.py's
    `LAYOUTS`) of the trunk `layers` (block records with `experts`) for the 8-bit kernels (docs/cpu.md "Q4_K repacked
    at load (session 13)", "Several rows within 1.3x: Q2_K and IQ2_XXS (session 14)", "IQ2_XXS at several rows
    (session 15)"): the caller does it only for
    weights read into this process's memory under `--cpu-dot q8` on the CPU, where the copy exists anyway and no exact
    kernel reads them. Nothing is repacked where the vector kernels are not built here."""
    from backends.cpu import repack
    if not repack.worthwhile():
        return
    for layer in layers:
        layer.experts = repack.repack_experts(layer.experts)


BLOCK_Q8_0 = ("q_a", "q_b", "kv", "output_a", "output_b")   # a block's 2-D weights repack_q8_0 takes (Q8_0 in
                                                             # every ds4 mix)


def repack_q8_0(model) -> None:
    """Repack in place the 2-D Q8_0 weights of a trunk `model` (each block's `BLOCK_Q8_0` and shared expert, and the
    LM head) for the 8-bit kernels (docs/cpu.md "The repacked Q8_0 in the model (session 15)"), under the same
    conditions as `repack_experts`; the MTP head keeps the stored blocks, as do a weight of fewer than 16 rows and a
    grouped output projection whose groups (`o_lora_rank` rows each) are not whole groups of 16 rows."""
    from backends.cpu import repack

    def repacked(w, rows: int = repack.GROUP):
        """`w` repacked where it is a contiguous Q8_0 weight of groups of `rows` rows that are whole groups."""
        ok = repack.repackable(w) and w.qtype.name == "Q8_0" and w.data.is_contiguous() and rows % repack.GROUP == 0
        return repack.repack(w) if ok else w

    if not repack.worthwhile():
        return
    for layer in model.layers:
        for name in BLOCK_Q8_0:
            setattr(layer, name, repacked(getattr(layer, name), model.args.o_lora_rank if name == "output_a" else 16))
        layer.shared = tuple(repacked(w) for w in layer.shared)
    model.output = repacked(model.output)


def repack_at_load(model) -> None:
    """Both load-time repacks of a trunk `model` (`repack_experts`, `repack_q8_0`), where `ds4.load` makes them."""
    repack_experts(model.layers)
    repack_q8_0(model)


def unpack_all(model) -> None:
    """Every weight of a trunk `model` that `repack_at_load` repacked rewritten back into its stored blocks, in place
    (a file read into memory whose bytes another model reads afterwards, as `bench.py cpu --full-layers` does)."""
    from backends.cpu import repack

    def stored(w):
        return repack.unpack(w) if type(w) in repack.REPACKED else w

    for layer in model.layers:
        ex = layer.experts
        layer.experts = dataclasses.replace(ex, gate=stored(ex.gate), up=stored(ex.up), down=stored(ex.down))
        for name in BLOCK_Q8_0:
            setattr(layer, name, stored(getattr(layer, name)))
        layer.shared = tuple(stored(w) for w in layer.shared)
    model.output = stored(model.output)
