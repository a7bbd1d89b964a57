"""Train the minivox projector (+ LoRA on the decoder's attention projections) on CPU.

The Whisper encoder and SmolLM2 stay frozen; encoder outputs are cached on disk (fp16) the
first time a clip is seen. With ``--encoder-lora-layers N`` the encoder's last N layers get
LoRA factors too, and the encoder runs at every step instead of coming from the cache.
Loss: next-token cross-entropy on the transcript + ``<|im_end|>`` only (the prompt and audio
positions are not scored).

Usage::

    python -m kvsim.minivox.train --data data/minivox --run data/minivox/run \\
        --seed 0 --steps 700 --batch 4

Resumes from ``<run>/last.pt`` when present; every ``--eval-every`` steps prints dev WER
(greedy) and keeps the best adapter in ``<run>/best.safetensors``; ``--export`` copies it to
``minivox/adapter.safetensors``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvsim.wer import corpus_wer

from .augment import parse_factors, perturb_rows, resample_speed
from .build import (
    REPO_WEIGHTS,
    adapter_encoder,
    build_base,
    read_adapter,
    save_adapter,
    split_adapter,
)
from .data import parse_shard, read_manifest
from .guided import AttentionProbe, GuideTargets, guided_loss, is_guided, target_spans
from .lora import LoRALinear, add_lora, load_lora_state, lora_state
from .modeling import DEFAULT_ENCODER, WHISPER_ENCODERS
from .options import add_options, option
from .rollouts import Rollout, begins_word, rollout_batch
from .scheduled import mixed_batch
from .subword import split_words
from .wrong_passages import SOURCES, text_pool, wrong_passage_batch


@dataclass
class TrainConfig:
    """Hyper-parameters (recorded in the run directory and the adapter metadata); each field
    is a command-line option of the same name, its help the field's ``metadata["help"]``."""

    seed: int = option(0, "seed of the data order, the augmentation draws and the LoRA init")
    steps: int = option(700, "length of the learning-rate schedule (linear warm-up, then cosine "
                             "decay to 0.1 of the peak)")
    batch: int = option(4, "clips per short-clip step (30-60 s steps take batch // 2)")
    lr: float = option(1e-3, "peak learning rate of the projector")
    lora_lr: float = option(5e-4, "peak learning rate of the LoRA weights (0: frozen, the "
                                  "projector trains alone)")
    warmup: int = option(30, "steps of linear warm-up")
    weight_decay: float = option(0.01, "AdamW weight decay")
    lora_rank: int = option(8, "rank of every LoRA update")
    lora_alpha: float = option(16.0, "LoRA scale numerator (scale = alpha / rank)")
    lora_targets: str = option("q_proj,k_proj,v_proj,o_proj",
                               "comma-separated decoder projections that get LoRA")
    eval_every: int = option(100, "steps between dev-WER evaluations (the best adapter is kept)")
    eval_clips: int = option(6, "dev clips decoded at each evaluation")
    ckpt_every: int = option(25, "steps between checkpoints (<run>/last.pt, resumed from)")
    max_minutes: float = option(1e9, "stop, with a checkpoint, after this many minutes")
    stop_step: int = option(0, "stop, with a checkpoint, at this step of the schedule (0: its end)")
    bf16: bool = option(True, "bfloat16 autocast (fast only with AMX; --no-bf16 for float32)")
    p_long: float = option(0.25, "share of steps on 30-60 s (two-window) clips, batch // 2 of them")
    threads: int = option(1, "torch intra-op threads")
    p_concat: float = option(0.0, "share of steps on one long-form example: 2..concat-max "
                                  "train_long clips joined end to end (60-240 s), or one "
                                  "--longform-split clip")
    concat_max: int = option(4, "most train_long clips joined into one long-form example")
    train_splits: str = option("train", "comma-separated manifest splits of the short-clip batches")
    align_weight: float = option(0.0, "weight of the alignment-guided attention loss "
                                      "(kvsim.minivox.guided; 0: off)")
    align_log: bool = option(False, "log the guided loss without training on it (a control run)")
    align_layers: str = option("20,21,22,23", "decoder layers the guided loss acts on (the "
                                              "ones that align)")
    align_margin: float = option(0.4, "seconds of margin around each word's audio in the "
                                      "guided targets")
    align_end: bool = option(False, "also guide the query that predicts the end token onto "
                                    "the end of the speech")
    longform_split: str = option("", "comma-separated manifest splits of continuous long-form "
                                     "clips; when set, a long-form step takes one of their "
                                     "clips instead of joining train_long clips")
    speed_perturb: str = option("", "speed perturbation (kvsim.minivox.augment): comma-separated "
                                    "factors, one drawn per clip and step, e.g. 0.9,1.0,1.1 "
                                    "(empty: recorded speed)")
    sampled_share: float = option(0.0, "scheduled sampling (kvsim.minivox.scheduled): share of "
                                       "transcript input tokens replaced by the model's own "
                                       "teacher-forced greedy tokens (0: teacher forcing)")
    split_words: float = option(0.0, "subword regularisation (kvsim.minivox.subword): share of "
                                     "words of four or more letters cut into two token pieces "
                                     "at a random letter, per example and step")
    wrong_share: float = option(0.0, "wrong passages (kvsim.minivox.wrong_passages): share of "
                                     "transcript input tokens replaced in blocks by other text, "
                                     "labels and guided targets kept (0: teacher forcing)")
    wrong_length: int = option(16, "tokens per wrong block")
    wrong_source: str = option("same", "where wrong blocks come from: same (a distant stretch "
                                       "of the same transcript) or other (other training "
                                       "transcripts)")
    wrong_guide_weight: float = option(1.0, "weight of the guided loss on the queries at a wrong "
                                            "block and the wrong-length tokens after it")
    augment_ramp: int = option(0, "steps over which sampled-share and wrong-share rise linearly "
                                  "from 0 (0: full share from the first step)")
    data_offset: int = option(0, "start the data order this many steps in (the schedule still "
                                 "starts at 0): a continuation with the same seed hears the "
                                 "clips its first run did not")
    encoder_lora_layers: int = option(0, "train the audio encoder too: LoRA on the attention and "
                                         "feed-forward projections of its last N layers, at "
                                         "lora-lr (0: encoder frozen, as shipped)")
    encoder_lora_rank: int = option(8, "rank of the encoder's LoRA updates")
    rollouts: int = option(0, "free-running rollouts (kvsim.minivox.rollouts): cuts per "
                              "long-form example at which the model writes rollout-tokens "
                              "tokens itself, the reference resumed after them (0: off)")
    rollout_tokens: int = option(32, "tokens the model writes at each rollout")
    encoder: str = option(DEFAULT_ENCODER, "the Whisper encoder (tiny.en, the shipped model's, "
                                           "or base); recorded in the adapter's metadata",
                          choices=sorted(WHISPER_ENCODERS))


