"""scripts/wer_by_condition.py: corpus WER per speaking-rate band from evaluation records."""

from __future__ import annotations

import json

import polars as pl
import pytest
from conftest import load_script

script = load_script("wer_by_condition")


def _write(tmp_path, records, manifest_rows):
    ev = tmp_path / "eval.jsonl"
    ev.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    man = tmp_path / "manifest.parquet"
    pl.DataFrame(manifest_rows).write_parquet(man)
    return ev, man


CLIPS = [  # id, rate, errors, ref words
    ("a", 150, 10, 100), ("b", 159, 30, 100), ("c", 160, 5, 50), ("d", 179, 0, 50),
    ("e", 180, 80, 100), ("f", 195, 20, 100),
]


def _data(tmp_path):
    records = [{"id": i, "errors": e, "ref_words": n, "hyp": "x"} for i, _, e, n in CLIPS]
    manifest = [{"id": i, "rate": r, "voice": "v1" if r < 170 else "v2", "duration": 60.0 + k}
                for k, (i, r, _, _) in enumerate(CLIPS)]
    return _write(tmp_path, records, manifest)


@pytest.mark.parametrize(("rate", "label"), [(100, "< 160"), (159, "< 160"), (160, "160-179"),
                                             (179, "160-179"), (180, ">= 180"), (300, ">= 180")])
def test_rate_bands_have_closed_lower_edges(rate, label):
    assert script.rate_band(rate, [160, 180]) == label


def test_breakdown_pools_errors_over_reference_words(tmp_path):
    ev, man = _data(tmp_path)
    clips = script.read_evaluations([ev]).join(pl.read_parquet(man), on="id")
    table = script.breakdown(clips, "rate", [160, 180])
    assert table["group"].to_list() == ["< 160", "160-179", ">= 180"]
    assert table["clips"].to_list() == [2, 2, 2]
    # corpus WER = sum of errors / sum of reference words, not the mean of the clips' WERs
    assert table["corpus_wer"].to_list() == pytest.approx([40 / 200, 5 / 100, 100 / 200])
    by_voice = script.breakdown(clips, "voice", [160, 180])
    assert dict(zip(by_voice["group"], by_voice["corpus_wer"], strict=True)) == pytest.approx(
        {"v1": 45 / 250, "v2": 100 / 250})


def test_main_prints_the_bands_and_the_correlations(tmp_path, capsys):
    ev, man = _data(tmp_path)
    assert script.main([str(ev), "--manifest", str(man)]) == 0
    out = capsys.readouterr().out
    assert ">= 180" in out and "Spearman(per-clip WER, rate) over 6 clips" in out
    assert "corpus WER 0.2900" in out  # 145 errors / 500 words


def test_a_bad_record_or_unknown_clip_is_one_line(tmp_path, capsys):
    ev, man = _write(tmp_path, [{"id": "a", "errors": 1, "ref_words": 2}, {"id": "b", "errors": 1}],
                     [{"id": "a", "rate": 150, "voice": "v", "duration": 1.0}])
    assert script.main([str(ev), "--manifest", str(man)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {ev}: line 2: no field 'ref_words'"
    ev.write_text(json.dumps({"id": "zz", "errors": 1, "ref_words": 2}) + "\n")
    assert script.main([str(ev), "--manifest", str(man)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {man}: no clip 'zz' (1 unknown)"
