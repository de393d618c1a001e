"""Train the embedded default model: a tiny DeepSeek V4 + MTP head on Python stdlib sources, then export GGUFs.

    python scripts/train_tiny.py --out-dir runs/tiny [--minutes 30] [--max-steps N] [--size default|smoke]

The trunk is transformers' `DeepseekV4ForCausalLM` with every V4 feature on (mHC, hash-routed first layers
with a fixed random token->expert table, ratio-4 layers whose indexer keeps fewer rows than exist, a
ratio-16 layer, routed + shared experts); the MTP head is one more sliding-window decoder layer from the same
code, trained at the official pairing (trunk state at i with token i+1 predicts token i+2). The indexer,
which gets no gradient from the LM loss, learns from a KL loss to the main attention over compressed rows.
Copying is taught by a curriculum: short random-token repeats first, then code with repeated passages.
Writes base + MTP GGUFs (q2 mix), the HF checkpoint, a loss-curve PNG and a JSON report to --out-dir.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from ds4.errors import Ds4Error, UsageError
from ds4.formats.convert import convert
from ds4.formats.quant_mix import MIXES
from ds4.formats.vocab import v4_pre_tokenizer
from ds4.tiny.vocab import TINY_ADDED

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
SEED = 0


@dataclass(frozen=True)
class Size:
    """Model and run sizes."""

    vocab: int
    dim: int
    layers: tuple[str, ...]
    n_hash: int
    heads: int
    seq: int
    batch: int
    window: int
    index_topk: int
    max_files: int  # stdlib files read (0: all)


SIZES = {
    "default": Size(vocab=2048, dim=256, layers=(SWA, CSA, HCA, CSA), n_hash=2, heads=4, seq=256, batch=8,
                    window=64, index_topk=8, max_files=0),
    "smoke": Size(vocab=320, dim=256, layers=(SWA, CSA, HCA), n_hash=1, heads=4, seq=64, batch=2,
                  window=16, index_topk=2, max_files=20),
}


@dataclass(frozen=True)
class Recipe:
    """Loss weights and data mix of a run (the defaults made the shipped model)."""

    mtp_weight: float = 1.0      # weight of the MTP loss beside the LM loss
    mtp_distill: float = 1.0     # share of the MTP loss that is KL to the trunk's own next-token distribution
    random_until: float = 0.1    # share of the run that sees only random-token repeats
    repeat_share: float = 0.2    # after that: share of random-token repeats,
    copy_share: float = 0.5      # and of code with repeated passages (the rest is plain code)


def model_config(s: Size) -> DeepseekV4Config:
    """The transformers config: sizes that fit the q2 mix (expert rows of 256) and ds4py's FP8 KV blocks."""
    return DeepseekV4Config(
        vocab_size=s.vocab, hidden_size=s.dim, moe_intermediate_size=256, num_hidden_layers=len(s.layers),
        num_attention_heads=s.heads, head_dim=80, qk_rope_head_dim=16, q_lora_rank=128, o_groups=2, o_lora_rank=64,
        n_routed_experts=8, num_experts_per_tok=2, index_n_heads=4, index_head_dim=32, index_topk=s.index_topk,
        sliding_window=s.window, layer_types=list(s.layers),
        mlp_layer_types=["hash_moe"] * s.n_hash + ["moe"] * (len(s.layers) - s.n_hash),
        compress_rates={CSA: 4, HCA: 16},
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=16384, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)


