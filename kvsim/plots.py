"""Altair charts of replay results (HTML always; PNG through vl-convert)."""

from __future__ import annotations

from pathlib import Path

import altair as alt
import polars as pl

from kvsim.trace.atomic import atomic_file


def recall_vs_rgpu(frame: pl.DataFrame, title: str = "Attention recall vs r_GPU") -> alt.Chart:
    """Audio attention-mass recall against measured r_GPU, one line per policy."""
    data = frame.select("policy", "label", "trace", "r_gpu", "attn_recall", "budget")
    base = alt.Chart(data).encode(
        x=alt.X("r_gpu:Q", title="measured r_GPU (audio KV on GPU)", scale=alt.Scale(domain=[0, 1])),
        y=alt.Y("mean(attn_recall):Q", title="attention-mass recall", scale=alt.Scale(domain=[0, 1])),
        color=alt.Color("label:N", title="policy", scale=alt.Scale(scheme="tableau20")),
        tooltip=["label", "budget", "mean(r_gpu)", "mean(attn_recall)"],
    )
    return (base.mark_line() + base.mark_point()).properties(title=title, width=420, height=300)


def save_chart(chart: alt.Chart, stem: Path) -> list[Path]:
    """Write ``stem.html`` and ``stem.png``; returns the paths written."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    html = stem.with_suffix(".html")
    with atomic_file(html) as tmp:
        chart.save(str(tmp), format="html")
    written = [html]
    import vl_convert as vlc

    png = stem.with_suffix(".png")
    with atomic_file(png) as tmp:
        tmp.write_bytes(vlc.vegalite_to_png(chart.to_json(), scale=2))
    written.append(png)
    return written
