"""Study reports: what every report says, whatever the study."""

from __future__ import annotations

import polars as pl

from kvsim.studies.report import PADDING_COUNTED, StudyReport, render_markdown, write_report


def _report(**kw) -> StudyReport:
    frame = pl.DataFrame({"method": ["full", "wnw"], "wer": [0.38, 0.41]})
    return StudyReport(name="demo", title="Demo", tables=[("Table 1.", frame)], data=frame,
                       notes=["A note."], **kw)


def test_report_says_whether_padding_was_counted():
    md = render_markdown(_report(), wall_s=1.0, argv=["study", "demo"])
    assert PADDING_COUNTED in md and "Encoder padding: counted as audio" in md
    # after the notes, before the provenance
    assert md.index("A note.") < md.index("Encoder padding") < md.index("Made by:")
    assert "Encoder padding" not in render_markdown(_report(padding=None), 1.0, ["study", "demo"])


def test_write_report_writes_markdown_and_parquet(tmp_path):
    paths = write_report(_report(extra_data={"runs": pl.DataFrame({"x": [1]})}), tmp_path, 2.0,
                         argv=["study", "demo"])
    assert [p.name for p in paths] == ["demo.parquet", "demo_runs.parquet", "demo.md"]
    assert pl.read_parquet(tmp_path / "demo.parquet")["wer"].to_list() == [0.38, 0.41]
    md = (tmp_path / "demo.md").read_text()
    assert "| full | 0.380 |" in md and "kvsim study demo" in md and "Wall time 2 s" in md
