"""gpu: everything a CUDA machine can tell, in one command (`python scripts/bench.py gpu`, `make gpu-check`):
the device and versions; the native kernel tests (pytest with DS4_TEST_DEVICE=cuda); every op table at
decode, verify and prefill row counts (qmatmul's GB/s against the copy bandwidth measured in the same run;
moe, indexer and argmax against their references); whole-model decode at V4 Flash shapes with a few layers in
the q2 and q4 mixes against the copy-bandwidth roofline; the speculative frontier on the embedded model; and
the compile report read from the kernels the run compiled (registers, spills, shared memory, occupancy).
Writes gpu.md (a section for BENCHMARKS.md), gpu.csv, gpu.png and the tests' tests.log into --out. `--dry-run`
runs the same pipeline at smoke size on the CPU, with Triton's interpreter for the tests, so CI keeps it working.
"""
from __future__ import annotations

import argparse
import csv
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from ds4.bench import kernels, model, qmatmul, spec
from ds4.bench.common import machine
from ds4.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
NATIVE_TESTS = ("tests/test_native_gpu.py", "tests/test_cuda_graphs.py", "tests/test_qmatmul.py",
                "tests/test_triton_*.py", "tests/test_device_choice.py")
SMOKE_TESTS = ("tests/test_triton_argmax.py", "-k", "float16")
REGISTERS_PER_SM, MAX_BLOCKS_PER_SM = 65536, 32
FULL_MODEL, SMOKE_MODEL = {"layers": 4, "prompt": 512, "decode": 64}, {"layers": 2, "prompt": 4, "decode": 2}


@dataclass
class Table:
    """One titled table of the report (rows of equal keys) and the note printed under it."""

    title: str
    rows: list[dict]
    note: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    """The tables written so far, in order."""

    tables: list[Table] = field(default_factory=list)

    def add(self, title: str, make: Callable[[], list[dict]], note: str = "") -> Table:
        """Run one stage, time it, keep its table. A stage that fails is recorded with its error (its traceback on
        stderr) and the others still run: one broken kernel must not cost the whole GPU run."""
        start = time.perf_counter()
        print(f"# gpu: {title} ...", file=sys.stderr, flush=True)
        try:
            rows = make()
        except Exception as e:  # noqa: BLE001 - recorded in the table and printed, never swallowed
            traceback.print_exc()
            rows, note = [{"error": f"{type(e).__name__}: {e}"}], "this stage failed; the others ran"
        table = Table(title, rows, note, time.perf_counter() - start)
        self.tables.append(table)
        return table


def native_tests(dry_run: bool, log: Path) -> list[dict]:
    """Run the kernel tests in a subprocess on CUDA (dry run: a smoke subset under the interpreter); their
    whole output goes to `log`."""
    if not (ROOT / "tests").is_dir():
        raise UsageError(f"the native tests need a source checkout (no tests/ beside {ROOT / 'ds4'})")
    files = SMOKE_TESTS if dry_run else tuple(str(p.relative_to(ROOT)) for pattern in NATIVE_TESTS
                                              for p in sorted(ROOT.glob(pattern)))
    env = {**os.environ, "DS4_TEST_DEVICE": "cpu" if dry_run else "cuda"}
    if not dry_run:
        env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *files],
                       cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    log.write_text(r.stdout + r.stderr)
    return [test_summary(r.stdout + r.stderr, r.returncode)]