def encoder_cache_dir(data: Path, encoder: str = DEFAULT_ENCODER) -> Path:
    """The folder of ``data`` holding the frozen outputs of the Whisper ``encoder``:
    ``enc_cache`` for tiny.en (the shipped model's), ``enc_cache_<name>`` for another."""
    return data / ("enc_cache" if encoder == DEFAULT_ENCODER else f"enc_cache_{encoder}")


def row_audio(row: dict) -> np.ndarray:
    """The 16 kHz samples of a manifest row, resampled by its speed factor (if any)."""
    audio, sr = sf.read(row["abs_path"], dtype="float32")
    if sr != 16000:
        raise ValueError(f"{row['abs_path']}: sample rate {sr}, expected 16000")
    return resample_speed(audio, row.get("speed", 1.0))


def encode_audio(model, proc, audio: np.ndarray) -> torch.Tensor:
    """Encoder output ``(n_chunks*1500, hidden)`` in float32 (bf16 autocast off); differentiable
    where the encoder has trainable LoRA factors (``TrainConfig.encoder_lora_layers``)."""
    with torch.autocast("cpu", enabled=False):
        h = model.model.audio_tower(proc.features(audio)).last_hidden_state.float()
    return h.reshape(-1, h.shape[-1])


def encoder_cache_file(row: dict, cache_dir: Path) -> Path:
    """Where :func:`encoder_cache` keeps a manifest row's encoder output: named by the clip's
    id, a digest of what was spoken (text, voice, rate, duration) and its speed factor, so a
    corpus regenerated into the same folder (another seed or clip count: the same ids, other
    clips) never reads the features of the clips it replaced."""
    spoken = json.dumps([row["text"], row.get("voice"), row.get("rate"), row.get("duration")])
    digest = hashlib.sha256(spoken.encode()).hexdigest()[:12]
    speed = row.get("speed", 1.0)
    return cache_dir / (f"{row['id']}-{digest}" + ("" if speed == 1.0 else f"@x{speed:g}") + ".npy")


def encoder_cache(model, proc, row: dict, cache_dir: Path) -> torch.Tensor:
    """Frozen encoder output ``(n_chunks*1500, hidden)`` for a manifest row (fp16 on disk,
    :func:`encoder_cache_file`); a speed-perturbed row
    (:func:`kvsim.minivox.augment.speed_row`) is resampled first and cached under its own name."""
    f = encoder_cache_file(row, cache_dir)
    if f.is_file():
        return torch.from_numpy(np.load(f).astype(np.float32))
    with torch.no_grad():
        h = encode_audio(model, proc, row_audio(row))
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f"{f.stem}.{os.getpid()}.tmp.npy"
    np.save(tmp, h.numpy().astype(np.float16))
    tmp.rename(f)
    return h.to(torch.float16).to(torch.float32)


def joined_row(parts: list[dict]) -> dict:
    """One long-form example made of clips played back to back (their texts joined)."""
    return {"parts": parts, "text": " ".join(p["text"] for p in parts)}


def part_encodings(model, proc, row: dict, cache_dir: Path | None) -> list[torch.Tensor]:
    """Encoder output of each clip of a manifest row (one) or of a :func:`joined_row`: from
    the cache in ``cache_dir``, or computed now (with gradients) when it is None."""
    parts = row.get("parts", [row])
    if cache_dir is None:
        return [encode_audio(model, proc, row_audio(p)) for p in parts]
    return [encoder_cache(model, proc, p, cache_dir) for p in parts]


def example_encoding(model, proc, row: dict, cache_dir: Path | None) -> torch.Tensor:
    """Encoder output of a manifest row, or of a :func:`joined_row` (windows concatenated)."""
    return torch.cat(part_encodings(model, proc, row, cache_dir))


def data_step(step: int, cfg: TrainConfig, world: int = 1, rank: int = 0) -> int:
    """The index into the data order of ``rank``'s batch at optimiser step ``step``: the
    batches, their speeds and their augmentation draws are functions of it; ``data_offset``
    shifts it (a continued run hears what its first run did not)."""
    return (step + cfg.data_offset) * world + rank


def optimiser_step(sub_batch: int, cfg: TrainConfig, world: int = 1) -> int:
    """The optimiser step of data index ``sub_batch`` (:func:`data_step`'s inverse): what the
    learning-rate and augmentation ramps count from 0."""
    return sub_batch // world - cfg.data_offset


