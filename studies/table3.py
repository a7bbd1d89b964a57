"""``kvsim study table3``: WnW's ablations A1–A3 (WnW §3.8, Table 3) as replay proxies and
live WER.

- A1: voice-head count ``n_voice`` ∈ {10, 30, 50, 70, 90} at r_GPU 0.1 and 0.2;
- A2: per-segment vs global top-k prefill selection at nv30/0.1 and nv90/0.2;
- A3: the triage signal, VS×HS vs HS only vs VS only, at nv30/0.1.

Head counts are the paper's share of Voxtral's 240 KV-heads (:mod:`kvsim.studies.wnw_sweep`).
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

#: WnW §3.8, Table 3 (A1): truncated WER (%) by n_voice at r_GPU = 0.1 and 0.2.
PAPER_A1 = {0.1: {10: 51.92, 30: 9.78, 50: 8.09, 70: 6.31, 90: 6.76},
            0.2: {10: 6.53, 30: 6.46, 50: 6.39, 70: 6.20, 90: 6.23}}
#: WnW §3.8, Table 3 (A2): (n_voice, r_GPU) -> {prefill selection: WER %}.
PAPER_A2 = {(30, 0.1): {"segment": 9.78, "global": 13.11},
            (90, 0.2): {"segment": 6.23, "global": 6.27}}
#: WnW §3.8, Table 3 (A3): triage signal at nv30 / r_GPU 0.1 -> WER % (VS only: no termination).
PAPER_A3 = {"vs_hs": 9.78, "hs": 36.41, "vs": 124.66}
#: WnW §3.8: the anchor count held fixed in every ablation (§2.2 "n_anchor=5").
PAPER_N_ANCHOR = 5

_SELECTION_NAMES = {"segment": "per-segment (WnW)", "global": "global top-k"}
_SIGNAL_NAMES = {"vs_hs": "VS×HS (WnW)", "hs": "HS only", "vs": "VS only"}

TITLE = "WnW ablations A1–A3 (WnW §3.8, Table 3)"

CAPTIONS = {
    "A1 r_GPU=0.1": "**A1** voice-head count n_voice at r_GPU = 0.1 (WnW §3.8, Table 3)",
    "A1 r_GPU=0.2": "**A1** voice-head count n_voice at r_GPU = 0.2 (WnW §3.8, Table 3)",
    "A2 nv30/0.1": "**A2** prefill selection at nv30 / r_GPU = 0.1 (WnW §3.8, Table 3)",
    "A2 nv90/0.2": "**A2** prefill selection at nv90 / r_GPU = 0.2 (WnW §3.8, Table 3)",
    "A3 nv30/0.1": "**A3** head-triage signal at nv30 / r_GPU = 0.1 (WnW §3.8, Table 3)",
}


def table3_settings(n_heads: int) -> list[Setting]:
    """Every cell of Table 3 for a model with ``n_heads`` = L·H_kv KV-heads."""
    anchors = scale_heads(PAPER_N_ANCHOR, n_heads)

    def wnw(nv: int, **extra: object) -> tuple:
        return (("n_voice", scale_heads(nv, n_heads)), ("n_anchor", anchors), *extra.items())

    out = [Setting(f"A1 r_GPU={r:g}", str(nv), r, wnw(nv), wer)
           for r, row in PAPER_A1.items() for nv, wer in row.items()]
    for (nv, r), row in PAPER_A2.items():
        for sel, wer in row.items():
            extra = {} if sel == "segment" else {"prefill_selection": sel}
            out.append(Setting(f"A2 nv{nv}/{r:g}", _SELECTION_NAMES[sel], r, wnw(nv, **extra), wer))
    for sig, wer in PAPER_A3.items():
        extra = {} if sig == "vs_hs" else {"triage_signal": sig}
        out.append(Setting("A3 nv30/0.1", _SIGNAL_NAMES[sig], 0.1, wnw(30, **extra), wer))
    return out


def table3_report(opts: SweepOptions, n_heads: int, quick: bool = False,
                  log: Callable[[str], None] = print) -> StudyReport:
    """Run Table 3 (``quick``: the first and last setting of each group) and build the report."""
    intro = (f"WnW's ablations on a model with {n_heads} KV-heads: the paper's head counts "
             f"(of Voxtral-mini-3b's 240) scaled to the same share, n_anchor "
             f"{PAPER_N_ANCHOR} -> {scale_heads(PAPER_N_ANCHOR, n_heads)}. Replay columns are "
             f"means over {len(opts.traces)} trace(s) (open loop, full-cache queries); live "
             "columns are the truncated WER of the set (corpus, ratio 1.2) and the share of "
             "runs that stopped on their own. The paper's WER is LibriSpeech-Long test-clean "
             "on Voxtral-mini-3b: compare trends, not levels.")
    return sweep_report("table3", (TITLE, "WnW Table 3 ablations"), table3_settings(n_heads), CAPTIONS, intro,
                        opts, quick, log)