class MTPLayer(hf.DeepseekV4DecoderLayer):
    """The MTP block: embedding/state projections, one sliding-window decoder layer, its own HC head and norm."""

    def __init__(self, config: DeepseekV4Config):
        cfg = DeepseekV4Config(**{**config.to_dict(), "num_hidden_layers": 1, "layer_types": [SWA],
                                  "mlp_layer_types": ["moe"]})
        super().__init__(cfg, 0)
        D = cfg.hidden_size
        cfg._attn_implementation, cfg._experts_implementation = "eager", config._experts_implementation
        self.config = cfg
        self.e_proj, self.h_proj = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.enorm, self.hnorm = hf.DeepseekV4RMSNorm(D, cfg.rms_norm_eps), hf.DeepseekV4RMSNorm(D, cfg.rms_norm_eps)
        self.norm = hf.DeepseekV4RMSNorm(D, cfg.rms_norm_eps)
        self.head = hf.DeepseekV4HyperHead(cfg)

    def state_dict_for_convert(self) -> dict[str, torch.Tensor]:
        """Tensors under the `mtp.0.` names that ds4/formats/convert.py reads (official names for the HC head)."""
        head = {"hc_fn": "hc_head_fn", "hc_base": "hc_head_base", "hc_scale": "hc_head_scale"}
        out = {}
        for name, t in self.state_dict().items():
            if name.startswith("head."):
                name = head[name.removeprefix("head.")]
            out["mtp.0." + name] = t.detach().contiguous().clone()
        return out


def mtp_forward(model: DeepseekV4ForCausalLM, mtp: MTPLayer, states: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """MTP logits [B, T-1, V] of rows j = 1..T-1: (trunk state H_{j-1}, token t_j) at position j predicts t_{j+1}."""
    B, T = ids.shape
    tokens = ids[:, 1:]
    e = mtp.e_proj(mtp.enorm(model.model.embed_tokens(tokens)))
    X = mtp.h_proj(mtp.hnorm(states[:, :-1])) + e[:, :, None, :]
    pos = torch.arange(1, T)[None].expand(B, -1)
    rope = {"main": model.model.rotary_emb(e, position_ids=pos, layer_type="main"),
            "compress": model.model.rotary_emb(e, position_ids=pos, layer_type="compress")}
    mask = create_sliding_window_causal_mask(config=mtp.config, inputs_embeds=e, attention_mask=None,
                                             past_key_values=None, position_ids=pos - 1)
    X = mtp(X, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=tokens)
    return model.lm_head(mtp.norm(mtp.head(X)))


class Probe:
    """Forward hooks: the trunk's final HC states, and per ratio-4 layer the indexer scores and attention weights."""

    def __init__(self, model: DeepseekV4ForCausalLM):
        self.states: torch.Tensor | None = None
        self.scores: dict[int, torch.Tensor] = {}
        self.attn: dict[int, torch.Tensor] = {}
        model.model.layers[-1].register_forward_hook(lambda m, i, o: setattr(self, "states", o))
        for n, layer in enumerate(model.model.layers):
            if layer.self_attn.layer_type == CSA:
                layer.self_attn.compressor.indexer.scorer.register_forward_hook(self._keep(self.scores, n))
                layer.self_attn.register_forward_hook(self._keep(self.attn, n, 1))

    @staticmethod
    def _keep(store: dict, n: int, index: int | None = None):
        def hook(module, inputs, output):
            store[n] = output if index is None else output[index]
        return hook


def mtp_loss(mtp_logits: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, distill: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, cross-entropy to token i+2): (1 - distill) x that cross-entropy + distill x KL(trunk || MTP)."""
    # the trunk's (detached) distribution for token i+2 is what a draft is verified against
    logq = mtp_logits[:, :-1].flatten(0, 1).log_softmax(-1)
    ce = F.nll_loss(logq, ids[:, 2:].flatten())
    if not distill:
        return ce, ce
    logp = logits[:, 1:-1].detach().flatten(0, 1).log_softmax(-1)
    return (1 - distill) * ce + distill * F.kl_div(logq, logp, log_target=True, reduction="batchmean"), ce


def indexer_kl(probe: Probe, T: int, ratio: int = 4) -> torch.Tensor:
    """KL(main attention over compressed rows, summed over heads || softmax of the indexer scores), mean over
    queries that see at least one row; the attention target is detached (the indexer learns, attention does not)."""
    losses = []
    visible = torch.arange(T // ratio)[None, :] < ((torch.arange(T) + 1) // ratio)[:, None]  # [T, rows]
    rows_seen = visible.any(-1)
    for n, scores in probe.scores.items():
        target = probe.attn[n][..., T:].detach().sum(1)  # [B, T, rows]: attention mass on compressed rows
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-9)
        logq = scores.masked_fill(~visible, float("-inf")).log_softmax(-1)
        kl = (target * (target.clamp_min(1e-9).log() - logq.masked_fill(~visible, 0))).sum(-1)
        losses.append(kl[:, rows_seen].mean())
    return torch.stack(losses).mean()


def stdlib_files() -> list[Path]:
    """The standard library's top-level .py files and packages (no tests, no site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "site-packages", "idlelib", "lib2to3", "turtledemo", "__pycache__", "dist-packages")
    return sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts) & set(skip))


