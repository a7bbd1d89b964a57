"""Stage-1 projector alignment with CTC through the decoder's own embedding table.

The projector (Linear(4*384 -> 576) + GELU + Linear(576 -> 576), as in Voxtral; 4*512 inputs
on Whisper base's encoder, ``--encoder base``) maps each audio token (4 stacked Whisper
frames, 80 ms) into SmolLM2's input-embedding space. Stage 1 trains it alone, without any
decoder forward, with a connectionist temporal classification (CTC) loss whose classifier is
the *frozen* SmolLM2 embedding matrix ``E``: the score of BPE
token ``v`` at audio token ``t`` is ``s * cos(proj(x_t), E_v)`` (fixed ``s``) and a learned
direction scores the CTC blank. CTC finds the alignment itself, so the projector learns to place, at the audio tokens
where a word is heard, a vector that points at that word's BPE embedding. The frozen decoder
then sees a "soft transcript" interleaved with blanks, which the end-to-end stage
(``train.py --init-projector``) only has to learn to copy (a far easier task than discovering
the alignment from the next-token loss alone, which plateaued at the text-only loss).

Targets are the normalised transcript (lower case, WnW §3.5 punctuation rule): speech carries
no case or commas; the end-to-end stage restores them. For speed the softmax runs over the BPE
tokens that occur in the training transcripts (8k of SmolLM2's 49k) plus the blank.

Usage::

    python -m kvsim.minivox.align --data data/minivox --out data/minivox/align.safetensors
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from kvsim.wer import corpus_wer, normalize

from .data import read_manifest
from .modeling import DEFAULT_ENCODER, WHISPER_ENCODERS
from .options import add_options, option
from .train import encoder_cache, encoder_cache_dir, encoder_cache_file, warn_if_bf16_slow

FRAMES_PER_TOKEN = 4
TOKENS_PER_S = 12.5


def valid_tokens(duration_s: float, n_tokens: int) -> int:
    """Audio tokens that hold audio (the rest of the last 30 s window is zero padding)."""
    return min(n_tokens, int(math.ceil(duration_s * TOKENS_PER_S)) + 2)


def ctc_targets(text: str, tok) -> list[int]:
    """SmolLM2 BPE ids of the normalised transcript."""
    return tok(normalize(text), add_special_tokens=False)["input_ids"]


class CTCHead(nn.Module):
    """CTC scores of (blank, vocab...): scaled cosine between the projector output and the
    frozen embedding rows (the blank's direction is learned).

    The scale is fixed, not learned: with a learned temperature (or plain dot products) CTC is
    satisfied by outputs whose token-specific part is a few percent of a shared direction
    (measured: median best cosine to any embedding 0.07), which the frozen decoder cannot
    read. With a fixed scale the only way to a confident prediction is an output that points
    at the token's embedding.
    """

    def __init__(self, emb_rows: torch.Tensor, scale: float | None = 20.0) -> None:
        super().__init__()
        self.scale = scale
        if scale is None:  # dot products with a learned temperature (the first run; see above)
            self.register_buffer("emb", emb_rows)
            self.blank = nn.Parameter(torch.zeros(emb_rows.shape[1]))
            self.log_scale = nn.Parameter(torch.tensor(0.0))
        else:
            self.register_buffer("emb", F.normalize(emb_rows, dim=-1))  # (V, 576), frozen
            self.blank = nn.Parameter(F.normalize(torch.randn(emb_rows.shape[1]), dim=0))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            w = torch.cat([self.blank[None], self.emb.to(y.dtype)])
            return (y @ w.T) * self.log_scale.exp()
        w = torch.cat([F.normalize(self.blank, dim=0)[None], self.emb])
        return F.normalize(y, dim=-1) @ w.T * self.scale


def greedy_decode(logits: torch.Tensor, length: int) -> list[int]:
    """Collapse repeats, drop blanks (index 0); returns compact vocab indices (1-based)."""
    best = logits[:length].argmax(-1).tolist()
    out, prev = [], 0
    for b in best:
        if b != prev and b != 0:
            out.append(b)
        prev = b
    return out


def length_batches(items, batch_tokens: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffled batches of clips of similar length, each at most ``batch_tokens`` padded tokens."""
    lengths = np.array([x.shape[0] for x, _, _ in items])
    order = np.argsort(lengths + rng.random(len(items)), kind="stable")  # random ties
    batches, cur = [], []
    for k in order:
        if cur and (len(cur) + 1) * lengths[k] > batch_tokens:
            batches.append(np.array(cur))
            cur = []
        cur.append(k)
    if cur:
        batches.append(np.array(cur))
    return [batches[i] for i in rng.permutation(len(batches))]


def load_split(data: Path, splits: list[str], tok, cache: Path, encode, encoder_dim: int):
    """(features fp16 (T, 4 * encoder_dim), target ids, text) per clip; ``encode(row)``
    computes (and caches) the encoder output of a clip that is not in ``cache`` yet."""
    items = []
    for split in splits:
        for r in tqdm(read_manifest(data, split).to_dicts(), desc=f"load {split}", mininterval=10):
            f = encoder_cache_file(r, cache)
            h = np.load(f) if f.is_file() else encode(r).numpy().astype(np.float16)
            x = h.reshape(-1, encoder_dim * FRAMES_PER_TOKEN)
            x = x[: valid_tokens(r["duration"], x.shape[0])]
            items.append((torch.from_numpy(np.ascontiguousarray(x)), ctc_targets(r["text"], tok),
                          r["text"]))
    return items


@dataclass
class AlignConfig:
    """Stage-1 settings; each field is a command-line option of :func:`parse_args`."""

    data: Path = option(Path("data/minivox"), "corpus folder (python -m kvsim.minivox.data)")
    out: Path = option(Path("data/minivox/align.safetensors"),
                       "where the projector is written once the run has ended")
    seed: int = option(0, "seed of the projector's initialisation and the batch order")
    epochs: float = option(6.0, "length of the one-cycle learning-rate schedule, in epochs")
    batch_tokens: int = option(6000, "audio tokens per batch (clips of similar length are "
                                     "batched together)")
    lr: float = option(2e-3, "peak learning rate (AdamW, one-cycle)")
    eval_every: int = option(200, "steps between greedy CTC dev-WER evaluations")
    max_minutes: float = option(60.0, "stop after this many minutes")
    scale: float = option(20.0, "fixed CTC logit scale (cosine x scale); 0: dot products with a "
                                "learned temperature (the first, unreadable variant; kept to "
                                "reproduce it)")
    init: Path | None = option(None, "start from these projector weights", type=Path)
    stop_step: int | None = option(None, "stop after this step (the lr schedule still spans "
                                         "--epochs)", type=int)
    threads: int = option(1, "torch intra-op threads")
    bf16: bool = option(True, "bf16 autocast of the projector and head (default on, as the "
                              "shipped run; use --no-bf16 on a CPU without AMX, where it is "
                              "slower)")
    encoder: str = option(DEFAULT_ENCODER, "the Whisper encoder the projector reads (tiny.en, "
                                           "the shipped model's; base: its features cached in "
                                           "enc_cache_base/)", choices=sorted(WHISPER_ENCODERS))
    train_splits: str = option("train,train_long", "comma-separated manifest splits it trains on")


def parse_args(argv: list[str] | None = None) -> AlignConfig:
    ap = argparse.ArgumentParser(description="stage-1 projector alignment (CTC via the embedding table)")
    add_options(ap, AlignConfig)
    return AlignConfig(**{k.replace("-", "_"): v for k, v in vars(ap.parse_args(argv)).items()})


Clip = tuple[torch.Tensor, list[int], str]  #: (features (T, 4 * encoder dim) fp16, target BPE ids, text)


class CTCAligner:
    """The projector and its CTC head over a compact vocabulary (blank = 0, then ``vocab``)."""

    def __init__(self, proj: nn.Module, head: CTCHead, vocab: list[int], bf16: bool) -> None:
        self.proj, self.head, self.vocab, self.bf16 = proj, head, vocab, bf16
        self.index = {t: i + 1 for i, t in enumerate(vocab)}  # 0 = blank
        self.params = list(proj.parameters()) + list(head.parameters())

    def logits(self, batch: list[Clip]) -> torch.Tensor:
        """(B, T_max, V + 1) float32 CTC scores of a zero-padded batch."""
        n = max(x.shape[0] for x, _, _ in batch)
        x = torch.zeros(len(batch), n, batch[0][0].shape[1])
        for i, (xi, _, _) in enumerate(batch):
            x[i, : xi.shape[0]] = xi.float()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            out = self.head(self.proj(x))
        return out.float()

    def loss(self, batch: list[Clip]) -> torch.Tensor:
        """Mean CTC loss of a batch (each clip's own length; infinite losses zeroed)."""
        logp = F.log_softmax(self.logits(batch), dim=-1).transpose(0, 1)  # (T, B, V+1)
        tgt = torch.tensor([self.index[t] for _, ids, _ in batch for t in ids])
        return F.ctc_loss(logp, tgt, torch.tensor([x.shape[0] for x, _, _ in batch]),
                          torch.tensor([len(ids) for _, ids, _ in batch]),
                          blank=0, zero_infinity=True)

    def transcribe(self, clips: list[Clip], decode: Callable[[list[int]], str]) -> list[str]:
        """Greedy CTC transcripts, eight clips per forward pass."""
        self.proj.eval()
        hyps = []
        with torch.no_grad():
            for i in range(0, len(clips), 8):
                b = clips[i : i + 8]
                lg = self.logits(b)
                for j, (xi, _, _) in enumerate(b):
                    hyps.append(decode([self.vocab[k - 1] for k in greedy_decode(lg[j], xi.shape[0])]))
        self.proj.train()
        return hyps

    def save(self, out: Path, step: int, wer: float) -> None:
        """The projector's weights (atomically: a temporary file, then a rename)."""
        sd = {"linear_1.weight": self.proj[0].weight.detach().contiguous(),
              "linear_2.weight": self.proj[2].weight.detach().contiguous()}
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        save_file(sd, str(tmp), metadata={"format": "minivox-projector-init", "method": "ctc",
                                          "in_features": str(self.proj[0].in_features),
                                          "steps": str(step), "dev_ctc_wer": f"{wer:.4f}"})
        tmp.replace(out)


def projector(feature_dim: int, init: Path | None, width: int = 576) -> nn.Sequential:
    """Linear(feature_dim -> width) + GELU + Linear(width -> width), optionally from saved
    weights; ``width`` is the decoder's (576: SmolLM2-135M's)."""
    proj = nn.Sequential(nn.Linear(feature_dim, width, bias=False), nn.GELU(),
                         nn.Linear(width, width, bias=False))
    if init is not None:
        from safetensors.torch import load_file

        w = load_file(str(init))
        if w["linear_1.weight"].shape[1] != feature_dim:
            raise ValueError(f"{init}: a projector for {w['linear_1.weight'].shape[1]} input "
                             f"features, this encoder gives {feature_dim} (--encoder)")
        proj[0].weight.data.copy_(w["linear_1.weight"])
        proj[2].weight.data.copy_(w["linear_2.weight"])
    return proj


def fit(aligner: CTCAligner, train: list[Clip], cfg: AlignConfig,
        evaluate: Callable[[int], float]) -> int:
    """Train ``aligner`` by CTC on ``train``: AdamW under a one-cycle schedule over
    ``cfg.epochs``, batches from :func:`length_batches`; ``evaluate(step)`` every
    ``cfg.eval_every`` steps. Stops at ``cfg.stop_step`` or after ``cfg.max_minutes``; returns
    the steps taken."""
    opt = torch.optim.AdamW(aligner.params, lr=cfg.lr, weight_decay=0.01)
    per_epoch = len(length_batches(train, cfg.batch_tokens, np.random.default_rng(0)))
    steps = int(cfg.epochs * per_epoch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps, pct_start=0.05)
    last = min(steps, cfg.stop_step or steps)
    g = np.random.default_rng(cfg.seed)
    t0 = time.time()
    bar = tqdm(total=steps, desc="align-ctc", mininterval=10)
    step, ema = 0, None
    while step < last:
        for idx in length_batches(train, cfg.batch_tokens, g):
            loss = aligner.loss([train[k] for k in idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(aligner.params, 1.0)
            opt.step()
            sched.step()
            step += 1
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            bar.update(1)
            bar.set_postfix(ctc=f"{ema:.3f}")
            if step % cfg.eval_every == 0:
                evaluate(step)
            if step >= last or (time.time() - t0) / 60 > cfg.max_minutes:
                break
        if (time.time() - t0) / 60 > cfg.max_minutes:
            print(f"\nstopping at step {step}: --max-minutes reached", flush=True)
            break
    bar.close()
    return step


def partial_path(out: Path) -> Path:
    """Where a run writes the projector at its intermediate evaluations: beside ``out``, named
    so that only a finished run's file has the name a script waits for."""
    return out.with_name(f"{out.stem}.partial{out.suffix}")


def fit_and_save(aligner: CTCAligner, train: list[Clip], cfg: AlignConfig,
                 dev_wer: Callable[[], float]) -> tuple[int, float]:
    """:func:`fit`, saving the projector to :func:`partial_path` at every evaluation and to
    ``cfg.out`` only once the run has ended (the partial file then removed): an interrupted
    run leaves no file at ``cfg.out`` (``scripts/train_minivox.sh`` skips a stage whose output
    exists). Returns (steps, final dev CTC WER)."""
    partial = partial_path(cfg.out)

    def evaluate(step: int) -> float:
        wer = dev_wer()
        aligner.save(partial, step, wer)
        return wer

    step = fit(aligner, train, cfg, evaluate)
    wer = dev_wer()
    aligner.save(cfg.out, step, wer)
    partial.unlink(missing_ok=True)
    return step, wer


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    warn_if_bf16_slow(cfg.bf16)

    from transformers import AutoTokenizer

    from .build import build_base

    base = _untrained_dir()
    tok = AutoTokenizer.from_pretrained(str(base))
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        key = next(k for k in f.keys() if k.endswith("embed_tokens.weight"))  # noqa: SIM118
        emb = f.get_tensor(key).float()

    cache = encoder_cache_dir(cfg.data, cfg.encoder)
    # only its encoder: clips not in the cache yet
    model, proc = build_base(seed=cfg.seed, encoder=cfg.encoder)
    encoder_dim = model.config.audio_config.hidden_size

    def encode(row: dict) -> torch.Tensor:
        return encoder_cache(model, proc, row, cache)

    train = load_split(cfg.data, cfg.train_splits.split(","), tok, cache, encode, encoder_dim)
    dev = load_split(cfg.data, ["dev"], tok, cache, encode, encoder_dim)
    model = None
    vocab = sorted({t for _, ids, _ in train for t in ids})
    n_tok = sum(x.shape[0] for x, _, _ in train)
    print(f"{len(train)} clips, {n_tok} audio tokens, CTC vocab {len(vocab)} + blank", flush=True)
    proj = projector(encoder_dim * FRAMES_PER_TOKEN, cfg.init)
    aligner = CTCAligner(proj, CTCHead(emb[torch.tensor(vocab)], cfg.scale or None), vocab, cfg.bf16)

    def dev_wer() -> float:
        hyps = aligner.transcribe(dev, tok.decode)
        wer = corpus_wer(hyps, [t for _, _, t in dev], tok)
        print(f"\n  dev CTC WER {wer:.4f} | {hyps[0][:150]!r}", flush=True)
        return wer

    t0 = time.time()
    step, wer = fit_and_save(aligner, train, cfg, dev_wer)
    print(f"wrote {cfg.out} after {step} steps ({time.time() - t0:.0f} s), dev CTC WER {wer:.4f}")


def _untrained_dir() -> Path:
    from .build import ensure_cached

    return ensure_cached(adapter=None, untrained=True)


if __name__ == "__main__":
    main()
