"""Does a wrong transcript prefix make minivox lose its place in the audio? A teacher-forced
test of cause and effect.

For each clip the transcript is fed twice: as it is, and with ``--words`` of its words from
``--at`` (a fraction of the transcript) replaced by as many words of another clip's
transcript (the next clip of the split), the words after them unchanged. For the tokens of
those unchanged words (the first ``--tokens`` of them) both runs give, from the same forward
pass:

* the **read error**: how far the attention peak of the alignment layers (head mean, over the
  audio; decoder layers 20-23 by default, those the guided loss trains) lies from the token's
  word in the audio, in seconds (0 inside the word);
* the **in-word share**: the share of tokens whose peak lies within ``--margin-s`` of their word;
* the **loss**: the token's cross-entropy (nats).

and for the wrong passage's own tokens, whether the attention peak stays in the audio of the
words they replaced (within ``--margin-s``), runs ahead of it or stays behind it.

If the model's reading follows its own text, the tokens after a wrong passage are read further
from their words than the same tokens after the true passage, and the wrong passage itself is
read away from its audio.

Usage: python scripts/minivox_corrupted_prefix.py ADAPTER.safetensors [--data DIR]
       [--split test_long] [--clips 0:8] [--at 0.4] [--words 15] [--tokens 40]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvsim.minivox import load_minivox, minivox_dir
from kvsim.minivox.data import add_clip_arguments, read_manifest
from kvsim.minivox.guided import TOKENS_PER_SECOND, AttentionProbe, GuideTargets, target_spans
from kvsim.minivox.train import encoder_cache_dir, make_batch, part_encodings, scored_logits


def corrupted_text(text: str, other: str, at: float, n_words: int) -> tuple[str, int]:
    """``text`` with ``n_words`` of its words from word ``int(at * len(words))`` replaced by the
    first ``n_words`` words of ``other``; and the index of the first word replaced."""
    words, donor = text.split(), other.split()
    if len(donor) < n_words or len(words) < n_words + 2:
        raise ValueError(f"need {n_words} words to replace and to replace them with")
    first = min(int(at * len(words)), len(words) - n_words - 1)
    return " ".join(words[:first] + donor[:n_words] + words[first + n_words:]), first


def suffix_tokens(tokenizer, text: str, n_words_before: int) -> int:
    """Number of BPE tokens of ``text`` that belong to its words from ``n_words_before`` on
    (the suffix is tokenized alike in any text it ends, words being split at spaces)."""
    words = text.split()
    return len(tokenizer(" " + " ".join(words[n_words_before:]), add_special_tokens=False)["input_ids"])


@torch.no_grad()
def reads(model, proc, row: dict, cache: Path, layers: list[int],
          audio: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per transcript token: the attention peak of ``layers`` over the audio at sequence
    positions ``audio`` (audio tokens) and the teacher-forced cross-entropy."""
    batch = make_batch(model, proc, [row], cache)
    probe = AttentionProbe(model.model.language_model, layers)
    with probe.capture():
        logits = scored_logits(model, batch)
    scored = batch.labels[0] != -100
    loss = F.cross_entropy(logits.float(), batch.labels[0, scored], reduction="none").numpy()
    queries = torch.nonzero(scored).flatten()[:-1]  # the transcript tokens (end token left out)
    target = GuideTargets(queries, audio, torch.zeros((len(queries), 2), dtype=torch.long))
    att = torch.stack([probe.audio_attention(layer, 0, target) for layer in layers]).mean(0)
    return att.argmax(-1).numpy(), loss[:-1]


def audio_positions(model, proc, n_audio: int) -> torch.Tensor:
    """Sequence positions of the audio tokens in the transcription prompt of ``n_audio`` of
    them (the prompt precedes the transcript, as :func:`kvsim.minivox.train.make_batch` lays
    them out)."""
    prompt = proc.tokenizer(proc.transcription_prompt(n_audio), add_special_tokens=False)["input_ids"]
    return torch.nonzero(torch.tensor(prompt) == model.config.audio_token_id).flatten()


