"""Full-cache greedy WER of minivox on the held-out sets (WnW §3.5 truncated WER).

Usage::

    python -m kvsim.minivox.evaluate --data data/minivox \\
        --splits test_30_60 test_long [--adapter PATH] [--limit N] [--out results.jsonl]

Prints per-clip WER, decode ms/token and per-split corpus WER. Decoding is greedy, as in the
paper's evaluation; ``--no-repeat-ngram N`` (off by default) is an experiment, not the
protocol: greedy decoding that never writes an n-gram of N tokens twice (Hugging Face's
``no_repeat_ngram_size``), so it cannot repeat itself token for token (minivox's loops then
come back as paraphrases: docs/minivox.md, "Where the long-form errors are").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import soundfile as sf
import torch

from kvsim.wer import average_wer, corpus_wer, truncated_wer

from . import load_minivox, minivox_dir
from .data import parse_shard, read_manifest


def generation_options(no_repeat_ngram: int = 0) -> dict:
    """Keyword arguments of ``generate``: greedy, and with ``no_repeat_ngram`` > 0 no n-gram of
    that many tokens generated twice."""
    if no_repeat_ngram < 0:
        raise ValueError(f"no_repeat_ngram must be >= 0 (0: off), got {no_repeat_ngram}")
    return {"do_sample": False, **({"no_repeat_ngram_size": no_repeat_ngram} if no_repeat_ngram else {})}


def evaluate(data: Path, splits: list[str], adapter: Path | None, limit: int | None,
             out: Path | None, shard: tuple[int, int] = (0, 1),
             no_repeat_ngram: int = 0) -> dict[str, float]:
    torch.set_num_threads(1)
    options = generation_options(no_repeat_ngram)
    model, proc = load_minivox(minivox_dir(adapter))
    results: dict[str, float] = {}
    fh = out.open("w") if out else None
    for split in splits:
        rows = read_manifest(data, split).to_dicts()[:limit][shard[0]::shard[1]]
        clip_scores = []
        for r in rows:
            audio, _ = sf.read(r["abs_path"], dtype="float32")
            inp = proc(audio=audio)
            n_in = inp["input_ids"].shape[1]
            # enough tokens for 1.2x the reference words (the WER truncation) at ~1.4 tokens/word
            max_new = int(len(r["text"].split()) * 1.7) + 10
            t0 = time.perf_counter()
            with torch.no_grad():
                res = model.generate(**inp, max_new_tokens=max_new, **options)
            wall = time.perf_counter() - t0
            gen = res[0, n_in:]
            hyp = proc.decode(gen)
            scores = truncated_wer(hyp, r["text"], proc.tokenizer)
            clip_scores.append(scores)
            w = scores.wer
            rec = {"split": split, "id": r["id"], "duration": r["duration"], "wer": w,
                   "errors": scores.errors, "ref_words": scores.ref_words,
                   "n_prompt": n_in, "n_gen": int(gen.numel()), "wall_s": wall,
                   "no_repeat_ngram": no_repeat_ngram,
                   "ref": r["text"], "hyp": hyp}
            print(f"{split} {r['id']} {r['duration']:.0f}s WER {w:.3f} gen {gen.numel()} tok "
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


def summarise(files: list[Path]) -> dict[str, float]:
    """Corpus WER per split over the records of several ``--out`` files."""
    from . import load_processor

    tokenizer = load_processor(minivox_dir()).tokenizer
    recs = [json.loads(line) for f in files for line in f.read_text().splitlines() if line]
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="minivox full-cache greedy WER on held-out sets")
    ap.add_argument("--data", type=Path, default=Path("data/minivox"))
    ap.add_argument("--splits", nargs="+", default=["test_30_60", "test_long"])
    ap.add_argument("--adapter", type=Path, default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--shard", type=parse_shard, default=(0, 1), help="i/n: evaluate every n-th clip from i "
                    "(run shards in parallel, then --summarise their --out files)")
    ap.add_argument("--no-repeat-ngram", type=int, default=0, metavar="N",
                    help="never generate an n-gram of N tokens twice (an experiment; default 0: "
                    "plain greedy, the paper's protocol)")
    ap.add_argument("--summarise", nargs="*", type=Path, default=None,
                    help="only print corpus WER per split from these --out files")
    a = ap.parse_args(argv)
    if a.summarise:
        summarise(a.summarise)
        return
    res = evaluate(a.data, a.splits, a.adapter, a.limit, a.out, a.shard, a.no_repeat_ngram)
    for k, v in res.items():
        print(f"{k}\tWER\t{v:.4f}")


if __name__ == "__main__":
    main()
