"""Altair charts of replay results (HTML that opens offline; PNG through vl-convert)."""

from __future__ import annotations

from pathlib import Path

import altair as alt
import polars as pl

from kvsim.trace.atomic import atomic_file


def recall_vs_rgpu(frame: pl.DataFrame, title: str = "Attention recall vs r_GPU") -> alt.Chart:
    """Audio attention-mass recall against measured r_GPU: one panel per trace, one line per
    policy in it (its points in budget order, each point marked), so no line joins points of
    different traces."""
    data = frame.select("trace", "label", "budget", "r_gpu", "attn_recall").sort("trace", "label", "budget")
    base = alt.Chart(data).encode(
        x=alt.X("r_gpu:Q", title="measured r_GPU (audio KV on GPU)", scale=alt.Scale(domain=[0, 1])),
        y=alt.Y("attn_recall:Q", title="attention-mass recall", scale=alt.Scale(domain=[0, 1])),
        color=alt.Color("label:N", title="policy", scale=alt.Scale(scheme="tableau20")),
        order=alt.Order("budget:Q"),
        tooltip=["trace", "label", "budget", "r_gpu", "attn_recall"],
    )
    layers = base.mark_line(strokeWidth=1.5) + base.mark_point(size=50, filled=True)
    return (layers.properties(width=320, height=260)
            .facet(facet=alt.Facet("trace:N", title="trace"), columns=2)
            .properties(title=title))


def save_chart(chart: alt.Chart, stem: Path) -> list[Path]:
    """Write ``stem.html`` (Vega libraries inlined: opens without a network) and ``stem.png``;
    returns the paths written."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    html = stem.with_suffix(".html")
    with atomic_file(html) as tmp:
        chart.save(str(tmp), format="html", inline=True)
    written = [html]
    import vl_convert as vlc

    png = stem.with_suffix(".png")
    with atomic_file(png) as tmp:
        tmp.write_bytes(vlc.vegalite_to_png(chart.to_json(), scale=2))
    written.append(png)
    return written
