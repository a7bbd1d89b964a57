"""Carry a trained adapter over to another Whisper encoder (an encoder swap).

The decoder's LoRA factors of a trained adapter read the projector's output embeddings, one
per 4 encoder frames (375 per 30 s window). Whisper's encoders share that frame grid, so a
projector for another encoder can be fitted by regression: on the same audio, its output at
every audio token should equal the trained projector's output on the adapter's own encoder
(mean squared error over every audio token the decoder reads, padding included). This is
feature distillation at the interface between encoder and decoder (the "hint" of FitNets,
Romero et al. 2015, with the trained projector as the teacher). The decoder's LoRA factors are
copied unchanged, so the new adapter starts where the trained lineage is, for end-to-end
training (``train --init-adapter``) to go on from, instead of the whole recipe again.

The fit has two parts. The student's second layer starts from the teacher's (both map a
576-d hidden code to the decoder's embeddings), so its first layer has to give the teacher's
hidden code: ``W_s x_s = W_t x_t`` before the GELU, a linear least-squares problem solved in
closed form (ridge regression of the teacher's pre-activations on the student's features).
Then both layers are trained together on the outputs' mean squared error (AdamW, cosine
schedule). The fit is reported on held-out ``dev`` clips after each part as the relative
squared error ``sum |y_hat - y|^2 / sum |y|^2`` and the mean cosine similarity per audio
token.

Usage::

    python -m kvsim.minivox.swap --adapter minivox/adapter.safetensors --encoder base \\
        --out base-swap.safetensors
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from kvsim.trace.atomic import atomic_file

from .align import FRAMES_PER_TOKEN, projector
from .build import adapter_encoder, metadata_value, read_adapter, save_adapter, split_adapter
from .data import read_manifest
from .modeling import WHISPER_ENCODERS
from .options import add_options, option
from .train import cosine_lr, encoder_cache, encoder_cache_dir


@dataclass
class SwapConfig:
    """Encoder-swap settings; each field is a command-line option of :func:`parse_args`."""

    adapter: Path = option(Path("minivox/adapter.safetensors"), "the trained adapter (teacher)")
    encoder: str = option("base", "the Whisper encoder the new adapter reads",
                          choices=sorted(WHISPER_ENCODERS))
    out: Path = option(Path("data/minivox/swap.safetensors"), "where the new adapter is written")
    data: Path = option(Path("data/minivox"), "corpus folder (python -m kvsim.minivox.data)")
    train_split: str = option("train_wide", "the split whose first --clips clips it fits on")
    clips: int = option(1500, "training clips")
    dev_clips: int = option(24, "held-out dev clips the fit is reported on (24: all of dev)")
    epochs: float = option(4.0, "passes over the training tokens after the least-squares start "
                                "(cosine learning-rate schedule; 0: the least-squares fit alone)")
    ridge: float = option(1e-4, "ridge of the least-squares first layer, relative to the mean "
                                "diagonal of the features' Gram matrix")
    batch_tokens: int = option(4096, "audio tokens per step")
    lr: float = option(1e-3, "peak learning rate (AdamW)")
    seed: int = option(0, "seed of the token order")
    threads: int = option(1, "torch intra-op threads")


def parse_args(argv: list[str] | None = None) -> SwapConfig:
    ap = argparse.ArgumentParser(description="carry a trained minivox adapter over to another "
                                             "Whisper encoder (projector distilled, LoRA copied)")
    add_options(ap, SwapConfig)
    return SwapConfig(**vars(ap.parse_args(argv)))


def stack_frames(features: torch.Tensor) -> torch.Tensor:
    """Encoder frames ``(n * 1500, d)`` as the projector reads them: ``(n * 375, 4 d)``."""
    return features.reshape(-1, FRAMES_PER_TOKEN * features.shape[-1])


def encoder_tokens(data: Path, groups: list[list[dict]], encoder: str) -> list[torch.Tensor]:
    """Per group of rows, their stacked encoder outputs on ``encoder``, concatenated (float16;
    from the corpus's encoder cache, computed and cached where missing; the model built once)."""
    from .build import build_base

    model, proc = build_base(encoder=encoder)
    cache = encoder_cache_dir(data, encoder)
    with torch.no_grad():
        return [torch.cat([stack_frames(encoder_cache(model, proc, r, cache)).half() for r in rows])
                for rows in groups]


def teacher_projector(projector_state: dict[str, torch.Tensor]) -> nn.Sequential:
    """The adapter's projector as a module (float32, frozen)."""
    hidden, features = projector_state["linear_1.weight"].shape
    proj = projector(features, None, hidden)
    proj[0].weight.data.copy_(projector_state["linear_1.weight"].float())
    proj[2].weight.data.copy_(projector_state["linear_2.weight"].float())
    return proj.requires_grad_(False)


@torch.no_grad()
def project(proj: nn.Module, x: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """``proj`` over the rows of ``x`` in float32, a chunk at a time."""
    return torch.cat([proj(x[i:i + chunk].float()) for i in range(0, len(x), chunk)])


@torch.no_grad()
def fit_quality(student: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Relative squared error and mean per-token cosine similarity of ``student(x)`` to ``y``."""
    y_hat = project(student, x)
    rel = float(((y_hat - y) ** 2).sum() / (y ** 2).sum())
    cos = float(nn.functional.cosine_similarity(y_hat, y, dim=-1).mean())
    return {"relative_error": rel, "cosine": cos}


def describe(quality: dict[str, float]) -> str:
    """A fit's relative error and cosine, in words."""
    return f"relative error {quality['relative_error']:.4f}, cosine {quality['cosine']:.4f}"


def least_squares_layer(x: torch.Tensor, target: torch.Tensor, ridge: float,
                        chunk: int = 16384) -> torch.Tensor:
    """The weight ``W`` (out, in) minimising ``|x W^T - target|^2 + ridge * mean(diag(G)) |W|^2``
    with ``G = x^T x``, accumulated in float64 a chunk of rows at a time."""
    d = x.shape[1]
    gram = torch.zeros(d, d, dtype=torch.float64)
    cross = torch.zeros(d, target.shape[1], dtype=torch.float64)
    for i in range(0, len(x), chunk):
        xi = x[i:i + chunk].double()
        gram += xi.T @ xi
        cross += xi.T @ target[i:i + chunk].double()
    gram += ridge * gram.diagonal().mean() * torch.eye(d, dtype=torch.float64)
    return torch.linalg.solve(gram, cross).T.float()


def least_squares_student(x: torch.Tensor, teacher: nn.Sequential, pre: torch.Tensor,
                          ridge: float) -> nn.Sequential:
    """A projector for ``x`` (stacked student-encoder tokens): the second layer copied from the
    teacher, the first solved by :func:`least_squares_layer` for ``pre``, the teacher's
    pre-activations on the same tokens from its own encoder."""
    student = projector(x.shape[1], None, teacher[2].weight.shape[0])
    student[2].weight.data.copy_(teacher[2].weight)
    student[0].weight.data.copy_(least_squares_layer(x, pre, ridge))
    return student


def train_student(student: nn.Sequential, x: torch.Tensor, y: torch.Tensor, cfg: SwapConfig,
                  log=print) -> nn.Sequential:
    """``student`` trained on the mean squared error of its outputs on ``x`` to ``y`` for
    ``cfg.epochs`` (AdamW, warm-up and cosine schedule, ``cfg.batch_tokens`` tokens a step)."""
    if cfg.epochs <= 0:
        return student
    student.requires_grad_(True)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=0.0)
    per_epoch = max(1, len(x) // cfg.batch_tokens)
    total = max(1, round(cfg.epochs * per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_lr(s, total, total // 20))
    order = torch.Generator().manual_seed(cfg.seed)
    perm, t0 = torch.randperm(len(x), generator=order), time.time()
    for step in range(total):
        i = step % per_epoch
        if i == 0 and step:
            perm = torch.randperm(len(x), generator=order)
        idx = perm[i * cfg.batch_tokens:(i + 1) * cfg.batch_tokens]
        loss = nn.functional.mse_loss(student(x[idx].float()), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % max(1, total // 10) == 0 or step == total - 1:
            log(f"step {step + 1}/{total} mse {loss.item():.5f} ({time.time() - t0:.0f} s)")
    return student.requires_grad_(False)


def swap_meta(meta: dict[str, str], cfg: SwapConfig, source_encoder: str,
              quality: dict[str, float]) -> dict[str, object]:
    """The new adapter's metadata: its encoder, the source's step and lineage with the swap
    appended, and what the swap did and measured."""
    lineage = metadata_value(meta, "lineage", str(cfg.adapter))
    swap = {"source": str(cfg.adapter), "source_encoder": source_encoder, "clips": cfg.clips,
            "train_split": cfg.train_split, "dev_clips": cfg.dev_clips, **quality,
            "config": {k: str(v) for k, v in asdict(cfg).items()}}
    return {"encoder": cfg.encoder, "step": metadata_value(meta, "step", 0),
            "lineage": f"{lineage} -> encoder swap {source_encoder} to {cfg.encoder} "
                       f"(projector distilled on {cfg.clips} {cfg.train_split} clips)",
            "swap": swap}


def first_clips(data: Path, split: str, n: int, flag: str) -> list[dict]:
    """The first ``n`` manifest rows of ``split``; fewer is a one-line error naming ``flag``."""
    rows = read_manifest(data, split).to_dicts()[:n]
    if len(rows) < n:
        raise ValueError(f"{data}: split {split} has {len(rows)} clips, {flag} asks for {n}")
    return rows


def swap_adapter(cfg: SwapConfig, log=print) -> dict[str, float]:
    """Write ``cfg.out``: ``cfg.adapter`` carried over to ``cfg.encoder``; returns the fit on
    the dev clips."""
    tensors, meta = read_adapter(cfg.adapter)
    source = adapter_encoder(meta, cfg.adapter)
    if source == cfg.encoder:
        raise ValueError(f"{cfg.adapter}: already an adapter of Whisper {source}'s encoder")
    parts = split_adapter(tensors, torch.float32)
    if parts.encoder_lora:
        raise ValueError(f"{cfg.adapter}: trains its encoder too (encoder LoRA); the swap "
                         "distils from a frozen encoder only")
    rows = first_clips(cfg.data, cfg.train_split, cfg.clips, "--clips")
    dev = first_clips(cfg.data, "dev", cfg.dev_clips, "--dev-clips")
    teacher = teacher_projector(parts.projector)
    xt, xt_dev = encoder_tokens(cfg.data, [rows, dev], source)
    x, x_dev = encoder_tokens(cfg.data, [rows, dev], cfg.encoder)
    log(f"{len(rows)} clips, {len(x)} audio tokens ({x.shape[1]} features on {cfg.encoder}, "
        f"{xt.shape[1]} on {source})")
    pre = project(teacher[0], xt)  # the teacher's hidden code before the GELU, computed once
    del xt
    y, y_dev = project(teacher[1:], pre), project(teacher, xt_dev)
    student = least_squares_student(x, teacher, pre, cfg.ridge)
    del pre
    start = fit_quality(student, x_dev, y_dev)
    log(f"least squares: dev ({len(dev)} clips) {describe(start)}")
    student = train_student(student, x, y, cfg, log)
    quality = {**fit_quality(student, x_dev, y_dev),
               **{f"least_squares_{k}": v for k, v in start.items()}}
    log(f"trained: dev {describe(quality)}")
    state = {"linear_1.weight": student[0].weight, "linear_2.weight": student[2].weight}
    with atomic_file(cfg.out) as tmp:
        save_adapter(tmp, state, parts.lora, swap_meta(meta, cfg, source, quality))
    return quality


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    try:
        swap_adapter(cfg)
    except (FileNotFoundError, ValueError) as e:  # a missing or wrong adapter or split: one line
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {cfg.out}")


if __name__ == "__main__":
    main()
