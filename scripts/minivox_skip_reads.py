"""Where minivox reads when its transcript skips a passage: the read path (``kvsim
alignment``) around every skip, to tell a jump of the attention from a jump of the text.

For each trace (``kvsim trace`` of a clip with its ``<id>.words.json`` beside the audio), the
generated words are aligned to the reference words (jiwer, normalised as the WER is). A skip
is a passage of at least ``--run-words`` deleted reference words (deletions joined across up
to 3 matched or substituted words, where a loop's repeated words land). The text *leaves* the
reference after the last word it matched before the passage (audio time ``t0``: that word's
end) and *returns* at the first run of 3 matched words after it (``t1``: the start of the
first of them); what it writes in between is off the reference (a loop, invented text).

The read position of an answer token is the attention peak of the alignment layers
(:func:`kvsim.studies.alignment.alignment`, unsmoothed); the read position at the return is
its median over the 5 tokens from the return, at the leave over the 5 tokens before it. A
skip is then

* ``read jumped too``: at the return the read position is at ``t1`` (within ``--tol-s``)
  and got there in a jump: the read path (median of 3 tokens) moved forward by at least half
  the skipped audio from one token to the next, between the leave and the return;
* ``read went through``: at the return the read position is at ``t1``, but it moved through
  the passage in smaller steps while the text was off the reference;
* ``text only``: at the return the read position is still at or before ``t0``: the text
  skipped, the reading did not;
* ``elsewhere``: neither;
* ``at the end``: no 3 matched words follow the passage (the model stopped early, or never
  found its place again).

Per skip the table also gives the read position at the leave less ``t0`` (negative: the
reading was behind the text when it left the reference, i.e. had stalled), the tokens written
off the reference, and the read path's lead: the tokens by which its arrival at ``t1`` came
before the text's return (negative: after it); tokens off the reference minus the lead are
the tokens between the text leaving the reference and the reading jumping; and the largest
move forward of the read path (median of 3 tokens) from the leave to the return, which is
about ``t1 - t0`` when the reading jumped over the passage in one step.

Usage: python scripts/minivox_skip_reads.py TRACE.kvtrace [...] [--run-words 10] [--tol-s 2]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jiwer
import numpy as np

from kvsim.wer import normalize

LABELS = ("read jumped too", "read went through", "text only", "elsewhere", "at the end")


@dataclass(frozen=True)
class Skip:
    """A skipped passage of reference words ``[ref_start, ref_end)``. The text leaves the
    reference before output word ``leave_word``, after matching reference word ``leave_ref``
    (None: it matched none before), and returns to it at output word ``return_word``, which
    matches reference word ``return_ref`` (both None when it does not return)."""

    ref_start: int
    ref_end: int
    leave_word: int
    leave_ref: int | None
    return_word: int | None
    return_ref: int | None


def reference_words(words: Sequence[str], starts: Sequence[float],
                    ends: Sequence[float]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The normalised reference words with their start and end times (a timed word that
    normalises to several words, e.g. ``twenty-four``, gives each of them its times; one that
    normalises to nothing is dropped)."""
    out, t_start, t_end = [], [], []
    for word, start, end in zip(words, starts, ends, strict=True):
        parts = normalize(word).split()
        out += parts
        t_start += [start] * len(parts)
        t_end += [end] * len(parts)
    return out, np.asarray(t_start, dtype=float), np.asarray(t_end, dtype=float)


