"""Share of attention mass that falls on padding audio tokens, from a trace's own queries/keys.

    python scripts/padding_attention.py TRACE.kvtrace

Prints, for the prompt's last position (the "prefill attention" of WnW §2.1), for the
observation-window queries and averaged over decode steps: the share of the audio attention mass
on padding positions, the share of all attention mass, and the padding share of the audio tokens
(the figure the two would match if attention ignored content). Means over layers and q-heads.
"""

from __future__ import annotations

import sys

import numpy as np

from kvsim.core.attention import as_f32, causal_attention
from kvsim.trace import Trace


def padding_shares(t: Trace, positions: np.ndarray) -> tuple[float, float]:
    """(padding mass / audio mass, padding mass / all mass) of the queries at ``positions``,
    averaged over queries, layers and q-heads."""
    rows = np.array([t.query_index(int(p)) for p in positions])
    pad = np.isin(t.audio_positions, t.padding_positions)
    of_audio, of_all = [], []
    for layer in range(t.meta.model.n_layers):
        att = causal_attention(as_f32(t.queries(layer)[:, rows]), as_f32(t.keys(layer)), positions)
        audio = att[:, :, t.audio_positions]  # (H_q, M, T_a)
        of_audio.append((audio[..., pad].sum(-1) / audio.sum(-1)).mean())
        of_all.append(audio[..., pad].sum(-1).mean())
    return float(np.mean(of_audio)), float(np.mean(of_all))


def main(path: str) -> None:
    t = Trace(path)
    if not t.padding_recorded:
        sys.exit(f"{path}: positions.parquet: no 'padding' column (trace recorded before padding was marked)")
    n0 = t.meta.n_prefill
    print(f"{t.name}: {t.n_audio} audio tokens, {len(t.padding_positions)} padding "
          f"({len(t.padding_positions) / t.n_audio:.1%}), duration {t.meta.audio.get('duration_s', 0):.1f} s")
    groups = {"prefill (last prompt position)": np.array([n0 - 1]),
              f"observation window ({len(t.window_positions)} queries)": t.window_positions,
              f"decode ({t.meta.n_decode} steps)": np.arange(n0, t.meta.n_positions)}
    for name, pos in groups.items():
        if len(pos):
            a, b = padding_shares(t, pos)
            print(f"  {name}: {a:.1%} of audio attention mass, {b:.1%} of all attention mass")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
