"""Dataset layouts for live decoding, on small fixtures written in each published layout."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import soundfile as sf

from kvsim.live.data import DataError, clean_primock_text, load_audio, load_dataset, read_textgrid


def _wav(path, seconds=1.0, rate=16000, channels=1):
    path.parent.mkdir(parents=True, exist_ok=True)
    x = (0.1 * np.random.default_rng(0).standard_normal((int(seconds * rate), channels))).astype(np.float32)
    sf.write(str(path), x, rate)
    return path


_TG = '''File type = "ooTextFile"
Object class = "TextGrid"

xmin = 0
xmax = 6.0
tiers? <exists>
size = 1
item []:
    item [1]:
        class = "IntervalTier"
        name = "Doctor"
        xmin = 0
        xmax = 6.0
        intervals: size = 4
        intervals [1]:
            xmin = 0
            xmax = 1.2
            text = ""
        intervals [2]:
            xmin = 1.2
            xmax = 2.5
            text = "Hello? Hi. <UNSURE>Hello how</UNSURE> um."
        intervals [3]:
            xmin = 2.5
            xmax = 4.0
            text = "<UNIN/> Sorry to hear that."
        intervals [4]:
            xmin = 4.0
            xmax = 6.0
            text = "Okay, fine."
'''
# the published files end most lines with a space: keep that in the fixture
TEXTGRID = "\n".join(line + " " if line else line for line in _TG.splitlines()) + "\n"


def test_primock57_layout(tmp_path):
    root = tmp_path / "primock57"
    for spk in ("doctor", "patient"):
        _wav(root / "audio" / f"day1_consultation01_{spk}.wav", 6.0)
        (root / "transcripts").mkdir(parents=True, exist_ok=True)
        (root / "transcripts" / f"day1_consultation01_{spk}.TextGrid").write_text(TEXTGRID)
    items = load_dataset("primock57", root)
    assert [i.id for i in items] == ["day1_consultation01_doctor", "day1_consultation01_patient"]
    assert items[0].reference == "Hello? Hi. Hello how um. Sorry to hear that. Okay, fine."
    audio, ref = items[0].load(max_seconds=4.0)  # crop: utterances ending by 4.0 s
    assert len(audio) == 4 * 16000
    assert ref == "Hello? Hi. Hello how um. Sorry to hear that."


def test_primock_markup():
    assert clean_primock_text("<UNIN/> a <UNSURE>b c</UNSURE> d") == "a b c d"
    segs = read_textgrid_from_text(TEXTGRID)
    assert [s[:2] for s in segs] == [(1.2, 2.5), (2.5, 4.0), (4.0, 6.0)]


def read_textgrid_from_text(text, tmp=None):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.TextGrid"
        p.write_text(text)
        return read_textgrid(p)


def test_primock57_missing_transcript_named(tmp_path):
    root = tmp_path / "p"
    _wav(root / "audio" / "day1_consultation01_doctor.wav")
    (root / "transcripts").mkdir()
    with pytest.raises(DataError, match="day1_consultation01_doctor.TextGrid"):
        load_dataset("primock57", root)


def test_librispeech_style_trans_txt(tmp_path):
    root = tmp_path / "ls" / "test-clean" / "1089" / "134686"
    _wav(root / "1089-134686-0000.flac")
    _wav(root / "1089-134686-0001.flac")
    (root / "1089-134686.trans.txt").write_text(
        "1089-134686-0000 HE HOPED THERE WOULD BE STEW\n1089-134686-0001 STUFF IT INTO YOU\n")
    items = load_dataset("librispeech-long", tmp_path / "ls")
    assert [i.reference for i in items] == ["HE HOPED THERE WOULD BE STEW", "STUFF IT INTO YOU"]


def _ls_long(root):
    """The published LibriSpeech-Long archive (v0_1.tar.gz): ``librispeech-long/<split>/<speaker>/
    <chapter>/<chapter>_<segment:04d>.flac`` with a same-stem ``.txt`` of one line, no newline."""
    for split, spk, chap, seg, text in [("test-clean", "1089", "134686", 0, "HE HOPED THERE WOULD BE STEW"),
                                        ("test-clean", "1089", "134686", 1, "STUFF IT INTO YOU"),
                                        ("test-clean", "121", "121726", 0, "ALSO A POPULAR CONTRIVANCE"),
                                        ("dev-other", "116", "288045", 0, "AS I APPROACHED THE CITY")]:
        stem = root / split / spk / chap / f"{chap}_{seg:04d}"
        _wav(stem.with_suffix(".flac"))
        stem.with_suffix(".txt").write_text(text)
    return root


def test_librispeech_long_published_layout(tmp_path):
    root = _ls_long(tmp_path / "librispeech-long")
    items = load_dataset("librispeech-long", root)
    assert [i.id for i in items] == ["116-288045-0000", "1089-134686-0000", "1089-134686-0001",
                                     "121-121726-0000"]
    assert items[1].reference == "HE HOPED THERE WOULD BE STEW"
    test = load_dataset("librispeech-long", root, split="test-clean")
    assert [i.id for i in test] == ["1089-134686-0000", "1089-134686-0001", "121-121726-0000"]
    assert all("test-clean" in i.audio_path.parts for i in test)


def test_librispeech_long_unknown_split_lists_present(tmp_path):
    root = _ls_long(tmp_path / "librispeech-long")
    with pytest.raises(DataError, match="test-other.*dev-other, test-clean"):
        load_dataset("librispeech-long", root, split="test-other")


def test_librispeech_long_empty_reference_named(tmp_path):
    root = _ls_long(tmp_path / "librispeech-long")
    (root / "test-clean" / "121" / "121726" / "121726_0000.txt").write_text("\n")
    with pytest.raises(DataError, match="121726_0000.txt: empty reference"):
        load_dataset("librispeech-long", root, split="test-clean")


def test_librispeech_missing_reference_named(tmp_path):
    _wav(tmp_path / "a" / "x.flac")
    with pytest.raises(DataError, match="x.flac: no reference"):
        load_dataset("librispeech-long", tmp_path / "a")


def test_dir_and_manifest(tmp_path):
    _wav(tmp_path / "d" / "a.wav")
    (tmp_path / "d" / "a.txt").write_text("hello there\n")
    assert load_dataset("dir", tmp_path / "d")[0].reference == "hello there"
    with pytest.raises(DataError, match="--dataset dir has no splits"):  # not silently ignored
        load_dataset("dir", tmp_path / "d", split="test")
    _wav(tmp_path / "m" / "audio" / "test_long" / "c0.flac", 3.0)
    pl.DataFrame({"id": ["c0", "c1"], "split": ["test_long", "train"],
                  "audio_path": ["audio/test_long/c0.flac", "audio/train/c1.flac"], "duration": [3.0, 1.0],
                  "text": ["one two three", "x"], "words": [["one", "two", "three"], ["x"]],
                  "word_start": [[0.1, 1.1, 2.1], [0.0]], "word_end": [[0.9, 1.9, 2.9], [0.5]]}
                 ).write_parquet(tmp_path / "m" / "manifest.parquet")
    items = load_dataset("manifest", tmp_path / "m", split="test_long")
    assert len(items) == 1 and items[0].id == "c0"
    audio, ref = items[0].load(max_seconds=2.0)
    assert ref == "one two" and len(audio) == 32000
    with pytest.raises(DataError, match="split == 'nope'"):
        load_dataset("manifest", tmp_path / "m", split="nope")


def test_load_audio_resamples_and_downmixes(tmp_path):
    p = _wav(tmp_path / "s.wav", seconds=2.0, rate=22050, channels=2)
    a = load_audio(p)
    assert a.dtype == np.float32 and a.ndim == 1 and len(a) == 32000
    with pytest.raises(DataError, match="nope.wav: file not found"):
        load_audio(tmp_path / "nope.wav")


def test_unknown_dataset_kind(tmp_path):
    with pytest.raises(DataError, match="choose one of"):
        load_dataset("tedlium", tmp_path)


def _longspeech(root, task, rows):
    import json

    meta = root / "LongSpeechQA" / task / "test.jsonl"
    meta.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (lang, ref) in enumerate(rows):
        audio = f"LongSpeech_p1/wavs/part_00/{task}{i:06d}.wav"
        _wav(root / audio, seconds=0.5)
        lines.append(json.dumps({"task": task, "language": lang, "messages": [
            {"role": "user", "audio": audio, "content": "Transcribe the audio."},
            {"role": "assistant", "content": ref}]}))
    meta.write_text("\n".join(lines) + "\n")
    return meta


def test_longspeech_layout_task_and_language(tmp_path):
    _longspeech(tmp_path, "ASR", [("en", "hello world"), ("fr", "bonjour le monde"), ("fr", "au revoir")])
    _longspeech(tmp_path, "translation", [("en2fr", "bonjour"), ("en2de", "hallo")])
    fr = load_dataset("longspeech", tmp_path, split="asr-fr")
    assert [i.reference for i in fr] == ["bonjour le monde", "au revoir"]
    assert [i.id for i in fr] == ["ASR-000001", "ASR-000002"]  # the row index in the task file
    assert all(i.task == "transcribe" and i.audio_path.is_file() for i in fr)
    assert len(load_dataset("longspeech", tmp_path, split="ASR")) == 3
    assert len(load_dataset("longspeech", tmp_path, split="asr:FR", limit=1)) == 1
    (tr,) = load_dataset("longspeech", tmp_path, split="translation:en2fr")
    assert tr.task == "translate" and tr.reference == "bonjour"
    audio, ref = tr.load()
    assert len(audio) == 8000 and ref == "bonjour"


def test_longspeech_errors_name_file_line_and_field(tmp_path):
    meta = _longspeech(tmp_path, "ASR", [("fr", "un"), ("fr", "deux")])
    with pytest.raises(DataError, match="languages present: fr"):
        load_dataset("longspeech", tmp_path, split="ASR:de")
    with pytest.raises(DataError, match="needs --split"):
        load_dataset("longspeech", tmp_path)
    with pytest.raises(DataError, match="task must be one of"):
        load_dataset("longspeech", tmp_path, split="summary")
    with pytest.raises(DataError, match="LongSpeechQA/translation/test.jsonl: not found"):
        load_dataset("longspeech", tmp_path, split="translation")
    lines = meta.read_text().splitlines()
    meta.write_text(lines[0] + "\n" + lines[1].replace('"audio"', '"sound"') + "\n")
    with pytest.raises(DataError, match=r"test.jsonl:2: field 'messages\[0\].audio'"):
        load_dataset("longspeech", tmp_path, split="ASR")
    meta.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(DataError, match="test.jsonl:2: not JSON"):
        load_dataset("longspeech", tmp_path, split="ASR")


# ----------------------------------------------------------------------------- --reference
def test_reference_values_text_or_file(tmp_path, monkeypatch):
    from kvsim.live.data import from_paths

    monkeypatch.chdir(tmp_path)
    a, b, c = (_wav(tmp_path / f"{n}.wav") for n in "abc")
    (tmp_path / "refs").mkdir()
    (tmp_path / "refs" / "b.txt").write_text(" words of b \n")
    (tmp_path / "refs" / "c").write_text("words of c")
    items = from_paths([a, b, c], ["and/or the text itself", "refs/b.txt", "refs/c"])
    assert [i.reference for i in items] == ["and/or the text itself", "words of b", "words of c"]


@pytest.mark.parametrize("value", ["refs/typo.txt", "typo.TXT", "refs/typo"])
def test_reference_that_looks_like_a_missing_file_is_an_error(tmp_path, monkeypatch, value):
    from kvsim.live.data import from_paths

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=f"^--reference {value}: no such file or directory$"):
        from_paths([_wav(tmp_path / "a.wav")], [value])


def test_reference_file_that_is_a_folder_or_empty_is_named(tmp_path):
    from kvsim.live.data import from_paths

    a = _wav(tmp_path / "a.wav")
    (tmp_path / "d.txt").mkdir()
    (tmp_path / "e.txt").write_text("  \n")
    with pytest.raises(DataError, match=f"--reference {tmp_path / 'd.txt'}: is a directory"):
        from_paths([a], [str(tmp_path / "d.txt")])
    with pytest.raises(DataError, match=f"--reference {tmp_path / 'e.txt'}: empty reference"):
        from_paths([a], [str(tmp_path / "e.txt")])


def test_reference_count_must_match_the_audio_files(tmp_path):
    from kvsim.live.data import from_paths

    a, b = _wav(tmp_path / "in" / "a.wav"), _wav(tmp_path / "in" / "b.wav")
    with pytest.raises(DataError, match="--reference: 2 values for 1 input"):
        from_paths([a], ["one", "two"])
    with pytest.raises(DataError, match="--reference: 1 value for 2 inputs"):
        from_paths([a, b], ["one"])
    with pytest.raises(DataError, match=f"--reference: {tmp_path / 'in'} is a folder"):
        from_paths([tmp_path / "in"], ["one"])