def first_tokens(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> list[int]:
    """Index of the answer token at which each normalised output word starts: word ``j``
    starts at the first token whose decoded prefix holds ``j + 1`` words."""
    starts: list[int] = []
    for k in range(len(token_ids)):
        n_words = len(normalize(decode(token_ids[: k + 1])).split())
        while len(starts) < n_words:
            starts.append(k)
    return starts


def find_skips(ref: Sequence[str], hyp: Sequence[str], run_words: int = 10, gap: int = 3,
               resume_words: int = 3) -> list[Skip]:
    """Every passage of at least ``run_words`` reference words deleted from ``hyp``: runs of
    deletions joined across at most ``gap`` reference words matched or substituted between
    them (a loop's repeated words land on scattered words of the passage it skips). The text
    returns at the first run of ``resume_words`` matched words after the passage (a single
    matched word, often a loop's ``and`` or ``the``, is not yet its place); passages with the
    same return are one skip (from the first's start and leave)."""
    if not hyp:
        return [Skip(0, len(ref), 0, None, None, None)] if len(ref) >= run_words else []
    chunks = jiwer.process_words(" ".join(ref), " ".join(hyp)).alignments[0]
    runs: list[list[int]] = []  # [ref_start, ref_end, deleted, reference words since]
    for chunk in chunks:
        n = chunk.ref_end_idx - chunk.ref_start_idx
        if chunk.type == "delete":
            if runs and runs[-1][3] <= gap:
                runs[-1][1:] = [chunk.ref_end_idx, runs[-1][2] + n, 0]
            else:
                runs.append([chunk.ref_start_idx, chunk.ref_end_idx, n, 0])
        elif runs:
            runs[-1][3] += n
    skips: list[Skip] = []
    for start, end, deleted, _ in runs:
        if deleted < run_words:
            continue
        left = [c for c in chunks if c.type == "equal" and c.ref_end_idx <= start]
        back = next((c for c in chunks if c.type == "equal" and c.ref_start_idx >= end
                     and c.ref_end_idx - c.ref_start_idx >= resume_words), None)
        skip = Skip(start, end, left[-1].hyp_end_idx if left else 0,
                    left[-1].ref_end_idx - 1 if left else None,
                    *((back.hyp_start_idx, back.ref_start_idx) if back else (None, None)))
        if skips and skips[-1].return_ref == skip.return_ref:  # one episode: merged
            first = skips.pop()
            skip = Skip(first.ref_start, end, first.leave_word, first.leave_ref,
                        skip.return_word, skip.return_ref)
        skips.append(skip)
    return skips


def classify(read_s: np.ndarray, leave: int, step: int, t0: float, t1: float,
             tol_s: float = 2.0, window: int = 5) -> tuple[str, int | None, float]:
    """The kind of a skip whose text left the reference at answer token ``leave`` (audio time
    ``t0``) and returns to it at token ``step`` (audio time ``t1``), from the read position
    per answer token ``read_s`` (at the return: its median over ``step`` and the
    ``window - 1`` tokens after); the read path's lead in tokens: ``step`` minus the first
    token, from 30 before the step, from which the read position stays at ``t1 - tol_s`` or
    later for three tokens (None if none up to the step's window); and the largest move
    forward of the read path (median of 3) from ``leave - 1`` to the return's window."""
    from kvsim.studies.alignment import median_filter

    at_return = float(np.median(read_s[step:step + window]))
    lead = None
    for k in range(max(0, step - 30), min(len(read_s), step + window)):
        if read_s[k:k + 3].min() >= t1 - tol_s:
            lead = step - k
            break
    path = median_filter(read_s, 3)[max(0, leave - 1):step + window]
    move = float(np.diff(path).max()) if len(path) > 1 else 0.0
    if abs(at_return - t1) <= tol_s:
        return ("read jumped too" if move >= (t1 - t0) / 2 else "read went through"), lead, move
    if at_return <= t0 + tol_s:
        return "text only", lead, move
    return "elsewhere", lead, move


def skip_rows(trace_path: Path, run_words: int = 10, tol_s: float = 2.0) -> list[dict]:
    """One row per skip of one trace."""
    from transformers import AutoTokenizer

    from kvsim.studies.alignment import alignment
    from kvsim.trace.reader import Trace

    trace = Trace(trace_path)
    timing = json.loads(Path(trace.meta.audio["path"]).with_suffix(".words.json").read_text())
    ref, t_start, t_end = reference_words(timing["words"], timing["starts"], timing["ends"])
    tokenizer = AutoTokenizer.from_pretrained(trace.meta.provenance["model_path"])
    ids = [t for t in trace.meta.provenance["generation"]["token_ids"]
           if t not in tokenizer.all_special_ids]
    starts = first_tokens(ids, lambda x: tokenizer.decode(x, skip_special_tokens=True))
    read_s = alignment(trace, smooth=1).path["peak_s"].to_numpy()
    rows = []
    for skip in find_skips(ref, normalize(tokenizer.decode(ids)).split(), run_words):
        t0 = 0.0 if skip.leave_ref is None else float(t_end[skip.leave_ref])
        leave = starts[skip.leave_word] if skip.leave_word < len(starts) else len(read_s)
        row = {"trace": trace_path.stem, "words": skip.ref_end - skip.ref_start, "t0": t0,
               "t1": None, "leave_read": float(np.median(read_s[max(0, leave - 5):leave]))
               if leave else None, "off_tokens": None, "lead": None, "kind": "at the end"}
        if skip.return_word is not None:
            step = starts[skip.return_word]
            t1 = float(t_start[skip.return_ref])
            kind, lead, move = classify(read_s, leave, step, t0, t1, tol_s)
            row.update(t1=t1, off_tokens=step - leave, lead=lead, kind=kind, largest_move=move,
                       return_read=float(np.median(read_s[step:step + 5])))
        rows.append(row)
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if isinstance(x, float) else str(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--run-words", type=int, default=10)
    ap.add_argument("--tol-s", type=float, default=2.0)
    args = ap.parse_args()
    rows = [r for t in args.traces for r in skip_rows(t, args.run_words, args.tol_s)]
    print("trace\twords\tt0 (s)\tt1 (s)\tread at leave - t0 (s)\tread at return (s)"
          "\ttokens off the reference\tread lead (tokens)\tlargest read move (s)\tkind")
    for r in rows:
        lag = None if r["leave_read"] is None else r["leave_read"] - r["t0"]
        print("\t".join(_fmt(x) for x in (r["trace"], r["words"], r["t0"], r["t1"], lag,
                                           r.get("return_read"), r["off_tokens"], r["lead"],
                                           r.get("largest_move"), r["kind"])))
    counts = Counter(r["kind"] for r in rows)
    print(f"{len(rows)} skips: " + ", ".join(f"{k} {counts[k]}" for k in LABELS))
    gaps = [r["off_tokens"] - r["lead"] for r in rows
            if r["kind"] == LABELS[0] and r["lead"] is not None]
    if gaps:
        print(f"of the {len(gaps)} the reading took too: the text left the reference before the "
              f"read path jumped in {sum(g > 0 for g in gaps)} (tokens between: median "
              f"{np.median(gaps):.0f}, range {min(gaps)}-{max(gaps)})")


if __name__ == "__main__":
    main()