def test_summary(output: str, returncode: int) -> dict:
    """Counts from pytest's last summary line, and the failed tests' ids."""
    lines = output.strip().splitlines()
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)),
                   lines[-1] if lines else "no output")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    failed = [line.split()[1] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return {"exit": returncode, "passed": counts.get("passed", 0), "failed": counts.get("failed", 0),
            "errors": counts.get("error", 0) + counts.get("errors", 0), "skipped": counts.get("skipped", 0),
            "summary": summary.strip("= "), "failing": " ".join(failed[:20]) or "-"}


def suite_args(suite: ModuleType, dry_run: bool, reps: int, **options) -> argparse.Namespace:
    """The namespace `suite`'s rows() reads: its own parser's defaults, then `options`."""
    parser = argparse.ArgumentParser()
    suite.add_args(parser, on_gpu=not dry_run)
    args = parser.parse_args([])
    vars(args).update(quick=dry_run, reps=reps, csv=False, **options)
    return args


def op_tables(report: Report, device: torch.device, dry_run: bool, reps: int) -> None:
    """qmatmul at every type, shape and M; moe, indexer and argmax."""
    if dry_run:
        q = suite_args(qmatmul, True, reps, types=["Q8_0"], shapes=["64x256"], m=[1, 3], backend="torch")
    else:
        q = suite_args(qmatmul, False, reps, backend="triton")   # every registered type Triton serves
    report.add("qmatmul", lambda: qmatmul.rows(q, device),
               "GB/s = weight bytes / time; %copy = that against the device-to-device copy measured in the same run")
    for op in ("moe", "indexer", "argmax"):
        k = suite_args(kernels, dry_run, reps, op=op, smoke=dry_run)
        report.add(op, lambda k=k: kernels.rows(k, device),
                   "x_reference = reference time / Triton time")


def model_tables(report: Report, device: torch.device, dry_run: bool, reps: int) -> None:
    """Whole-model prefill and decode, q2 and q4, eager and with decode steps replayed from CUDA graphs."""
    sizes = SMOKE_MODEL if dry_run else FULL_MODEL
    for graphs in (False, True):
        for mix in ("q2", "q4"):
            a = suite_args(model, dry_run, reps, mix=mix, tiny=dry_run, backend="auto", png=None, cuda_graphs=graphs,
                           **sizes)
            report.add(f"model {mix}{' cuda graphs' if graphs else ''}", lambda a=a: model.rows(a, device),
                       f"{'tiny sizes' if dry_run else 'V4 Flash shapes'}, first {sizes['layers']} layers, random "
                       "weights; roofline = copy bandwidth / decode step bytes"
                       + ("; decode steps replayed from CUDA graphs" if graphs else ""))


def spec_table(report: Report, device: torch.device, dry_run: bool) -> None:
    """The speculative frontier on the embedded model (dry run: 2 tokens per generation)."""
    a = suite_args(spec, dry_run, 1, tokens=2 if dry_run else 96)
    report.add("speculative frontier", lambda: spec.rows(a, device),
               "embedded model; target passes per committed token by speculative mode")


def jit_kernels() -> list[tuple[str, object]]:
    """(module.name, kernel) of every Triton kernel in backends/triton, autotuner wrappers unwrapped (under the
    interpreter the kernels are interpreted functions, which compile nothing)."""
    from triton.runtime.jit import KernelInterface

    import backends.triton as package
    found: dict[int, tuple[str, object]] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            while isinstance(getattr(obj, "fn", None), KernelInterface):
                obj = obj.fn
            if isinstance(obj, KernelInterface):
                found.setdefault(id(obj), (f"{info.name}.{name}", obj))
    return sorted(found.values(), key=lambda item: item[0])


def compile_report(props) -> list[dict]:
    """Registers, spills, shared memory and occupancy of every kernel variant this process compiled, read from
    Triton's compiled kernels (`props`: the CUDA device's properties)."""
    rows = []
    for name, fn in jit_kernels():
        for kernel_cache, *_ in getattr(fn, "device_caches", {}).values():
            for kernel in kernel_cache.values():
                kernel._init_handles()  # loads the binary: the driver reports registers and spills
                warps, shared = kernel.metadata.num_warps, kernel.metadata.shared
                rows.append({"kernel": name, "warps": warps, "stages": kernel.metadata.num_stages,
                             "registers": kernel.n_regs, "spills": kernel.n_spills, "shared_B": shared,
                             "occupancy": occupancy(props, warps, kernel.n_regs, shared)})
    if not rows:
        names = ", ".join(name for name, _ in jit_kernels())
        return [{"kernel": "-", "note": f"no compiled kernel in this process (interpreter); kernels: {names}"}]
    return rows


def occupancy(props, warps: int, regs: int, shared: int) -> str:
    """Resident threads per SM over the maximum, from registers (64K per SM on every NVIDIA GPU since Maxwell),
    shared memory, threads and 32 blocks per SM; register allocation granularity ignored, so an estimate."""
    threads = warps * props.warp_size
    limits = [props.max_threads_per_multi_processor // threads, MAX_BLOCKS_PER_SM]
    if regs:
        limits.append(REGISTERS_PER_SM // (regs * threads))
    if shared:
        limits.append(props.shared_memory_per_multiprocessor // shared)
    return f"{100 * min(limits) * threads / props.max_threads_per_multi_processor:.0f}%"


def markdown(report: Report, header: str) -> str:
    """The report as a BENCHMARKS.md section."""
    out = ["## GPU check (`python scripts/bench.py gpu`)", "", header, ""]
    for t in report.tables:
        out += [f"### {t.title}", ""]
        cols = list(dict.fromkeys(k for r in t.rows for k in r))
        out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(str(r.get(c, "")).replace("|", "/") for c in cols) + " |" for r in t.rows]
        out += ["", f"{t.note + '. ' if t.note else ''}({t.seconds:.0f} s)", ""]
    return "\n".join(out)


def write_csv(report: Report, path: Path) -> None:
    """Every row of every table, with its table's title first."""
    cols = ["table", *dict.fromkeys(k for t in report.tables for r in t.rows for k in r)]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols, restval="")
        writer.writeheader()
        writer.writerows({"table": t.title, **r} for t in report.tables for r in t.rows)


def plot(report: Report, path: Path) -> None:
    """qmatmul's share of copy bandwidth per type and M, and model decode against its roofline."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = {t.title: t.rows for t in report.tables}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    q = [r for r in tables.get("qmatmul", []) if "%copy" in r]
    for m in sorted({r["M"] for r in q}):
        picked = [r for r in q if r["M"] == m]
        left.plot([f"{r['type']}\n{r['N']}x{r['K']}" for r in picked], [float(r["%copy"]) for r in picked],
                  "o", label=f"M={m}")
    left.set_ylabel("% of copy bandwidth")
    left.set_title("qmatmul")
    left.tick_params(axis="x", labelsize=6, rotation=90)
    left.legend(fontsize=7)
    named = [(title.removeprefix("model "), r) for title, rows in tables.items() if title.startswith("model")
             for r in rows if "decode_tok_s" in r]
    labels, models = [f"{name}\n{r['layers']} layers" for name, r in named], [r for _, r in named]
    right.bar([i - 0.2 for i in range(len(models))], [float(r["decode_tok_s"]) for r in models], 0.4, label="decode")
    right.bar([i + 0.2 for i in range(len(models))], [float(r["roofline_tok_s"]) for r in models], 0.4,
              label="roofline")
    right.set_xticks(range(len(models)), labels)
    right.set_ylabel("tokens/s")
    right.set_title("model decode")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Run every stage, write gpu.md, gpu.csv and gpu.png, and return one summary row per table."""
    if device.type != "cuda" and not args.dry_run:
        raise UsageError("bench.py gpu needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "--dry-run runs the same pipeline at smoke size on this machine")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = f"Device: {machine(device)}." + (" Dry run: smoke sizes, no GPU figure." if args.dry_run else "")
    report = Report()
    report.add("native kernel tests", lambda: native_tests(args.dry_run, out / "tests.log"),
               "pytest with DS4_TEST_DEVICE=" + ("cpu (interpreter; dry run)" if args.dry_run else "cuda"))
    op_tables(report, device, args.dry_run, args.reps)
    model_tables(report, device, args.dry_run, args.reps)
    spec_table(report, device, args.dry_run)
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    report.add("compile report", lambda: compile_report(props),
               "read from the kernels compiled by the stages above; occupancy estimated from registers, shared "
               "memory and warps")
    (out / "gpu.md").write_text(markdown(report, header))
    write_csv(report, out / "gpu.csv")
    plot(report, out / "gpu.png")
    print(f"# gpu: wrote gpu.md, gpu.csv, gpu.png and tests.log into {out}", file=sys.stderr)
    return [{"table": t.title, "rows": len(t.rows), "seconds": f"{t.seconds:.1f}",
             "status": "error" if "error" in t.rows[0] else "ok"} for t in report.tables]


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the GPU check."""
    p.add_argument("--dry-run", action="store_true", help="smoke sizes on the CPU (the interpreter for the tests)")
    p.add_argument("--out", default="gpu-check", help="folder for gpu.md, gpu.csv and gpu.png (default gpu-check)")
