"""Compile every Triton kernel offline for NVIDIA architectures (no GPU needed) and report its registers, spills,
shared memory and the occupancy they allow.

`cases()` lists each kernel with the configurations its op wrapper launches at V4 Flash sizes: per quant type of
the registry that the Triton dequantizers support (qmatmul, moe, embed) and per shape class (decode/verify share
one M-independent program; prefill has its own tiles, every autotune config included). Import it without
TRITON_INTERPRET: the module constants (tiles) must be the GPU's, and the interpreter's kernels cannot be compiled.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from backends.triton import attention, cache, compress, hyper, indexer, moe, norms, qmatmul, sims, verify_argmax
from backends.triton.quants import SUPPORTED
from ops.quants import TYPES


@dataclass(frozen=True)
class Arch:
    """An SM architecture's per-SM limits (CUDA occupancy calculator's figures)."""

    name: str
    capability: int
    max_warps: int
    max_blocks: int
    smem_per_sm: int  # bytes usable by blocks, per SM
    registers: int = 65536
    reserved_smem: int = 1024  # bytes the runtime keeps per block (sm_80 and later)


ARCHS = {"sm_80": Arch("sm_80", 80, 64, 32, 167936), "sm_89": Arch("sm_89", 89, 48, 24, 102400),
         "sm_90a": Arch("sm_90a", 90, 64, 32, 233472)}
MIN_WARPS_PER_SM = 8  # --check floor: fewer resident warps cannot keep enough loads in flight to stream weights
FLOATS = {"eps", "scale", "clamp", "route_scale", "sqrt_n", "rms_eps", "hc_eps"}  # fp32 scalar parameters


@dataclass(frozen=True)
class Case:
    """One kernel configuration as its wrapper launches it (stages: Triton's default 3 unless set)."""

    kernel: object
    shape: str  # "decode/verify", "prefill" or "any"
    constexprs: dict
    pointers: dict | None = None
    num_warps: int = 4
    num_stages: int = 3

    def signature(self) -> dict[str, str]:
        """Triton's type signature: constexprs, pointers (default *fp32), fp32 scalars, else i32."""
        sig = {}
        for p in self.kernel.params:
            if p.is_constexpr:
                sig[p.name] = "constexpr"
            elif p.name.endswith("_ptr"):
                sig[p.name] = (self.pointers or {}).get(p.name, "*fp32")
            else:
                sig[p.name] = "fp32" if p.name in FLOATS else "i32"
        return sig

    def label(self) -> str:
        """'name k=v ... warps=w stages=s' of the constexprs, warps and stages."""
        shown = " ".join(f"{k}={v}" for k, v in self.constexprs.items())
        return f"{self.kernel.__name__} {shown} warps={self.num_warps} stages={self.num_stages}"


@dataclass(frozen=True)
class Usage:
    """What ptxas reports for one compiled kernel on one architecture, and the occupancy that follows."""

    registers: int
    spill_bytes: int  # stack + local memory per thread
    shared: int
    blocks_per_sm: int
    warps_per_sm: int


def quant_types() -> list[str]:
    """Quant types of the registry that the Triton dequantizers support."""
    return [t for t in TYPES if t in SUPPORTED]


def cases() -> list[Case]:
    """Every kernel configuration the Triton ops launch at V4 Flash sizes."""
    U8, I64, I32 = "*u8", "*i64", "*i32"
    wq = {"w_ptr": U8, "grid_ptr": U8, "signs_ptr": U8}
    ex = {"gate_ptr": U8, "up_ptr": U8, "down_ptr": U8, "grid_ptr": U8, "signs_ptr": U8, "chosen_ptr": I32,
          "tile_start_ptr": I32, "offset_ptr": I32, "order_ptr": I32}
    small = {k: v for k, v in qmatmul.SMALL.items() if k.startswith("BLOCK")}
    out = [
        Case(sims.block_sim_kernel, "any", {"FP8": True, "BLOCK": 64, "ROWS": 16}),
        Case(sims.block_sim_kernel, "any", {"FP8": False, "BLOCK": 32, "ROWS": 32}),
        Case(sims.hadamard_kernel, "any", {"N": 128, "LOG2N": 7}),
        Case(norms.rms_norm_kernel, "any", {"HAS_WEIGHT": True, "BLOCK": norms.MAX_BLOCK}),
        Case(norms.rope_tail_kernel, "any", {"INVERSE": True, "BLOCK": 512}, {"pos_ptr": I64}),
        Case(attention.sparse_attention_kernel, "any", {"HAS_COMP": True, "BLOCK_H": 16, "BLOCK_D": 512, "BLOCK_N": 16},
             {"raw_ptr": I64, "comp_ptr": I64}, 8),
        Case(hyper.hc_pre_kernel, "any", {"S": 4, "BLOCK_S": 4, "BLOCK_D": hyper.BLOCK_D}),
        Case(hyper.hc_post_kernel, "any", {"S": 4, "BLOCK_S": 4, "BLOCK_D": hyper.BLOCK_D}),
        Case(hyper.hc_head_kernel, "any", {"S": 4, "BLOCK": hyper.ROW_BLOCK, "BLOCK_D": hyper.BLOCK_D}),
        Case(cache.store_rows_kernel, "any", {"F16": True, "N_BLOCKS": 8, "BLOCK": cache.FP8_BLOCK},
             {"slots_ptr": I64}),
        Case(compress.compress_kernel, "any", {"BLOCK_N": 128, "BLOCK_D": 16}),
        Case(compress.compress_kernel, "any", {"BLOCK_N": 8, "BLOCK_D": 64}),
        Case(indexer.index_scores_kernel, "any", {"BLOCK_N": indexer.SCORE_BLOCK_N, "BLOCK_H": 64, "BLOCK_D": 32},
             {"vis_ptr": I32}),
        Case(indexer.topk_select_kernel, "any", {"BLOCK": indexer.SELECT_BLOCK, "SLOTS": 512},
             {"vis_ptr": I64, "sel_ptr": I64}),
        Case(indexer.topk_order_kernel, "any", {"SLOTS": 512}, {"sel_ptr": I64, "vis_ptr": I64, "out_ptr": I64}),
        Case(verify_argmax.verify_argmax_kernel, "any", {"BLOCK": verify_argmax.BLOCK}, {"top1_ptr": I64}),
        Case(moe.route_kernel, "any", {"TOP_K": 6, "HASH": False, "HAS_BIAS": True, "NORMALIZE": True,
                                       "BLOCK_E": 256, "BLOCK_T": 16},
             {"tid_ptr": I32, "ids_ptr": I64, "chosen_ptr": I32}),
        Case(qmatmul.sum_splits_kernel, "decode/verify", {"SPLITS": 4, "BLOCK": 1024}),
    ]
    for q in quant_types():
        out.append(Case(cache.embed_kernel, "any", {"QTYPE": q, "BLOCK_D": cache.EMBED_BLOCK},
                        {"table_ptr": "*u8", "ids_ptr": I64, "grid_ptr": U8, "signs_ptr": U8}))
        out.append(Case(qmatmul.qmatmul_kernel, "decode/verify", {"QTYPE": q, **small}, wq, qmatmul.SMALL["num_warps"],
                        qmatmul.SMALL["num_stages"]))
        for config in qmatmul.PREFILL_CONFIGS:
            out.append(Case(qmatmul.qmatmul_kernel, "prefill", {"QTYPE": q, **config.kwargs}, wq, config.num_warps,
                            config.num_stages))
        gemv = {k: moe.GEMV[k] for k in ("BLOCK_N", "BLOCK_K")}
        gemm = {k: moe.GEMM[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
        out += [
            Case(moe.expert_swiglu_kernel, "decode/verify", {"TOP_K": 6, "GATE": q, "UP": q, **gemv}, ex,
                 moe.GEMV["num_warps"]),
            Case(moe.expert_down_kernel, "decode/verify", {"TOP_K": 6, "DOWN": q, **gemv}, ex, moe.GEMV["num_warps"]),
            Case(moe.grouped_swiglu_kernel, "prefill", {"TOP_K": 6, "GATE": q, "UP": q, "BLOCK_E": 256, **gemm}, ex,
                 moe.GEMM["num_warps"]),
            Case(moe.grouped_down_kernel, "prefill", {"DOWN": q, "BLOCK_E": 256, **gemm}, ex, moe.GEMM["num_warps"]),
        ]
    return out


def resources(cubin: bytes) -> dict[str, int]:
    """cuobjdump's resource line for a one-kernel cubin: {'REG': n, 'STACK': n, 'SHARED': n, 'LOCAL': n, ...}."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return {k: int(v) for k, v in re.findall(r"([A-Z]+):(\d+)", text.rsplit("Function", 1)[-1])}


def occupancy(arch: Arch, registers: int, shared: int, warps: int) -> tuple[int, int]:
    """(blocks, warps) resident per SM: registers per warp in units of 256, shared memory plus 1 KB per block."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_registers = (arch.registers // per_warp) // warps
    by_shared = arch.smem_per_sm // (shared + arch.reserved_smem)
    blocks = min(by_registers, by_shared, arch.max_warps // warps, arch.max_blocks)
    return blocks, blocks * warps


def compile_case(case: Case, arch: Arch) -> Usage:
    """Compile `case` for `arch` with the wheel's ptxas and read its resource usage."""
    source = ASTSource(fn=case.kernel, signature=case.signature(), constexprs=case.constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch.capability, 32),
                            options={"num_warps": case.num_warps, "num_stages": case.num_stages})
    usage = resources(kernel.asm["cubin"])
    shared = max(kernel.metadata.shared, usage.get("SHARED", 0))
    blocks, warps = occupancy(arch, usage["REG"], shared, case.num_warps)
    return Usage(usage["REG"], usage.get("STACK", 0) + usage.get("LOCAL", 0), shared, blocks, warps)


def report(archs: list[str], match: str | None = None, types: list[str] | None = None) -> Iterator[dict]:
    """A row per (case, arch) as each compiles; only labels containing `match`, quant types in `types`."""
    for case in cases():
        qtype = next((v for k, v in case.constexprs.items() if k in ("QTYPE", "GATE", "DOWN")), None)
        if match and match not in case.label() or types and qtype is not None and qtype not in types:
            continue
        for name in archs:
            u = compile_case(case, ARCHS[name])
            arch = ARCHS[name]
            yield {"kernel": case.label(), "shape": case.shape, "arch": name, "regs": u.registers,
                   "spill_B": u.spill_bytes, "smem_B": u.shared, "blocks_SM": u.blocks_per_sm,
                   "warps_SM": u.warps_per_sm, "occupancy": f"{100 * u.warps_per_sm / arch.max_warps:.0f}%",
                   "ok": failure(u) or "yes"}


def failure(u: Usage) -> str:
    """Why a compiled kernel fails the check ('' if it passes): a spill, or fewer warps per SM than the floor."""
    if u.spill_bytes:
        return f"SPILLS {u.spill_bytes} B"
    if u.warps_per_sm < MIN_WARPS_PER_SM:
        return f"OCCUPANCY {u.warps_per_sm} warps/SM < {MIN_WARPS_PER_SM}"
    return ""
