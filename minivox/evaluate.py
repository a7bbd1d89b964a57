"""Full-cache greedy WER of minivox on the held-out sets (WnW §3.5 truncated WER).

Usage::

    python -m kvsim.minivox.evaluate --data data/minivox \\
        --splits test_30_60 test_long [--adapter PATH] [--limit N] [--out results.jsonl]

Prints per-clip WER, decode ms/token and per-split corpus WER. Decoding is greedy, as in the
paper's evaluation; ``--no-repeat-ngram N`` (off by default) is an experiment, not the
protocol: greedy decoding that never writes an n-gram of N tokens twice (Hugging Face's
``no_repeat_ngram_size``), so it cannot repeat itself token for token (minivox's loops then
come back as paraphrases: docs/minivox.md, "Where the long-form errors are"). ``--read-window
BEHIND,AHEAD,STALL`` (off by default) is another: greedy decoding with the aligning layers
reading only a window of the audio around their read position
(:mod:`kvsim.decoding.read_window`); ``--ban-cycles MAX_PERIOD,REPEATS`` (off by default) is a
third: greedy decoding that may not write a short cycle of tokens more than REPEATS times in a
row (:mod:`kvsim.decoding.cycle_ban`); with the window, ``--hold-end SECONDS`` allows no end
of answer while the read position is more than SECONDS before the end of the speech
(:mod:`kvsim.decoding.hold_end`) and ``--others-reach BEHIND,AHEAD``, a diagnostic, limits the
other decoder layers to the audio around the read position.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from transformers import LogitsProcessorList

from kvsim.decoding.cycle_ban import CycleBanConfig
from kvsim.decoding.hold_end import check_hold_end, speech_tokens
from kvsim.decoding.option_spec import parse_comma_option
from kvsim.decoding.processors import OptionProcessors
from kvsim.decoding.read_window import (
    ReadPastEnd,
    ReadWindow,
    ReadWindowConfig,
    reading_with,
    register_read_window,
)
from kvsim.wer import average_wer, corpus_wer, truncated_wer

from . import load_minivox, minivox_dir
from .augment import resample_speed
from .data import parse_shard, read_manifest
from .modeling import AUDIO_TOKENS_PER_SECOND


def generation_options(no_repeat_ngram: int = 0, num_beams: int = 1) -> dict:
    """Keyword arguments of ``generate``: greedy (``num_beams`` 1) or beam search with that
    many beams (transformers' defaults otherwise: length penalty 1, no early stopping), and
    with ``no_repeat_ngram`` > 0 no n-gram of that many tokens generated twice."""
    if no_repeat_ngram < 0:
        raise ValueError(f"no_repeat_ngram must be >= 0 (0: off), got {no_repeat_ngram}")
    if num_beams < 1:
        raise ValueError(f"--num-beams must be >= 1 (1: greedy), got {num_beams}")
    return {"do_sample": False, **({"no_repeat_ngram_size": no_repeat_ngram} if no_repeat_ngram else {}),
            **({"num_beams": num_beams} if num_beams > 1 else {})}


@dataclass
class EvalOptions:
    """Which clips of a split are decoded, and how.

    ``limit``: the first N clips; ``shard`` ``(i, n)``: every n-th of those from i; ``ids``:
    only these clips; ``speed``: every clip played ``speed`` times faster (polyphase
    resampling, tempo and pitch together: :func:`kvsim.minivox.augment.resample_speed`; 1.0
    plays it as recorded); ``no_repeat_ngram``: see :func:`generation_options`;
    ``chunk_seconds`` > 0: a diagnostic, not the model's protocol: every clip cut into pieces
    of that many seconds, each decoded on its own, the transcripts joined
    (:func:`audio_pieces`); 0 decodes the whole clip at once; ``read_window``: decode with
    the aligning layers' read window (:mod:`kvsim.decoding.read_window`; None: plain greedy);
    ``ban_cycles``: decode with the cycle ban (:mod:`kvsim.decoding.cycle_ban`; None: off);
    ``hold_end``: with the read window, no end of answer while the read position is more than
    this many seconds before the end of the speech (:mod:`kvsim.decoding.hold_end`; None: off);
    ``num_beams`` > 1: beam search (:func:`generation_options`; not with the read window, whose
    read position is one per decoding).
    """

    limit: int | None = None
    shard: tuple[int, int] = (0, 1)
    ids: frozenset[str] | None = None
    speed: float = 1.0
    no_repeat_ngram: int = 0
    chunk_seconds: float = 0.0
    read_window: ReadWindowConfig | None = None
    ban_cycles: CycleBanConfig | None = None
    hold_end: float | None = None
    num_beams: int = 1

    def __post_init__(self) -> None:
        check_hold_end(self.hold_end, self.read_window)
        if self.num_beams > 1 and self.read_window is not None:
            raise ValueError("--num-beams: not with --read-window (its read position is one "
                             "per decoding, not one per beam)")

    def rows(self, data: Path, split: str) -> list[dict]:
        """The manifest rows to decode; ValueError naming an id the split does not hold."""
        every = read_manifest(data, split).to_dicts()
        unknown = sorted((self.ids or set()) - {r["id"] for r in every})
        if unknown:
            raise ValueError(f"{data}: split {split!r} has no clip {unknown[0]!r} "
                             f"({len(unknown)} of the --ids unknown)")
        rows = every[: self.limit][self.shard[0]:: self.shard[1]]
        return rows if self.ids is None else [r for r in rows if r["id"] in self.ids]


def audio_pieces(audio: np.ndarray, chunk_seconds: float, rate: int = 16000) -> list[np.ndarray]:
    """``audio`` cut into consecutive pieces of ``chunk_seconds`` (the whole clip for 0); a
    last piece shorter than a quarter of that joins the one before it."""
    if chunk_seconds <= 0:
        return [audio]
    step = int(round(chunk_seconds * rate))
    cuts = list(range(step, audio.size, step))
    if cuts and audio.size - cuts[-1] < step // 4:
        cuts.pop()
    return np.split(audio, cuts)


@dataclass
class Decoded:
    """One clip's transcript and what its decoding took."""

    text: str
    n_gen: int  #: generated tokens
    n_prompt: int  #: prompt tokens (of the longest piece)
    read_forced: int = 0  #: forced steps of the read window (all pieces)
    read_stopped: bool = False  #: a read window left the audio and stopped its decoding
    cycle_bans: int = 0  #: decoding steps at which the cycle ban banned a token (all pieces)
    end_holds: int = 0  #: decoding steps at which --hold-end held back an end (all pieces)


def decode_clip(model, proc, audio: np.ndarray, ref_words: int, opts: EvalOptions,
                options: dict) -> Decoded:
    """Greedy transcript of one clip (or of its pieces, joined)."""
    out = Decoded("", 0, 0)
    texts = []
    for piece in audio_pieces(audio, opts.chunk_seconds):
        inp = proc(audio=piece)
        n_in = inp["input_ids"].shape[1]
        # enough tokens for 1.2x the reference words (the WER truncation) at ~1.4 tokens/word,
        # a piece's share of them by its share of the audio
        max_new = int(ref_words * piece.size / audio.size * 1.7) + 10
        kwargs = dict(options, max_new_tokens=max_new)
        window = None if opts.read_window is None else ReadWindow.for_inputs(
            opts.read_window, inp["input_ids"], proc.audio_token_id, AUDIO_TOKENS_PER_SECOND)
        procs = _option_processors(model, opts, n_in, window, piece.size)
        if on := procs.as_list():
            kwargs["logits_processor"] = LogitsProcessorList(on)
        with torch.no_grad():
            if window is None:
                res = model.generate(**inp, **kwargs)
            else:
                with reading_with(window):
                    res = model.generate(**inp, stopping_criteria=ReadPastEnd.criteria(window), **kwargs)
                out.read_forced += window.reading.forced
                out.read_stopped |= window.reading.past_end
        out.cycle_bans += procs.ban.fired if procs.ban is not None else 0
        out.end_holds += procs.hold.held if procs.hold is not None else 0
        gen = res[0, n_in:]
        texts.append(proc.decode(gen))
        out.n_gen += int(gen.numel())
        out.n_prompt = max(out.n_prompt, n_in)
    out.text = " ".join(t.strip() for t in texts).strip()
    return out


def _option_processors(model, opts: EvalOptions, n_in: int, window: ReadWindow | None,
                       samples: int) -> OptionProcessors:
    """The cycle ban and the held end of one decoding of ``samples`` in ``window``."""
    eos = model.generation_config.eos_token_id

    def n_speech() -> int:
        n = speech_tokens(samples, model.config.sampling_rate, AUDIO_TOKENS_PER_SECOND)
        return min(n, window.reading.n_audio)

    return OptionProcessors.build(opts.ban_cycles, n_in, opts.hold_end, window, n_speech,
                                  eos if isinstance(eos, list) else [eos], AUDIO_TOKENS_PER_SECOND)


def load_for(adapter: Path | None, opts: EvalOptions):
    """minivox and its processor, the decoder's attention the read window's with one."""
    kwargs = {}
    if opts.read_window is not None:
        kwargs["attn_implementation"] = {"text_config": register_read_window()}
    model, proc = load_minivox(minivox_dir(adapter), **kwargs)
    if opts.read_window is not None:
        opts.read_window.check_layers(model.config.text_config.num_hidden_layers, "minivox")
    return model, proc


def evaluate(data: Path, splits: list[str], adapter: Path | None, out: Path | None,
             opts: EvalOptions = EvalOptions()) -> dict[str, float]:
    """Full-cache greedy truncated WER of ``adapter`` on ``splits``; one record per clip to
    ``out`` (JSON lines) as it goes; returns the corpus WER per split."""
    torch.set_num_threads(1)
    options = generation_options(opts.no_repeat_ngram, opts.num_beams)
    if not 0.5 <= opts.speed <= 2.0:
        raise ValueError(f"--speed {opts.speed}: a factor from 0.5 to 2")
    if opts.chunk_seconds < 0:
        raise ValueError(f"--chunk-seconds {opts.chunk_seconds}: 0 (whole clips) or more")
    selected = {split: opts.rows(data, split) for split in splits}  # bad options fail first
    model, proc = load_for(adapter, opts)
    results: dict[str, float] = {}
    fh = out.open("w") if out else None
    for split, rows in selected.items():
        clip_scores = []
        for r in rows:
            audio, _ = sf.read(r["abs_path"], dtype="float32")
            audio = resample_speed(audio, opts.speed)
            t0 = time.perf_counter()
            dec = decode_clip(model, proc, audio, len(r["text"].split()), opts, options)
            wall = time.perf_counter() - t0
            hyp, n_gen = dec.text, dec.n_gen
            scores = truncated_wer(hyp, r["text"], proc.tokenizer)
            clip_scores.append(scores)
            w = scores.wer
            rec = {"split": split, "id": r["id"], "duration": r["duration"], "wer": w,
                   "errors": scores.errors, "ref_words": scores.ref_words,
                   "n_prompt": dec.n_prompt, "n_gen": n_gen, "wall_s": wall,
                   "no_repeat_ngram": opts.no_repeat_ngram, "num_beams": opts.num_beams,
                   "speed": opts.speed,
                   "chunk_seconds": opts.chunk_seconds,
                   "read_window": opts.read_window.spec() if opts.read_window else None,
                   **_others_reach(opts.read_window),
                   "read_forced": dec.read_forced, "read_stopped": dec.read_stopped,
                   "ban_cycles": opts.ban_cycles.spec() if opts.ban_cycles else None,
                   "cycle_bans": dec.cycle_bans,
                   **({"hold_end": opts.hold_end, "end_holds": dec.end_holds}
                      if opts.hold_end is not None else {}),
                   "ref": r["text"], "hyp": hyp}
            print(f"{split} {r['id']} {r['duration']:.0f}s WER {w:.3f} gen {n_gen} tok "
                  f"in {wall:.1f}s", flush=True)
            if fh:
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
        # the corpus WER of the clips' own scores (corpus_wer pools the same errors and words)
        results[split] = average_wer([c.errors for c in clip_scores], [c.ref_words for c in clip_scores])
        print(f"== {split}: {len(rows)} clips, corpus WER {results[split]:.4f}", flush=True)
    if fh:
        fh.close()
    return results


def _others_reach(window: ReadWindowConfig | None) -> dict:
    """The record's ``others_reach`` (seconds behind, ahead) when the diagnostic is on."""
    if window is None or not window.limits_others:
        return {}
    return {"others_reach": ",".join(f"{s:g}" for s in window.others_s)}


def read_records(files: list[Path], fields: tuple[str, ...] = ()) -> list[dict]:
    """The clip records of ``--out`` files, in order.

    ValueError naming the file and line of a record that is not a JSON object, lacks its
    ``id`` or one of ``fields``, or repeats a clip already read (a shard passed
    twice would count its clips twice); FileNotFoundError naming a missing file.
    """
    recs: list[dict] = []
    seen: dict[str, str] = {}  # split/id -> where it was read
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such evaluation file")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            rec = _parse_record(line, f"{path}: line {n}")
            missing = [f for f in ("id", *fields) if f not in rec]
            if missing:
                raise ValueError(f"{path}: line {n}: no field {missing[0]!r}")
            clip = f"{rec.get('split', '')}/{rec['id']}".lstrip("/")
            if clip in seen:
                raise ValueError(f"{path}: line {n}: clip {clip} read twice (first at {seen[clip]})")
            seen[clip] = f"{path}: line {n}"
            recs.append(rec)
    return recs


def _parse_record(line: str, where: str) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not a JSON record ({exc.msg})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: not a JSON record (a {type(rec).__name__})")
    return rec


def summarise(files: list[Path]) -> dict[str, float]:
    """Corpus WER per split over the records of several ``--out`` files."""
    from . import load_processor

    tokenizer = load_processor(minivox_dir()).tokenizer
    recs = read_records(files, ("split", "hyp", "ref", "n_gen", "wer"))
    out = {}
    for split in sorted({r["split"] for r in recs}):
        rs = [r for r in recs if r["split"] == split]
        out[split] = corpus_wer([r["hyp"] for r in rs], [r["ref"] for r in rs], tokenizer)
        gen = sum(r["n_gen"] for r in rs)
        per = [r["wer"] for r in rs]
        mean = sum(per) / len(per)
        se = (sum((w - mean) ** 2 for w in per) / (len(per) - 1) / len(per)) ** 0.5 \
            if len(per) > 1 else float("nan")
        print(f"{split}\tclips {len(rs)}\tWER {out[split]:.4f}\tper clip {mean:.4f} +- {se:.4f} "
              f"(mean +- standard error)\tgenerated {gen} tokens")
    return out


def _read_window(spec: str | None, others_reach: str | None) -> ReadWindowConfig | None:
    """The ``--read-window`` and ``--others-reach`` values as one configuration."""
    if others_reach is not None and spec is None:
        raise ValueError("--others-reach: needs --read-window (the read position it is around)")
    window = ReadWindowConfig.parse(spec) if spec else None
    if others_reach is None or window is None:
        return window
    return parse_comma_option(lambda behind, ahead: replace(window, others_s=(behind, ahead)),
                              others_reach, "--others-reach", "BEHIND,AHEAD (seconds, or inf)",
                              (float, float))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="minivox full-cache greedy WER on held-out sets")
    ap.add_argument("--data", type=Path, default=Path("data/minivox"),
                    help="corpus folder (python -m kvsim.minivox.data; default: data/minivox)")
    ap.add_argument("--splits", nargs="+", default=["test_30_60", "test_long"],
                    help="manifest splits to evaluate (default: test_30_60 test_long)")
    ap.add_argument("--adapter", type=Path, default=None,
                    help="adapter .safetensors to evaluate (default: $MINIVOX_ADAPTER, else "
                    "the shipped minivox/adapter.safetensors)")
    ap.add_argument("--limit", type=int, default=None,
                    help="only the first N clips of each split")
    ap.add_argument("--out", type=Path, default=None,
                    help="write one JSON record per clip to this .jsonl file")
    ap.add_argument("--shard", type=parse_shard, default=(0, 1), help="i/n: evaluate every n-th clip from i "
                    "(run shards in parallel, then --summarise their --out files)")
    ap.add_argument("--no-repeat-ngram", type=int, default=0, metavar="N",
                    help="never generate an n-gram of N tokens twice (an experiment; default 0: "
                    "plain greedy, the paper's protocol)")
    ap.add_argument("--num-beams", type=int, default=1, metavar="N",
                    help="an experiment: beam search with N beams (default 1: greedy, the "
                    "protocol); not with --read-window")
    ap.add_argument("--ids", default=None, help="only these clips (comma-separated ids)")
    ap.add_argument("--speed", type=float, default=1.0, metavar="F",
                    help="play every clip F times faster (resampled: tempo and pitch together; "
                    "below 1 slower); an experiment, default 1: as recorded")
    ap.add_argument("--chunk-seconds", type=float, default=0.0, metavar="S",
                    help="a diagnostic: decode every clip in pieces of S seconds, each on its own, "
                    "and join the transcripts (default 0: the whole clip at once, the protocol)")
    ap.add_argument("--read-window", default=None, metavar="BEHIND,AHEAD,STALL",
                    help="an experiment: the aligning decoder layers read only the audio from "
                    "BEHIND s behind to AHEAD s ahead of their read position, pushed forward after "
                    "STALL tokens without a move (e.g. 2,3,8; default: plain greedy, the protocol)")
    ap.add_argument("--others-reach", default=None, metavar="BEHIND,AHEAD",
                    help="a diagnostic, with --read-window: every other decoder layer reads only "
                    "the audio from BEHIND s behind to AHEAD s ahead of the read position ('inf' "
                    "for no limit on a side; default: all of the audio)")
    ap.add_argument("--hold-end", type=float, default=None, metavar="SECONDS",
                    help="an experiment, with --read-window: no end of answer while the read "
                    "position is more than SECONDS before the end of the speech (e.g. 3; "
                    "default: plain greedy, the protocol)")
    ap.add_argument("--ban-cycles", default=None, metavar="MAX_PERIOD,REPEATS",
                    help="an experiment: never write more than REPEATS copies in a row of a cycle "
                    "of at most MAX_PERIOD tokens (e.g. 16,3; default: plain greedy, the protocol)")
    ap.add_argument("--summarise", nargs="*", type=Path, default=None,
                    help="only print corpus WER per split from these --out files")
    a = ap.parse_args(argv)
    if a.summarise:
        try:
            summarise(a.summarise)
        except (ValueError, FileNotFoundError) as exc:
            sys.exit(f"error: {exc}")
        return
    try:
        opts = EvalOptions(limit=a.limit, shard=a.shard, speed=a.speed,
                           no_repeat_ngram=a.no_repeat_ngram,
                           ids=frozenset(a.ids.split(",")) if a.ids else None,
                           chunk_seconds=a.chunk_seconds,
                           read_window=_read_window(a.read_window, a.others_reach),
                           ban_cycles=CycleBanConfig.parse(a.ban_cycles) if a.ban_cycles else None,
                           hold_end=a.hold_end, num_beams=a.num_beams)
        res = evaluate(a.data, a.splits, a.adapter, a.out, opts)
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"error: {exc}")
    for k, v in res.items():
        print(f"{k}\tWER\t{v:.4f}")


if __name__ == "__main__":
    main()
