"""``kvsim study table7``: WnW's hyperparameter sensitivity (WnW App. C, Table 7) at
r_GPU = 0.2 as replay proxies and live WER.

The paper sweeps the chunk size W_c (0.96–7.68 s; a chunk spans two segments, so the stride
is W_c / 2, §2.3) and the anchor count (1–20); kvsim also sweeps the release lag δ, the
chunks selected per step (top-k) and the stride at the default 4 s chunk, where the paper
gives no number. Every other hyperparameter is WnW's default (n_voice = 90 of 240 at 0.2,
§3.4; 5 anchors, §2.2; W_c = 4 s, W_s = 2 s, k = 3, δ = 3, §2.3).
"""

from __future__ import annotations

from collections.abc import Callable

from kvsim.studies.report import StudyReport
from kvsim.studies.wnw_sweep import (
    Setting,
    SweepOptions,
    scale_heads,
    sweep_report,
)

#: WnW App. C: "sensitivity sweeps on Voxtral-mini-3b at ~20% GPU retention".
PAPER_BUDGET = 0.2
#: WnW App. C, Table 7 (chunk size): W_c in seconds -> truncated WER (%); 4.00 s is the default.
PAPER_CHUNK = {0.96: 6.45, 1.92: 6.29, 4.00: 6.23, 5.76: 6.26, 7.68: 6.23}
#: WnW App. C, Table 7 (anchor count): n_anchor -> truncated WER (%); 5 is the default.
PAPER_ANCHORS = {1: 6.22, 3: 6.23, 5: 6.18, 7: 6.20, 10: 6.21, 15: 6.23, 20: 6.22}
#: WnW §3.4: n_voice = 90 (of 240) at r_GPU = 0.2, held fixed in Table 7.
PAPER_N_VOICE = 90
#: WnW §2.2: n_anchor = 5, held fixed outside the anchor sweep.
PAPER_N_ANCHOR = 5
#: kvsim's sweeps without a paper column (defaults in §2.3: δ = 3, k = 3, W_s = 2 s).
DELTAS = (1, 2, 3, 5, 8)
TOP_KS = (1, 2, 3, 5)
STRIDES = (1.0, 2.0, 4.0)

TITLE = "WnW hyperparameter sensitivity (WnW App. C, Table 7)"

CAPTIONS = {
    "chunk size": "**Chunk size** W_c (stride W_c/2) at r_GPU = 0.2 (WnW App. C, Table 7)",
    "anchor count": "**Anchor count** n_anchor at r_GPU = 0.2 (WnW App. C, Table 7)",
    "delta": "**Release lag δ** at r_GPU = 0.2 (kvsim; the paper has no sweep, default δ = 3)",
    "top-k": "**Chunks per step k** at r_GPU = 0.2 (kvsim; the paper has no sweep, default k = 3)",
    "stride": "**Stride W_s** at W_c = 4 s, r_GPU = 0.2 (kvsim; the paper has no sweep, default 2 s)",
}


def table7_settings(n_heads: int) -> list[Setting]:
    """Every row of Table 7 and kvsim's δ / top-k / stride sweeps for ``n_heads`` KV-heads."""
    nv, r = scale_heads(PAPER_N_VOICE, n_heads), PAPER_BUDGET

    def wnw(n_anchor: int = PAPER_N_ANCHOR, **extra: object) -> tuple:
        return (("n_voice", nv), ("n_anchor", scale_heads(n_anchor, n_heads)), *extra.items())

    def mark(value: str, is_default: bool) -> str:
        return f"{value} (default)" if is_default else value

    out = [Setting("chunk size", mark(f"{w:.2f}s", w == 4.0), r,
                   wnw() if w == 4.0 else wnw(chunk_seconds=w, stride_seconds=w / 2), wer)
           for w, wer in PAPER_CHUNK.items()]
    out += [Setting("anchor count", mark(str(a), a == PAPER_N_ANCHOR), r, wnw(a), wer)
            for a, wer in PAPER_ANCHORS.items()]
    out += [Setting("delta", mark(str(d), d == 3), r, wnw() if d == 3 else wnw(delta=d))
            for d in DELTAS]
    out += [Setting("top-k", mark(str(k), k == 3), r, wnw() if k == 3 else wnw(top_k=k))
            for k in TOP_KS]
    out += [Setting("stride", mark(f"{s:g}s", s == 2.0), r,
                    wnw() if s == 2.0 else wnw(stride_seconds=s)) for s in STRIDES]
    return out


def table7_report(opts: SweepOptions, n_heads: int, quick: bool = False,
                  log: Callable[[str], None] = print) -> StudyReport:
    """Run Table 7 (``quick``: the first and last setting of each sweep) and build the report."""
    intro = (f"WnW's sensitivity at r_GPU = {PAPER_BUDGET:g} on a model with {n_heads} KV-heads: "
             f"n_voice {PAPER_N_VOICE} of 240 -> {scale_heads(PAPER_N_VOICE, n_heads)}, anchors "
             "scaled to the same share (several paper counts may land on one kvsim count; they "
             "share a run). Replay columns are means over "
             f"{len(opts.traces)} trace(s); live columns the truncated WER of the set and the "
             "termination rate. The paper's WER is Voxtral-mini-3b on LibriSpeech-Long "
             "test-clean: compare spreads, not levels (the paper: within ~0.3 WER points).")
    return sweep_report("table7", (TITLE, "WnW Table 7 sensitivity"), table7_settings(n_heads), CAPTIONS, intro,
                        opts, quick, log)