def train_tokenizer(texts: list[str], vocab: int) -> HFTokenizer:
    """A byte-level BPE with the V4 pre-tokenizer and the V4 chat/special tokens first."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = v4_pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, show_progress=False,
                                  special_tokens=[t for t, _ in TINY_ADDED],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


@dataclass
class Corpus:
    """Token streams for training and held-out evaluation, and the sampler of training sequences."""

    train: torch.Tensor
    held_out: torch.Tensor
    first_normal: int  # ids below are special tokens
    vocab: int
    rng: random.Random = field(default_factory=lambda: random.Random(SEED))

    def random_repeat(self, T: int) -> list[int]:
        """A random-token passage of 4..32 tokens, repeated to fill T tokens."""
        n = self.rng.randint(4, 32)
        passage = [self.rng.randrange(self.first_normal, self.vocab) for _ in range(n)]
        return (passage * (T // n + 1))[:T]

    def code(self, T: int) -> list[int]:
        """A random window of the training code."""
        start = self.rng.randrange(0, len(self.train) - T)
        return self.train[start:start + T].tolist()

    def code_with_repeats(self, T: int) -> list[int]:
        """Code in which a passage of 8..48 tokens is followed by 1-3 copies of itself, more code around it."""
        out: list[int] = []
        while len(out) < T:
            chunk = self.code(self.rng.randint(8, 48))
            out += self.code(self.rng.randint(0, 48)) + chunk * self.rng.randint(2, 4)
        return out[:T]

    def batch(self, B: int, T: int, progress: float, recipe: Recipe) -> torch.Tensor:
        """B sequences: random repeats only at first, then the recipe's mix of repeats, repeated code and code."""
        kinds = []
        for _ in range(B):
            r = self.rng.random()
            if progress < recipe.random_until or r < recipe.repeat_share:
                kinds.append(self.random_repeat(T))
            elif r < recipe.repeat_share + recipe.copy_share:
                kinds.append(self.code_with_repeats(T))
            else:
                kinds.append(self.code(T))
        return torch.tensor(kinds)


def build_corpus(size: Size, out: Path) -> tuple[Corpus, HFTokenizer, int]:
    """Read the stdlib, train the BPE (saved as out/hf/tokenizer.json), split files 19:1 into train/held-out."""
    files = stdlib_files()
    if size.max_files:
        files = files[:size.max_files]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    tok = train_tokenizer(texts, size.vocab)
    (out / "hf").mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "hf" / "tokenizer.json"))
    eos = tok.token_to_id(TINY_ADDED[1][0])
    train, held = [], []
    for i, text in enumerate(texts):
        (held if i % 20 == 19 else train).extend(tok.encode(text).ids + [eos])
    n_chars = sum(len(t) for t in texts)
    return Corpus(torch.tensor(train), torch.tensor(held), len(TINY_ADDED), tok.get_vocab_size()), tok, n_chars