def batch_rows(step: int, cfg: TrainConfig, train_rows: list[dict],
               long_rows: list[dict], longform_rows: Sequence[dict] = ()) -> list[dict]:
    """The manifest rows of training step ``step``, a deterministic function of the seed.

    With probability ``p_long`` a batch of ``batch // 2`` 30-60 s clips; with probability
    ``p_concat`` one long-form example: with ``longform_rows`` one of them (in the order of a
    permutation drawn per pass over them, indexed by step, so no clip repeats within
    ``len(longform_rows)`` steps), otherwise 2..``concat_max`` 30-60 s clips joined end to end
    (:func:`joined_row`); otherwise ``batch`` short clips in the order of a permutation of the
    train split drawn per epoch from ``(seed, epoch)``.
    """
    rng = np.random.default_rng([cfg.seed, step, 7])
    u = rng.random() if long_rows or longform_rows else 1.0
    if u < cfg.p_long:  # a multi-window (30-60 s) batch
        idx = rng.choice(len(long_rows), size=max(1, cfg.batch // 2), replace=False)
        return [long_rows[i] for i in idx]
    if u < cfg.p_long + cfg.p_concat:  # one long-form (60-240 s) example
        if longform_rows:  # one continuous clip
            n = len(longform_rows)
            perm = np.random.default_rng([cfg.seed, step // n, 11]).permutation(n)
            return [longform_rows[perm[step % n]]]
        k = int(rng.integers(2, cfg.concat_max + 1))
        idx = rng.choice(len(long_rows), size=k, replace=False)
        return [joined_row([long_rows[i] for i in idx])]
    out = []
    for j in range(cfg.batch):
        k = step * cfg.batch + j
        epoch, i = divmod(k, len(train_rows))
        perm = np.random.default_rng([cfg.seed, epoch]).permutation(len(train_rows))
        out.append(train_rows[perm[i]])
    return out


@dataclass
class Batch:
    """One training batch: decoder inputs, scored labels and the guided-attention targets."""

    embeds: torch.Tensor  #: (B, L, d) input embeddings, audio tokens projected in
    mask: torch.Tensor  #: (B, L) attention mask
    labels: torch.Tensor  #: (B, L) next-token labels, -100 where not scored
    guides: list[GuideTargets] | None = None  #: per row, with ``align_margin`` given


def make_batch(model, proc, rows: list[dict], cache_dir: Path | None,
               align_margin: float | None = None, align_end: bool = False,
               split_share: float = 0.0, split_draw: random.Random | None = None) -> Batch:
    """The decoder inputs of ``rows``; with ``align_margin`` (seconds) also the targets of the
    alignment-guided loss (:mod:`kvsim.minivox.guided`), the end token's with ``align_end``.
    ``cache_dir`` None: the encoder runs now (:func:`part_encodings`). With ``split_share``
    the transcripts' words are cut into token pieces at random
    (:func:`kvsim.minivox.subword.split_words`, drawn from ``split_draw``)."""
    if split_share > 0 and split_draw is None:
        raise ValueError("make_batch: split_share > 0 needs split_draw (the step's draw)")
    tok = proc.tokenizer
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    seqs, audio_feats, part_tokens, offsets = [], [], [], []
    for r in rows:
        encs = part_encodings(model, proc, r, cache_dir)
        enc = torch.cat(encs)
        part_tokens.append([e.shape[0] // 4 for e in encs])
        prompt = tok(proc.transcription_prompt(enc.shape[0] // 4), add_special_tokens=False)["input_ids"]
        text = split_words(tok, r["text"], split_share, split_draw)
        seqs.append((prompt, text.ids + [end_id]))
        offsets.append(text.offsets)
        audio_feats.append(enc)
    L = max(len(p) + len(t) for p, t in seqs)
    ids = torch.full((len(rows), L), end_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    labels = torch.full((len(rows), L), -100, dtype=torch.long)
    for i, (p, t) in enumerate(seqs):
        seq = p + t
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, len(p) - 1 : len(seq) - 1] = torch.tensor(t)  # predict t from the previous pos
    embeds = model.get_input_embeddings()(ids)
    audio = torch.cat(audio_feats).reshape(-1, model.config.audio_config.intermediate_size)
    audio_emb = model.model.multi_modal_projector(audio)
    amask = (ids == model.config.audio_token_id).unsqueeze(-1).expand_as(embeds)
    embeds = embeds.masked_scatter(amask, audio_emb.to(embeds.dtype))
    guides = None
    if align_margin is not None:
        guides = [_guide(tok, r, n, ids[i] == model.config.audio_token_id, len(seqs[i][0]),
                         align_margin, align_end, offsets[i])
                  for i, (r, n) in enumerate(zip(rows, part_tokens, strict=True))]
    return Batch(embeds, mask, labels, guides)


def _guide(tok, row: dict, part_tokens: list[int], is_audio: torch.Tensor, prompt_len: int,
           margin: float, guide_end: bool = False,
           offsets: list[tuple[int, int]] | None = None) -> GuideTargets | None:
    """The guided-loss targets of one batch row: the query predicting transcript token j sits
    at ``prompt_len - 1 + j``, the one predicting the end token (guided with ``guide_end``)
    right after the last; ``offsets``: the character span of each transcript token. None
    (with a warning, once per clip) when the manifest's words do not match the clip's text:
    the row then trains on its transcript alone."""
    try:
        spans = torch.from_numpy(target_spans(tok, row, part_tokens, margin, guide_end, offsets))
    except ValueError as e:
        warn_unguided(row, e)
        return None
    audio_positions = torch.nonzero(is_audio).flatten()
    spans = spans.clamp(max=len(audio_positions))
    return GuideTargets(prompt_len - 1 + torch.arange(len(spans)), audio_positions, spans)


_UNGUIDED: set[str] = set()


def warn_unguided(row: dict, reason: Exception) -> None:
    """Say once per clip that it has no guided-attention targets, and why."""
    clip = "+".join(p.get("id", "?") for p in row.get("parts", [row]))
    if clip not in _UNGUIDED:
        _UNGUIDED.add(clip)
        print(f"warning: {clip}: no guided-attention targets ({reason}); it trains on its "
              f"transcript alone", file=sys.stderr, flush=True)


def has_guides(batch: Batch) -> bool:
    """Whether any row of ``batch`` has guided-attention targets."""
    return batch.guides is not None and any(is_guided(t) for t in batch.guides)


def scored_logits(model, batch: Batch) -> torch.Tensor:
    """(n_scored, V) output logits of the positions of ``batch`` that have a label, in row-major
    order (the output head only there: at every position of a long-form example the logits
    over the vocabulary would be gigabytes)."""
    out = model.model.language_model(inputs_embeds=batch.embeds, attention_mask=batch.mask,
                                     use_cache=False)
    return model.lm_head(out.last_hidden_state[batch.labels != -100])


def loss_fn(model, batch: Batch, probe: AttentionProbe | None = None,
            align_weight: float = 0.0) -> tuple[torch.Tensor, float | None]:
    """Transcript cross-entropy, plus ``align_weight`` x the guided-attention loss with a probe.

    Returns the total loss and the guided loss's value (None without a probe).
    """
    ctx = probe.capture() if probe is not None else nullcontext()
    with ctx:
        logits = scored_logits(model, batch)
    loss = F.cross_entropy(logits.float(), batch.labels[batch.labels != -100])
    if probe is None or not has_guides(batch):
        return loss, None
    if align_weight == 0:  # measured only (TrainConfig.align_log): no graph, no gradient
        with torch.no_grad():
            return loss, guided_loss(probe, batch.guides).item()
    guided = guided_loss(probe, batch.guides)
    return loss + align_weight * guided, guided.item()


@torch.no_grad()
def transcribe(model, proc, audio: np.ndarray, max_new_tokens: int | None = None) -> str:
    """Greedy full-cache transcription of one clip."""
    inp = proc(audio=audio)
    if max_new_tokens is None:
        max_new_tokens = int(len(audio) / 16000 * 5) + 20
    out = model.generate(**inp, max_new_tokens=max_new_tokens, do_sample=False)
    return proc.decode(out[0, inp["input_ids"].shape[1] :])


def dev_wer(model, proc, rows: list[dict]) -> tuple[float, list[str]]:
    model.eval()
    hyps = [transcribe(model, proc, sf.read(r["abs_path"], dtype="float32")[0]) for r in rows]
    model.train()
    return corpus_wer(hyps, [r["text"] for r in rows], proc.tokenizer), hyps


def trainable(model) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """``(projector parameters, LoRA factors)``: the decoder's factors, then the encoder's."""
    proj = list(model.model.multi_modal_projector.parameters())
    lora = [p for part in (model.model.language_model, model.model.audio_tower)
            for n, p in part.named_parameters() if "lora_" in n]
    return proj, lora


@torch.no_grad()
def match_embedding_norm(model, proc, rows: list[dict], cache_dir: Path) -> float:
    """Scale the projector's last layer so its mean output norm on ``rows`` equals the mean
    norm of the decoder's input embeddings; returns the factor.

    The stage-1 CTC alignment fixes only the *direction* of the projector outputs (its logits
    carry a learned temperature), so their norm is arbitrary; the frozen decoder expects
    inputs of its embeddings' scale.
    """
    proj = model.model.multi_modal_projector
    feats = torch.cat([encoder_cache(model, proc, r, cache_dir) for r in rows])
    out = proj(feats.reshape(-1, model.config.audio_config.intermediate_size).float())
    target = model.get_input_embeddings().weight.float().norm(dim=-1).mean()
    factor = float(target / out.norm(dim=-1).mean())
    proj.linear_2.weight.mul_(factor)
    return factor


def load_trainable_adapter(model, path: Path) -> str:
    """Load an adapter file's projector and LoRA factors into a model whose decoder is wrapped
    by :func:`~.lora.add_lora` (the factors stay trainable, unlike :func:`~.build.apply_adapter`
    which merges them). Every decoder LoRA module must have factors in the file; the encoder's
    are loaded when the file has them and start at zero (an unchanged encoder) when it has
    none. An adapter of another Whisper encoder than the model's is refused. Returns what
    happened to the encoder's, in words."""
    tensors, meta = read_adapter(path)
    trained_on = adapter_encoder(meta, path)
    if trained_on != model.config.whisper_encoder:
        raise ValueError(f"{path}: an adapter of Whisper {trained_on}'s encoder; this run's is "
                         f"{model.config.whisper_encoder}'s (--encoder)")
    parts = split_adapter(tensors, torch.float32)
    model.model.multi_modal_projector.load_state_dict(parts.projector)
    decoder, encoder = model.model.language_model, model.model.audio_tower
    missing = {k.rsplit(".", 1)[0] for k in set(lora_state(decoder)) - set(parts.lora)}
    if missing:
        raise ValueError(f"{path}: no LoRA factors for {len(missing)} LoRA modules of the model "
                         f"(e.g. {sorted(missing)[0]}); check --lora-targets")
    load_lora_state(decoder, parts.lora)
    encoder_trained = any(isinstance(m, LoRALinear) for m in encoder.modules())
    if parts.encoder_lora and not encoder_trained:
        raise ValueError(f"{path}: has encoder LoRA factors, which a run with "
                         "--encoder-lora-layers 0 would drop; give --encoder-lora-layers")
    if not encoder_trained:
        return "encoder frozen"
    if not parts.encoder_lora:
        return "encoder LoRA from zero (the adapter has none)"
    load_lora_state(encoder, parts.encoder_lora)
    return "encoder LoRA loaded"


def save_ckpt(path: Path, model, opt, sched, step: int, best: float, cfg: TrainConfig) -> None:
    state = {
        "projector": model.model.multi_modal_projector.state_dict(),
        "lora": lora_state(model.model.language_model),
        "encoder_lora": lora_state(model.model.audio_tower),
        "opt": opt.state_dict(),
        "sched": sched.state_dict(),
        "step": step,
        "best": best,
        "cfg": asdict(cfg),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def export(run: Path, cfg: TrainConfig, model, step: int, wer: float, name: str) -> Path:
    out = run / name
    save_adapter(out, model.model.multi_modal_projector.state_dict(),
                 lora_state(model.model.language_model),
                 {"encoder": cfg.encoder, "step": step, "dev_wer": wer, "train_config": asdict(cfg)},
                 encoder_lora=lora_state(model.model.audio_tower))
    return out


def data_parallel() -> tuple[int, int]:
    """``(world_size, rank)``: with ``WORLD_SIZE=N``, ``RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` in the environment (one process per core, started by hand: torchrun's own
    options clash with ``--run``) the processes join a gloo group; otherwise ``(1, 0)``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 1, 0
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_world_size(), dist.get_rank()


def average_across_ranks(params: list[torch.nn.Parameter], *scalars: float) -> list[float]:
    """Average the gradients of ``params`` and the ``scalars`` over the process group, in one
    all-reduce; returns the averaged scalars."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [torch.tensor(scalars, dtype=torch.float32)])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    off = 0
    for p, g in zip(params, grads, strict=True):
        p.grad = flat[off : off + g.numel()].view_as(g).to(g.dtype).clone()
        off += g.numel()
    return flat[off:].tolist()


def trainable_model(cfg: TrainConfig):
    """minivox with the decoder frozen (bf16 with ``cfg.bf16``) and fresh LoRA factors.

    Returns the model, its processor and the (projector, LoRA) parameter lists to train.
    """
    model, proc = build_base(seed=cfg.seed, encoder=cfg.encoder)
    for p in model.parameters():
        p.requires_grad_(False)
    if cfg.bf16:  # frozen decoder in bf16 (AMX); trainable parts stay fp32 under autocast
        model.model.language_model.to(torch.bfloat16)
        model.lm_head.to(torch.bfloat16)
    add_lora(model.model.language_model, cfg.lora_rank, cfg.lora_alpha,
             tuple(cfg.lora_targets.split(",")))
    torch.manual_seed(cfg.seed)
    for m in model.model.language_model.modules():
        if hasattr(m, "lora_A"):
            torch.nn.init.kaiming_uniform_(m.lora_A, a=math.sqrt(5))
    add_encoder_lora(model, cfg)
    proj, lora = trainable(model)
    mark_trainable(proj, lora, cfg)
    return model, proc, proj, lora


def mark_trainable(proj: list, lora: list, cfg: TrainConfig) -> None:
    """Let gradients reach the projector always and the LoRA factors unless ``cfg.lora_lr``
    is 0: then the projector trains alone, and the frozen factors' gradients neither cost a
    backward pass nor count in the gradient norm that is clipped to 1."""
    for p in proj:
        p.requires_grad_(True)
    for p in lora:
        p.requires_grad_(cfg.lora_lr > 0)


#: The projections of a Whisper encoder layer that ``encoder_lora_layers`` trains.
ENCODER_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


def add_encoder_lora(model, cfg: TrainConfig) -> list[str]:
    """Wrap the targets of the encoder's last ``cfg.encoder_lora_layers`` layers in LoRA
    (:data:`ENCODER_LORA_TARGETS`; ``A`` drawn from ``seed + 1``, ``B`` zero: the encoder
    starts unchanged); returns their names relative to the encoder."""
    layers = model.model.audio_tower.layers
    k = cfg.encoder_lora_layers
    if not 0 <= k <= len(layers):
        raise ValueError(f"--encoder-lora-layers {k}: from 0 to {len(layers)}, the encoder's layers")
    torch.manual_seed(cfg.seed + 1)
    names = []
    for i in range(len(layers) - k, len(layers)):
        names += [f"layers.{i}.{n}" for n in add_lora(layers[i], cfg.encoder_lora_rank,
                                                      cfg.lora_alpha, ENCODER_LORA_TARGETS)]
    return names


def cosine_lr(step: int, total: int, warmup: int, floor: float = 0.0) -> float:
    """The learning-rate factor at ``step``: linear warm-up over ``warmup`` steps, then a
    cosine decay from 1 to ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def optimizer(cfg: TrainConfig, proj: list, lora: list):
    """AdamW (projector and LoRA learning rates) and its warm-up + cosine schedule to x0.1."""
    opt = torch.optim.AdamW([
        {"params": proj, "lr": cfg.lr},
        {"params": lora, "lr": cfg.lora_lr},
    ], weight_decay=cfg.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: cosine_lr(s, cfg.steps, cfg.warmup, floor=0.1))


def start_or_resume(run: Path, model, proc, opt, sched, train_rows: list[dict], data: Path,
                    init_projector: Path | None, init_adapter: Path | None,
                    lead: bool) -> tuple[int, float]:
    """Resume from ``run/last.pt`` if there is one, else initialise a new run; (step, best)."""
    if init_projector is not None and init_adapter is not None:
        raise ValueError("give --init-projector or --init-adapter, not both")
    say = print if lead else (lambda *a, **k: None)
    last = run / "last.pt"
    if last.is_file():  # resume; the initialisations below are for a new run only
        st = torch.load(last, weights_only=True)
        trained_on = st["cfg"].get("encoder", DEFAULT_ENCODER)
        if trained_on != model.config.whisper_encoder:
            raise ValueError(f"{last}: a run on Whisper {trained_on}'s encoder; this one asks for "
                             f"{model.config.whisper_encoder}'s (--encoder)")
        model.model.multi_modal_projector.load_state_dict(st["projector"])
        load_lora_state(model.model.language_model, st["lora"])
        load_lora_state(model.model.audio_tower, st.get("encoder_lora", {}))
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, best = int(st["step"]), float(st["best"])
        say(f"resumed from {last} at step {step} (best dev WER {best:.4f})", flush=True)
        return step, best
    if init_adapter is not None:
        encoder = load_trainable_adapter(model, init_adapter)
        say(f"projector and LoRA initialised from {init_adapter} ({encoder})", flush=True)
    elif init_projector is not None:
        load_stage1_projector(model, init_projector)
        cache = encoder_cache_dir(data, model.config.whisper_encoder)
        factor = match_embedding_norm(model, proc, train_rows[:16], cache)
        say(f"projector initialised from {init_projector} (output scaled x{factor:.3f} to "
            "the decoder's mean embedding norm)", flush=True)
    return 0, float("inf")


def load_stage1_projector(model, path: Path) -> None:
    """Load stage-1 projector weights (:mod:`kvsim.minivox.align`); a projector of another
    encoder's width is a one-line error naming the file."""
    from safetensors.torch import load_file

    weights = load_file(str(path))
    want = model.config.audio_config.intermediate_size  # 4 stacked encoder frames
    got = weights["linear_1.weight"].shape[1]
    if got != want:
        raise ValueError(f"{path}: a projector for {got} input features; Whisper "
                         f"{model.config.whisper_encoder}'s encoder gives {want} (--encoder)")
    model.model.multi_modal_projector.load_state_dict(weights)


@dataclass
class StepResult:
    """What one optimisation step measured (this rank's losses averaged over the ranks)."""

    loss: float
    align_loss: float | None
    out_of_time: bool
    seconds: dict[str, float]
    rollouts: tuple[Rollout, ...] = ()


def ramp_factor(step: int, ramp_steps: int) -> float:
    """The share of the final augmentation share at 0-based ``step``: ``(step + 1) / ramp_steps``
    up to 1 (1 throughout without a ramp)."""
    return 1.0 if ramp_steps <= 0 else min(1.0, (step + 1) / ramp_steps)


def train_step(model, proc, rows: list[dict], cache_dir: Path | None, cfg: TrainConfig, opt,
               sched, params: list, probe: AttentionProbe | None, world: int, t0: float,
               sub_batch: int = 0, pool: torch.Tensor | None = None) -> StepResult:
    """Forward, backward (gradients averaged over the ranks), clip to norm 1, step; with
    ``cfg.sampled_share`` the inputs are mixed first (scheduled sampling, drawn from
    ``(seed, sub_batch)``), and with ``cfg.wrong_share`` blocks of them replaced by wrong
    passages (:mod:`kvsim.minivox.wrong_passages`; cut from ``pool`` when given); both shares
    ramp up from 0 over ``cfg.augment_ramp`` steps (:func:`ramp_factor`). With ``cfg.rollouts``
    a batch of one example (a long-form step) first gets passages the model writes itself
    (:mod:`kvsim.minivox.rollouts`, cut points drawn from ``(seed, sub_batch)``)."""
    t_step = time.perf_counter()
    ramp = ramp_factor(optimiser_step(sub_batch, cfg, world), cfg.augment_ramp)
    rollouts: list[Rollout] = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
        batch = make_batch(model, proc, rows, cache_dir,
                           cfg.align_margin if probe is not None else None, cfg.align_end,
                           cfg.split_words, random.Random(cfg.seed * 1_000_039 + sub_batch))
        if cfg.rollouts > 0 and len(rows) == 1:
            draw = torch.Generator().manual_seed(cfg.seed * 1_000_037 + sub_batch)
            batch, rollouts = rollout_batch(
                model, batch, begins_word(proc.tokenizer), cfg.rollouts, cfg.rollout_tokens,
                draw, proc.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        if cfg.sampled_share > 0:
            draw = torch.Generator().manual_seed(cfg.seed * 1_000_003 + sub_batch)
            batch = mixed_batch(model, batch, cfg.sampled_share * ramp, draw)
        if cfg.wrong_share > 0:
            draw = torch.Generator().manual_seed(cfg.seed * 1_000_033 + sub_batch)
            batch = wrong_passage_batch(model, batch, cfg.wrong_share * ramp, cfg.wrong_length,
                                        draw, pool, cfg.wrong_guide_weight)
        t_fwd = time.perf_counter()
        loss, guided = loss_fn(model, batch, probe, cfg.align_weight)
    opt.zero_grad(set_to_none=True)
    t_bwd = time.perf_counter()
    loss.backward()
    loss_value = loss.item()
    out_of_time = float((time.time() - t0) / 60 > cfg.max_minutes)
    if world > 1:  # every rank stops at the same step
        loss_value, out_of_time = average_across_ranks(params, loss_value, out_of_time)
    t_opt = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    t_end = time.perf_counter()
    return StepResult(loss_value, guided, bool(out_of_time),
                      {"s_batch": t_fwd - t_step, "s_fwd": t_bwd - t_fwd,
                       "s_bwd": t_opt - t_bwd, "s_opt": t_end - t_opt}, tuple(rollouts))


def check_training_options(cfg: TrainConfig) -> None:
    """Raise ValueError, naming the options, for scheduled-sampling, subword, wrong-passage
    or data-order settings out of range (before the model loads)."""
    if not 0.0 <= cfg.sampled_share <= 1.0:
        raise ValueError(f"--sampled-share {cfg.sampled_share}: a share, from 0 to 1")
    if not 0.0 <= cfg.split_words <= 1.0:
        raise ValueError(f"--split-words {cfg.split_words}: a share, from 0 to 1")
    if not 0.0 <= cfg.wrong_share <= 1.0 or cfg.wrong_length < 1:
        raise ValueError(f"--wrong-share {cfg.wrong_share} / --wrong-length {cfg.wrong_length}: "
                         "a share from 0 to 1 and a length of at least one token")
    if cfg.wrong_source not in SOURCES or cfg.wrong_guide_weight < 0 or cfg.augment_ramp < 0:
        raise ValueError(f"--wrong-source {cfg.wrong_source!r} / --wrong-guide-weight "
                         f"{cfg.wrong_guide_weight} / --augment-ramp {cfg.augment_ramp}: one of "
                         f"{', '.join(SOURCES)}, a weight >= 0 and a step count >= 0")
    if cfg.data_offset < 0:
        raise ValueError(f"--data-offset {cfg.data_offset}: a step count >= 0")
    if cfg.rollouts < 0 or cfg.rollout_tokens < 1:
        raise ValueError(f"--rollouts {cfg.rollouts} / --rollout-tokens {cfg.rollout_tokens}: "
                         "a count >= 0 and a length of at least one token")
    if cfg.encoder_lora_layers < 0 or cfg.encoder_lora_rank < 1:
        raise ValueError(f"--encoder-lora-layers {cfg.encoder_lora_layers} / --encoder-lora-rank "
                         f"{cfg.encoder_lora_rank}: a layer count >= 0 and a rank >= 1")
    if cfg.encoder not in WHISPER_ENCODERS:
        raise ValueError(f"--encoder {cfg.encoder!r}: one of {', '.join(WHISPER_ENCODERS)}")


def bf16_beats_fp32() -> bool:
    """Whether bf16 autocast is faster than float32 on this CPU: with AMX tiles (``amx_bf16``)
    only. Without them oneDNN's bf16 matmuls are emulated (AVX2: ~50x slower) or run on
    AVX512-BF16 dot products, still slower than float32 (``benchmarks/bf16_matmul.py``)."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)  # absent in older torch
    if capabilities is None:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return bool(capabilities().get("amx_bf16", False))


def warn_if_bf16_slow(bf16: bool) -> None:
    """Print a warning when a run asks for bf16 autocast (``bf16``) on a CPU where it is
    slower than float32 (:func:`bf16_beats_fp32`)."""
    if bf16 and not bf16_beats_fp32():
        print("warning: this CPU has no AMX bf16 units, so bf16 autocast is slower than float32 "
              "here (benchmarks/bf16_matmul.py measures it): consider --no-bf16", flush=True)


@dataclass
class TrainingRows:
    """The manifest rows a run draws from: its training splits, the dev clips it is scored on,
    the 30-60 s clips it joins or batches (``train_long``) and its long-form split."""

    train: list[dict]
    dev: list[dict]
    long: list[dict]
    longform: list[dict]

    @classmethod
    def read(cls, data: Path, cfg: TrainConfig) -> TrainingRows:
        """Read only the splits ``cfg`` draws from (``p_long``, ``p_concat``, ``longform_split``)."""
        joins = cfg.p_concat > 0 and not cfg.longform_split
        return cls(
            train=manifest_rows(data, cfg.train_splits),
            dev=read_manifest(data, "dev").to_dicts()[: cfg.eval_clips],
            long=read_manifest(data, "train_long").to_dicts() if cfg.p_long > 0 or joins else [],
            longform=(manifest_rows(data, cfg.longform_split)
                      if cfg.longform_split and cfg.p_concat > 0 else []),
        )


def manifest_rows(data: Path, splits: str) -> list[dict]:
    """The rows of the comma-separated manifest ``splits``, in that order."""
    return [r for split in splits.split(",") for r in read_manifest(data, split).to_dicts()]


def train(data: Path, run: Path, cfg: TrainConfig, export_to: Path | None,
          init_projector: Path | None = None, init_adapter: Path | None = None,
          rows: TrainingRows | None = None) -> None:
    """Stage 2: projector + LoRA, end to end on the transcription loss.

    A new run starts from ``init_projector`` (stage-1 projector weights, LoRA at zero) or from
    ``init_adapter`` (a trained adapter file: projector and LoRA, e.g. another run's
    ``last.safetensors``) with a fresh optimizer and learning-rate schedule; a run with a
    ``last.pt`` resumes from it and ignores both. With ``cfg.align_weight > 0`` the loss adds
    the alignment-guided attention loss (:mod:`kvsim.minivox.guided`). ``rows``: the manifest
    rows when the caller has read them (:func:`main` does, to name a missing split in one line).

    Data parallel (:func:`data_parallel`, W processes): each step is W sub-batches, one per
    process (sub-batch ``step * W + rank`` of the single-process schedule), with averaged
    gradients.
    """
    speeds = parse_factors(cfg.speed_perturb)  # a bad spec fails before the model loads
    check_training_options(cfg)
    if rows is None:  # the manifest rows (``TrainingRows.read``); a missing split fails here too
        rows = TrainingRows.read(data, cfg)
    torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    world, rank = data_parallel()
    lead = rank == 0  # writes the log, checkpoints and exports
    if lead:
        warn_if_bf16_slow(cfg.bf16)
    run.mkdir(parents=True, exist_ok=True)
    if lead:
        (run / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    model, proc, proj, lora = trainable_model(cfg)
    opt, sched = optimizer(cfg, proj, lora)
    train_rows, dev_rows = rows.train, rows.dev
    step, best = start_or_resume(run, model, proc, opt, sched, train_rows, data,
                                 init_projector, init_adapter, lead)
    # None: the encoder runs at every step
    cache_dir = encoder_cache_dir(data, cfg.encoder) if cfg.encoder_lora_layers == 0 else None
    probe = (AttentionProbe(model.model.language_model,
                            [int(x) for x in cfg.align_layers.split(",")])
             if cfg.align_weight > 0 or cfg.align_log else None)
    pool = (text_pool(proc.tokenizer, [r["text"] for r in train_rows],
                      torch.Generator().manual_seed(cfg.seed))
            if cfg.wrong_share > 0 and cfg.wrong_source == "other" else None)
    log = (run / "log.jsonl").open("a") if lead else None
    t0 = time.time()
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc="train", mininterval=10, disable=not lead)
    ema = None
    end = min(cfg.stop_step or cfg.steps, cfg.steps)
    training = [p for p in proj + lora if p.requires_grad]  # averaged across ranks and clipped
    while step < end:
        sub_batch = data_step(step, cfg, world, rank)
        batch = perturb_rows(batch_rows(sub_batch, cfg, train_rows, rows.long, rows.longform),
                             speeds, cfg.seed, sub_batch)
        res = train_step(model, proc, batch, cache_dir, cfg, opt, sched, training, probe,
                         world, t0, sub_batch, pool)
        step += 1
        ema = res.loss if ema is None else 0.9 * ema + 0.1 * res.loss
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}")
        if lead:
            best = record_step(run, log, cfg, model, proc, dev_rows, step, ema, res, best,
                               time.time() - t0, sched.get_last_lr()[0], world)
        checkpoint = step % cfg.ckpt_every == 0 or step == end or res.out_of_time
        if lead and checkpoint:
            export(run, cfg, model, step, best, "last.safetensors")
            save_ckpt(run / "last.pt", model, opt, sched, step, best, cfg)
        if res.out_of_time:
            if lead:
                print(f"\nstopping at step {step}: --max-minutes reached", flush=True)
            break
    bar.close()
    if export_to is not None and lead:
        export_best(run, export_to)


def record_step(run: Path, log, cfg: TrainConfig, model, proc, dev_rows: list[dict], step: int,
                ema: float, res: StepResult, best: float, wall_s: float, lr: float,
                world: int) -> float:
    """Log one step (and the dev WER on evaluation steps, keeping the best adapter); new best."""
    rec = {"step": step, "loss": res.loss, "ema": ema, "wall_s": wall_s, "lr": lr,
           **res.seconds, "world": world}
    if res.align_loss is not None:
        rec["align_loss"] = res.align_loss  # this rank's sub-batch
    if res.rollouts:  # this rank's: how each written passage left the reference
        rec["rollouts"] = [[r.cut, len(r.written), r.resume - r.cut] for r in res.rollouts]
    if step % cfg.eval_every == 0 or step == cfg.steps:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            wer, hyps = dev_wer(model, proc, dev_rows)
        rec["dev_wer"] = wer
        rec["dev_hyp0"] = hyps[0][:200]
        print(f"\nstep {step} loss {ema:.3f} dev WER {wer:.4f} | {hyps[0][:120]!r}", flush=True)
        if wer < best:
            best = wer
            export(run, cfg, model, step, wer, "best.safetensors")
    log.write(json.dumps(rec) + "\n")
    log.flush()
    return best


def export_best(run: Path, export_to: Path) -> None:
    """Copy the run's best adapter (its last one without a dev evaluation) to ``export_to``."""
    src = run / "best.safetensors"
    if not src.is_file():
        src = run / "last.safetensors"
    export_to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, export_to)
    print(f"exported {src} -> {export_to}")


def prefill_cache(data: Path, split: str, shard: tuple[int, int] = (0, 1),
                  encoder: str = DEFAULT_ENCODER) -> None:
    """Compute the cache of the Whisper ``encoder``'s outputs for every clip of ``split`` (run
    beside training; :func:`encoder_cache_dir`).

    ``shard=(i, n)`` takes every n-th clip from the i-th, so n processes can share the work.
    """
    i, n = shard
    torch.set_num_threads(1)
    model, proc = build_base(encoder=encoder)
    cache_dir = encoder_cache_dir(data, encoder)
    rows = read_manifest(data, split).to_dicts()[i::n]
    for row in tqdm(rows, desc=f"cache {split} {i}/{n}", mininterval=30):
        encoder_cache(model, proc, row, cache_dir)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's command line: run options, then one option per :class:`TrainConfig` field."""
    ap = argparse.ArgumentParser(description="Train the minivox projector + LoRA on CPU.")
    ap.add_argument("--data", type=Path, default=Path("data/minivox"),
                    help="corpus folder (python -m kvsim.minivox.data; default: data/minivox)")
    ap.add_argument("--run", type=Path, default=Path("data/minivox/run"),
                    help="run folder: log, checkpoints, adapters (default: data/minivox/run)")
    ap.add_argument("--export", action="store_true", help=f"copy the best adapter to {REPO_WEIGHTS}")
    ap.add_argument("--init-projector", type=Path, default=None,
                    help="projector weights from stage-1 alignment (kvsim.minivox.align)")
    ap.add_argument("--init-adapter", type=Path, default=None,
                    help="start a new run from a trained adapter (projector + LoRA), with a fresh "
                         "optimizer and schedule")
    ap.add_argument("--prefill-cache", default=None, metavar="SPLIT",
                    help="only compute the encoder cache of SPLIT, then exit")
    ap.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                    help="with --prefill-cache: this process's share of the clips")
    add_options(ap, TrainConfig)
    return ap


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` a parsed command line asks for."""
    return TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.prefill_cache:
        prefill_cache(args.data, args.prefill_cache, args.shard, args.encoder)
        return
    cfg = config_from_args(args)
    try:
        rows = TrainingRows.read(args.data, cfg)
    except (FileNotFoundError, ValueError) as e:  # a missing manifest or split: one line
        raise SystemExit(f"error: {e}") from None
    train(args.data, args.run, cfg, REPO_WEIGHTS if args.export else None, args.init_projector,
          args.init_adapter, rows)


if __name__ == "__main__":
    main()
