"""The tiny model with `--backend triton` under the interpreter: the torch backend's greedy tokens, and
every op that has a Triton implementation served by it (none silently by the reference).

One short prompt (4 tokens, 2 generated: a prefill and a decode step crossing a compression block),
because the interpreter runs every kernel program in Python.
"""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ds4
from backends.registry import OPS, OpSet, implementations
from ds4.session import Session
from ds4.tiny.build import tiny_model_weights
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4
from ops.qmatmul import SMALL_M

pytestmark = pytest.mark.on_device  # CUDA when present, else the interpreter (tests/devices.py)

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "generate.py"
PROMPT = "0,5,9,17"


def test_triton_backend_generates_torch_greedy_tokens(tiny_gguf):
    base, _ = tiny_gguf
    engine = ds4.load(base, None, backend="torch")
    want = [t.id for t in engine.generate([int(i) for i in PROMPT.split(",")], max_tokens=2) if t.id >= 0]
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", base, "--prompt-ids", PROMPT, "-n", "2", "--json",
                        "--backend", "triton", "--explain-backends"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["generated_ids"] == want
    served = out["backends"]
    missing = [op for op in OPS if "triton" not in implementations(op)]
    assert not missing, f"ops without a Triton kernel: {missing}"
    for op, r_op in served.items():
        assert r_op["backend"] == "triton", f"{op} served by {r_op['backend']} under --backend triton"
    # the model reaches fp8_sim only inside store_rows, hc_pre inside hc_pre_norm, grouped_qmatmul inside
    # attention_output, qmatmul_norm_rope inside attention_input, moe and shared_expert inside ffn
    inside = {"fp8_sim", "hc_pre", "grouped_qmatmul", "qmatmul_norm_rope", "moe", "shared_expert"}
    unused = set(OPS) - inside - set(served)
    assert not unused, f"ops never called: {sorted(unused)}"
    assert "sparse_attention  triton" in r.stderr     # --explain-backends prints the same table


def test_auto_gives_every_kernel_to_triton_on_cuda():
    """Under `auto`, an OpSet on a CUDA device resolves every op that has a Triton kernel to it (resolution
    needs no GPU here: the interpreter makes the backend runnable); on the CPU, auto never picks Triton.
    The Triton OpSet is batch-invariant, so strict speculative decoding verifies in one batched pass."""
    cuda, cpu = OpSet("auto", device="cuda"), OpSet("auto", device="cpu")
    for op in OPS:
        impl, how = cuda.resolve(op)
        want = "triton" if "triton" in implementations(op) else "torch"
        assert (impl.backend, how) == (want, "auto"), op
        assert cpu.resolve(op)[0].backend == ("cpu" if "cpu" in implementations(op) else "torch")  # never triton
    assert OpSet("triton").batch_invariant() and cuda.batch_invariant()


def test_triton_verify_forward_equals_successive_decodes(device):
    """Strict speculation's premise on the Triton backend: a 3-row forward (a verify) gives the logits and
    the session state of 3 one-token decodes bit for bit, on a 2-layer model (ratios 4 and 16) whose
    positions 5..7 complete a ratio-4 block and reach the indexer."""
    md, base, _ = tiny_model_weights(seed=5, n_layers=2, compress_ratios=(4, 16), n_hash_layers=1)
    trunk = DeepseekV4(ModelArgs.from_metadata(md), base, OpSet("triton", device=device))
    session = Session(trunk, 32, SMALL_M)
    session.prefill([0, 7, 3, 11, 5])
    ref = copy.deepcopy(session, memo={id(trunk): trunk})
    decoded = torch.stack([ref.decode(t) for t in (9, 2, 4)])
    logits = session.forward([9, 2, 4])
    assert torch.equal(logits, decoded)
    want = ref.state_tensors()
    for name, t in session.state_tensors().items():
        assert torch.equal(t, want[name]), name
    assert {r["backend"] for op, r in trunk.ops.report().items() if "triton" in implementations(op)} == {"triton"}