def init_model(cfg: DeepseekV4Config) -> tuple[DeepseekV4ForCausalLM, MTPLayer]:
    """Seeded weights; HC/sink/bias parameters near DeepSeek's init, hash tables a fixed random permutation draw."""
    torch.manual_seed(SEED)
    model, mtp = DeepseekV4ForCausalLM(cfg), MTPLayer(cfg)
    mtp.apply(model._init_weights)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                     for _ in range(b.shape[0])]))
        for m in (model, mtp):
            for name, p in m.named_parameters():
                if "experts" in name or name.endswith(("proj.weight", "lm_head.weight")) or "o_a_proj" in name:
                    nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))
                elif name.endswith("embed_tokens.weight"):
                    nn.init.normal_(p, std=1.0)
    return model, mtp


@dataclass
class Report:
    """What the run measured (written as report.json)."""

    size: str
    params: int
    mtp_params: int
    steps: int
    tokens_seen: int
    train_minutes: float
    threads: int
    corpus_chars: int
    train_tokens: int
    held_out_tokens: int
    final_loss: float
    final_mtp_loss: float
    final_indexer_kl: float
    held_out_ppl: float
    held_out_mtp_ppl: float
    unigram_ppl: float
    held_out_mtp_agreement: float = 0.0   # share of held-out rows where the MTP's top-1 is the trunk's
    recipe: dict = field(default_factory=dict)
    python: str = field(default_factory=lambda: sys.version.split()[0])
    curve: list[tuple[int, float, float, float]] = field(default_factory=list)


@torch.no_grad()
def evaluate(model, mtp, probe: Probe, corpus: Corpus, T: int, n: int = 16) -> tuple[float, float, float]:
    """Held-out trunk and MTP perplexity, and how often the MTP's top-1 is the trunk's, on n windows of T tokens."""
    model.eval()
    ids = corpus.held_out[: n * T].view(-1, T)
    logits = model(ids).logits
    mtp_logits = mtp_forward(model, mtp, probe.states, ids)
    model.train()
    lm = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    ml = F.cross_entropy(mtp_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten())
    agree = (mtp_logits[:, :-1].argmax(-1) == logits[:, 1:-1].argmax(-1)).float().mean()
    return math.exp(lm.item()), math.exp(ml.item()), agree.item()


def unigram_ppl(corpus: Corpus) -> float:
    """Held-out perplexity of the training set's add-one unigram distribution."""
    counts = torch.bincount(corpus.train, minlength=corpus.vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[corpus.held_out].mean().item())


