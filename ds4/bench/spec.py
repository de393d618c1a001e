"""spec: target passes per token and acceptance of MTP speculative decoding on the embedded model.

Greedy decoding of the embedded model's copy-heavy and free code prompts in every speculative mode,
then sampled with and without the MTP head: target passes per token, acceptance, tokens/s and weight MB per
token (ds4/cost.py)."""
from __future__ import annotations

import argparse

import torch

from ds4 import weights
from ds4.bench.common import machine
from ds4.cost import PassCost
from ds4.engine import load
from ds4.errors import UsageError
from ds4.speculative import SpecMetrics

# spec: raw code prompts for the embedded model, five copy-heavy ones (a passage written several times, so the MTP
# can copy it) and four free ones; each row sums the counters of its kind's prompts
SPEC_PASSAGE = "    for key, value in sorted(items.items()):\n        print(key, value)\n"
SPEC_PROMPTS = {
    "copy": ("def show(items):\n" + SPEC_PASSAGE * 3 + "\n\ndef show_again(items):\n" + SPEC_PASSAGE,
             "def add(a, b):\n    return a + b\n\n" * 3 + "def add(a, b):\n",
             "import os\nimport sys\nimport re\n" * 3 + "import os\n",
             "    if name is None:\n        raise ValueError('name')\n" * 3,
             "x = self.data[key]\ny = self.data[value]\n" * 4),
    "free": ('class Reader:\n    """Read records from a file."""\n\n    def __init__(self, path):\n',
             'def read_config(path):\n    """Read the configuration file at path."""\n',
             "import os\n\n\ndef main():\n",
             "    def __repr__(self):\n"),
}
SPEC_MODES = {"plain": dict(mtp_draft=0), "draft-2 cycle": dict(mtp_draft=2, continuous=False),
              "continuous d1": dict(mtp_draft=1), "d2": dict(mtp_draft=2), "d3": dict(mtp_draft=3),
              "d4": dict(mtp_draft=4), "auto": dict(mtp_draft="auto")}


def spec_row(engine, prompts: tuple[str, ...], kind: str, mode: str, max_tokens: int, **options) -> dict:
    """Generate raw from each of `prompts` and sum the speculative counters, the decode time and cost."""
    m, decode_s = SpecMetrics(), 0.0
    for prompt in prompts:
        list(engine.generate(prompt, raw=True, max_tokens=max_tokens, **options))
        m, decode_s = m + engine.stats.spec, decode_s + engine.stats.decode_s
    n = max(m.generated_tokens, 1)
    per_position = [round(a / m.num_drafts, 2) for a in m.accepted_per_position] if m.num_drafts else []
    return {"prompt": kind, "mode": mode, "tokens": m.generated_tokens, "passes/token": f"{m.passes_per_token:.3f}",
            "mean_accept_len": f"{m.mean_acceptance_length:.2f}",
            "accept": f"{m.num_accepted_tokens / m.num_draft_tokens:.0%}" if m.num_draft_tokens else "-",
            "accept_per_pos": " ".join(map(str, per_position)) or "-",
            "tok/s": f"{m.generated_tokens / decode_s:.1f}" if decode_s else "-",
            "MB/token": f"{PassCost(engine.args, 'q2').decode(m) / n / 1e6:.2f}"}


def rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Greedy decoding of the copy-heavy and free prompts in every speculative mode, then sampled with/without MTP."""
    if args.tokens < 1 or args.threads < 1:
        raise UsageError(f"--tokens and --threads must be >= 1 (got {args.tokens}, {args.threads})")
    torch.set_num_threads(args.threads)
    engine = load(args.model, args.mtp, ctx=1024, weights=args.weights)
    print(f"# {machine(device)}; model {engine.paths[0]}", flush=True)
    rows = [spec_row(engine, SPEC_PROMPTS[kind], kind, mode, args.tokens, **options)
            for kind in SPEC_PROMPTS for mode, options in SPEC_MODES.items()]
    for mode, draft in (("sampled plain", 0), ("sampled MTP d1", 1)):
        rows += [spec_row(engine, SPEC_PROMPTS[kind], kind, mode, args.tokens, mtp_draft=draft, temperature=0.8,
                          seed=0) for kind in SPEC_PROMPTS]
    if args.png:
        plot_spec(rows, args.png)
    return rows


def plot_spec(rows: list[dict], path: str) -> None:
    """Bar chart of target passes per committed token by mode, one bar group per prompt kind."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = list(SPEC_MODES)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for i, kind in enumerate(SPEC_PROMPTS):
        values = [float(r["passes/token"]) for mode in modes for r in rows if r["mode"] == mode and r["prompt"] == kind]
        ax.bar([x + 0.4 * i for x in range(len(modes))], values, width=0.4, label=f"{kind} prompt")
    ax.set_xticks([x + 0.2 for x in range(len(modes))], modes)
    ax.set_ylabel("target passes / committed token")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the speculative-decoding benchmark."""
    p.add_argument("--model", help="base GGUF (default: the embedded model)")
    p.add_argument("--mtp", help="MTP GGUF (default: the embedded model's)")
    p.add_argument("--tokens", type=int, default=96, help="tokens generated per run")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--weights", choices=weights.CHOICES, default="auto", help=weights.HELP)
    p.add_argument("--png", help="also write a bar chart of passes per token here")