def read_error_s(peak: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """Seconds from each peak (audio tokens) to its token's word span ``[lo, hi)`` (0 inside)."""
    below = np.clip(spans[:, 0] - peak, 0, None)
    above = np.clip(peak - (spans[:, 1] - 1), 0, None)
    return (below + above) / TOKENS_PER_SECOND


def compare(model, proc, row: dict, other: dict, cache: Path, at: float, n_words: int,
            n_tokens: int, layers: list[int]) -> dict[str, np.ndarray]:
    """Read error and loss of the first ``n_tokens`` tokens after the replaced words, with the
    true and with the wrong passage before them; and where the wrong passage's own tokens
    read, in seconds from the replaced words' audio (0 inside it, negative before it)."""
    tok = proc.tokenizer
    text, first = corrupted_text(row["text"], other["text"], at, n_words)
    n_prefix = len(tok(" ".join(row["text"].split()[:first]), add_special_tokens=False)["input_ids"])
    n_suffix = suffix_tokens(tok, row["text"], first + n_words)
    true_ids, wrong_ids = (tok(t, add_special_tokens=False)["input_ids"] for t in (row["text"], text))
    if true_ids[-n_suffix:] != wrong_ids[-n_suffix:] or true_ids[:n_prefix] != wrong_ids[:n_prefix]:
        raise ValueError(f"{row['id']}: the words around the replaced ones tokenize differently")
    part_tokens = [e.shape[0] // 4 for e in part_encodings(model, proc, row, cache)]
    audio = audio_positions(model, proc, sum(part_tokens))
    spans = target_spans(tok, row, part_tokens, margin_s=0.0)
    replaced = spans[n_prefix:len(spans) - n_suffix]  # the true passage's words in the audio
    out = {}
    for name, r in (("true", row), ("wrong", {**row, "text": text})):
        peak, loss = reads(model, proc, r, cache, layers, audio)
        out[f"{name}_error_s"] = read_error_s(peak[-n_suffix:][:n_tokens], spans[-n_suffix:][:n_tokens])
        out[f"{name}_loss"] = loss[-n_suffix:][:n_tokens]
        if name == "wrong":
            during = peak[n_prefix:len(peak) - n_suffix]
            lo, hi = replaced[:, 0].min(), replaced[:, 1].max()
            out["during_s"] = (np.where(during < lo, during - lo, 0)
                               + np.where(during >= hi, during - hi + 1, 0)) / TOKENS_PER_SECOND
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_clip_arguments(ap)
    ap.add_argument("--at", type=float, default=0.4)
    ap.add_argument("--words", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--margin-s", type=float, default=1.0)
    ap.add_argument("--layers", default="20,21,22,23")
    args = ap.parse_args()
    torch.set_num_threads(1)
    layers = [int(x) for x in args.layers.split(",")]
    model, proc = load_minivox(minivox_dir(args.adapter))
    model.eval()
    rows = read_manifest(args.data, args.split).to_dicts()
    results = []
    print("clip\tafter the passage: read error true / wrong (s)\tin word true / wrong"
          "\tloss true / wrong (nats)\tduring the wrong passage: reads in its audio / ahead / behind")
    cache = encoder_cache_dir(args.data, model.config.whisper_encoder)
    for i in range(*args.clips.indices(len(rows))):
        r = compare(model, proc, rows[i], rows[(i + 1) % len(rows)], cache,
                    args.at, args.words, args.tokens, layers)
        results.append(r)
        inw = {k: float(np.mean(r[f"{k}_error_s"] <= args.margin_s)) for k in ("true", "wrong")}
        print(f"{rows[i]['id']}\t{r['true_error_s'].mean():.2f} / {r['wrong_error_s'].mean():.2f}"
              f"\t{inw['true']:.2f} / {inw['wrong']:.2f}"
              f"\t{r['true_loss'].mean():.2f} / {r['wrong_loss'].mean():.2f}"
              f"\t{np.mean(np.abs(r['during_s']) <= args.margin_s):.2f} / "
              f"{np.mean(r['during_s'] > args.margin_s):.2f} / "
              f"{np.mean(r['during_s'] < -args.margin_s):.2f}", flush=True)
    during = np.concatenate([r["during_s"] for r in results])
    print(f"during the wrong passages ({during.size} tokens): reading in the replaced words' "
          f"audio {np.mean(np.abs(during) <= args.margin_s):.2f}, ahead of it "
          f"{np.mean(during > args.margin_s):.2f}, behind it {np.mean(during < -args.margin_s):.2f}")
    for part, sl in (("tokens 1-10", slice(0, 10)), ("tokens 11-40", slice(10, None))):
        vals = {k: np.concatenate([r[k][sl] for r in results]) for k in results[0]}
        print(f"{part}: read error {vals['true_error_s'].mean():.2f} / "
              f"{vals['wrong_error_s'].mean():.2f} s, in word "
              f"{np.mean(vals['true_error_s'] <= args.margin_s):.2f} / "
              f"{np.mean(vals['wrong_error_s'] <= args.margin_s):.2f}, loss "
              f"{vals['true_loss'].mean():.2f} / {vals['wrong_loss'].mean():.2f}")


if __name__ == "__main__":
    main()