def plot(curve: list[tuple[int, float, float, float]], unigram: float, path: Path) -> None:
    """Loss curves (LM, MTP, indexer KL) against step, with the unigram baseline."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [c[0] for c in curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, label in enumerate(("LM loss", "MTP loss (token i+2)", "indexer KL"), start=1):
        ax.plot(steps, [c[i] for c in curve], label=label)
    ax.axhline(math.log(unigram), color="gray", ls="--", label="unigram baseline (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@dataclass
class Trained:
    """A finished run: its report and the trained transformers trunk and MTP layer (in eval mode)."""

    report: Report
    model: DeepseekV4ForCausalLM
    mtp: MTPLayer


def train(size_name: str, out: Path, minutes: float, max_steps: int, threads: int, mix: str, log,
          recipe: Recipe = Recipe()) -> Trained:
    """Train, evaluate, save the HF checkpoint (+ mtp.safetensors) and convert it to GGUFs in `out`."""
    size = SIZES[size_name]
    torch.manual_seed(SEED)
    torch.set_num_threads(threads)
    corpus, tok, n_chars = build_corpus(size, out)
    cfg = model_config(size)
    model, mtp = init_model(cfg)
    probe = Probe(model)
    params = [p for m in (model, mtp) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    T, B, budget = size.seq, size.batch, minutes * 60
    dense_until = 0.3  # the indexer keeps every row (dense warm-up of its KL) for the first 30% of the run
    csa = [layer.self_attn.compressor.indexer for layer in model.model.layers if layer.self_attn.layer_type == CSA]
    model.train()
    t0, step, curve, ema = time.perf_counter(), 0, [], None
    while True:
        progress = max((time.perf_counter() - t0) / budget, step / max_steps)
        if progress >= 1:
            break
        for ix in csa:
            ix.index_topk = T if progress < dense_until else size.index_topk
        lr = 3e-3 * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids = corpus.batch(B, T, progress, recipe)
        logits = model(ids).logits
        lm = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        mloss, ml = mtp_loss(mtp_forward(model, mtp, probe.states, ids), logits, ids, recipe.mtp_distill)
        kl = indexer_kl(probe, T)
        opt.zero_grad(set_to_none=True)
        (lm + recipe.mtp_weight * mloss + 0.1 * kl).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        now = (lm.item(), ml.item(), kl.item())
        ema = now if ema is None else tuple(0.95 * a + 0.05 * b for a, b in zip(ema, now, strict=True))
        step += 1
        if step % 10 == 0:
            curve.append((step, *ema))
        if step % 50 == 0:
            log(f"step {step} {progress:.0%} lm {ema[0]:.3f} mtp {ema[1]:.3f} kl {ema[2]:.3f} lr {lr:.2e} "
                f"{(time.perf_counter() - t0) / 60:.1f} min")
    train_minutes = (time.perf_counter() - t0) / 60
    for ix in csa:
        ix.index_topk = size.index_topk
    ppl, mtp_ppl, agreement = evaluate(model, mtp, probe, corpus, T)
    report = Report(size_name, sum(p.numel() for p in model.parameters()), sum(p.numel() for p in mtp.parameters()),
                    step, step * B * T, round(train_minutes, 2), threads, n_chars, len(corpus.train),
                    len(corpus.held_out), *(round(x, 4) for x in (ema or (0, 0, 0))), round(ppl, 3),
                    round(mtp_ppl, 3), round(unigram_ppl(corpus), 3), round(agreement, 4), asdict(recipe), curve=curve)
    log(f"held-out perplexity {ppl:.2f} (MTP {mtp_ppl:.2f}, top-1 agreement {agreement:.1%}), "
        f"unigram {report.unigram_ppl:.2f}")
    export(model, mtp, out, mix)
    plot(curve, report.unigram_ppl, out / "loss.png")
    (out / "report.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    return Trained(report, model.eval(), mtp.eval())


def export(model: DeepseekV4ForCausalLM, mtp: MTPLayer, out: Path, mix: str) -> None:
    """Save the HF checkpoint with the MTP tensors beside it, then write tiny.gguf and tiny-mtp.gguf."""
    model.generation_config.do_sample = False
    model.save_pretrained(out / "hf")
    save_file(mtp.state_dict_for_convert(), str(out / "hf" / "mtp.safetensors"))
    convert(out / "hf", out / "tiny.gguf", out / "tiny-mtp.gguf", mix)


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, train, report errors as one line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True, help="directory for GGUFs, HF checkpoint, loss.png, report.json")
    ap.add_argument("--size", choices=sorted(SIZES), default="default")
    ap.add_argument("--minutes", type=float, default=30.0, help="training wall-clock budget")
    ap.add_argument("--max-steps", type=int, default=10**9, help="stop after this many steps")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--outtype", choices=MIXES, default="q2", help="tensor-type mix of the GGUFs")
    for f in fields(Recipe):
        ap.add_argument("--" + f.name.replace("_", "-"), type=float, default=f.default, help=f"default {f.default}")
    args = ap.parse_args(argv)
    try:
        if args.minutes <= 0 or args.max_steps < 1 or args.threads < 1:
            raise UsageError("--minutes, --max-steps and --threads must be positive")
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        recipe = Recipe(**{f.name: getattr(args, f.name) for f in fields(Recipe)})
        report = train(args.size, out, args.minutes, args.max_steps, args.threads, args.outtype,
                       lambda msg: print(msg, file=sys.stderr, flush=True), recipe).report
    except (Ds4Error, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in asdict(report).items() if k != "curve"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
