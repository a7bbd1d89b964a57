"""kvsim trace over a batch: (e) bad inputs are reported with their reason and skipped while the
rest complete (exit code 1); (f) an interrupted run resumes, skipping complete traces."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch
from typer.testing import CliRunner

import kvsim.tracer.batch as batch
from kvsim.cli import app
from kvsim.trace.validate import validate_trace
from tests.fixtures.checkpoints import tiny_checkpoint, write_tone

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint("voxtral", tmp_path_factory.getbasetemp())


def _trace(args, ckpt, out):
    return CliRunner().invoke(app, ["trace", *map(str, args), "--model", str(ckpt), "--out",
                                    str(out), "--max-new-tokens", "3", "--aligner", "none"])


def test_bad_inputs_reported_rest_complete(ckpt, tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write_tone(d / "good1.wav", 2.0)
    write_tone(d / "good2.flac", 1.5, rate=44100, channels=2)
    x = np.sin(np.arange(24000) / 7.0).astype(np.float32) * 0.3
    sf.write(str(d / "good3.ogg"), x, 24000, format="OGG", subtype="VORBIS")
    sf.write(str(d / "good4.mp3"), x, 24000)
    sf.write(str(d / "empty.wav"), np.zeros(0, np.float32), 16000)
    sf.write(str(d / "silent.wav"), np.zeros(16000, np.float32), 16000)
    (d / "garbage.mp3").write_bytes(b"\x00\x01 definitely not audio" * 10)
    # the tiny checkpoint's decoder holds 2048 positions: 160 s = 6 chunks x 375 tokens
    sf.write(str(d / "toolong.wav"), np.full(160 * 16000, 0.1, np.float32), 16000)
    out = tmp_path / "out"
    res = _trace([d], ckpt, out)
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert "empty audio" in text
    assert "silent audio" in text
    assert "unreadable audio" in text
    assert "too long" in text
    assert "4 traced" in text and "4 failed" in text
    made = sorted(p.name for p in out.glob("*.kvtrace"))
    assert made == ["good1.kvtrace", "good2.kvtrace", "good3.kvtrace", "good4.kvtrace"]
    for p in made:
        validate_trace(out / p)
    flac = validate_trace(out / "good2.kvtrace").meta.audio
    assert flac["source_sample_rate"] == 44100 and flac["source_channels"] == 2
    assert flac["sample_rate"] == 16000 and flac["duration_s"] == pytest.approx(1.5, abs=1e-3)
    assert not list(out.glob("*.tmp-*"))


def test_interrupted_run_resumes(ckpt, tmp_path, monkeypatch):
    inputs = [write_tone(tmp_path / f"c{i}.wav", 1.0 + i * 0.5, seed=i) for i in range(3)]
    out = tmp_path / "out"
    real = batch.generate_traced
    calls = []

    def interrupt_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(batch, "generate_traced", interrupt_second)
    res = _trace(inputs, ckpt, out)  # Ctrl-C during the second input: click aborts
    assert res.exit_code == 130  # SIGINT
    assert [p.name for p in out.glob("*.kvtrace")] == ["c0.kvtrace"]
    first = out / "c0.kvtrace"
    stamp = (first / "meta.json").stat().st_mtime_ns
    # leftovers of a killed write, and a broken trace: both must be redone
    (out / "c1.kvtrace.tmp-deadbeef").mkdir()
    (out / "c1.kvtrace.tmp-deadbeef" / "tensors.safetensors").write_bytes(b"partial")
    (out / "c2.kvtrace").mkdir()
    (out / "c2.kvtrace" / "meta.json").write_text("{")
    monkeypatch.setattr(batch, "generate_traced", real)
    res = _trace(inputs, ckpt, out)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "2 traced" in text and "1 already complete" in text
    assert (first / "meta.json").stat().st_mtime_ns == stamp  # untouched
    for p in inputs:
        validate_trace(out / f"{p.stem}.kvtrace")
    assert not list(out.glob("*.tmp-*")) and not list(out.glob("*.old-*"))

    # a third run finds everything complete and does not even load the model
    def no_model(*a, **k):
        raise AssertionError("model loaded although every trace is complete")

    monkeypatch.setattr(batch, "load_backbone", no_model)
    res = _trace(inputs, ckpt, out)
    assert res.exit_code == 0, res.output
    assert "3 already complete" in " ".join(res.output.split())


def test_missing_model_is_one_line_error(tmp_path):
    wav = write_tone(tmp_path / "a.wav", 1.0)
    res = CliRunner().invoke(app, ["trace", str(wav), "--model", str(tmp_path / "nope"),
                                   "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert "not a known name" in " ".join(res.output.split())
    assert "Traceback" not in res.output


@pytest.mark.parametrize("opt", [["--device", "cuda:7"], ["--dtype", "float8"]])
def test_bad_device_or_dtype_is_one_line_error(ckpt, tmp_path, opt):
    wav = write_tone(tmp_path / "a.wav", 1.0)
    res = CliRunner().invoke(app, ["trace", str(wav), "--model", str(ckpt), "--out",
                                   str(tmp_path / "o"), *opt])
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert ("--device" in text or "--dtype" in text) and "Traceback" not in text


def test_single_token_answer_has_no_decode_step(ckpt, tmp_path):
    """One generated token: nothing is fed back, the trace holds the prompt only."""
    wav = write_tone(tmp_path / "a.wav", 1.0)
    res = CliRunner().invoke(app, ["trace", str(wav), "--model", str(ckpt), "--out",
                                   str(tmp_path / "o"), "--max-new-tokens", "1",
                                   "--aligner", "none"])
    assert res.exit_code == 0, res.output
    tr = validate_trace(tmp_path / "o" / "a.kvtrace")
    assert tr.meta.n_decode == 0 and tr.meta.n_positions == tr.meta.n_prefill
    assert tr.query_positions[-1] == tr.meta.n_prefill - 1
    assert len(tr.meta.provenance["generation"]["token_ids"]) == 1


@pytest.mark.parametrize("command", ["trace", "calibrate"])
def test_unknown_language_is_one_line_before_the_model(tmp_path, command):
    wav = write_tone(tmp_path / "a.wav", 1.0)
    out = tmp_path / ("out" if command == "trace" else "out/h.json")
    res = CliRunner().invoke(app, [command, str(wav), "--model", "minivox", "--language", "zz",
                                   "-o", str(out)])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    (line,) = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert line.startswith("error: --language zz: ") and "en, fr" in line, res.output
    assert not (tmp_path / "out").exists()
