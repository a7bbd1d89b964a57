"""Speed perturbation of training clips: audio, word times, the schedule and the cache name."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch

from kvsim.minivox.augment import (
    parse_factors,
    perturb_rows,
    resample_speed,
    speed_ratio,
    speed_row,
)
from kvsim.minivox.train import encoder_cache, encoder_cache_file, joined_row

SR = 16000


def _tone(hz: float, seconds: float = 2.0) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def _peak_hz(x: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / SR)[np.argmax(spectrum)])


@pytest.mark.parametrize("factor", [0.9, 1.1, 0.95, 1.25])
def test_a_faster_clip_is_shorter_and_higher(factor: float) -> None:
    x = _tone(500.0)
    y = resample_speed(x, factor)
    assert y.dtype == np.float32
    assert len(y) == pytest.approx(len(x) / factor, abs=1)
    # the tone moves to 500 x factor Hz (FFT bin width 0.5 Hz at 2 s; Hann window)
    assert _peak_hz(y) == pytest.approx(500.0 * factor, abs=1.0)
    # energy kept: the anti-aliasing filter passes a 500-625 Hz tone (RMS of 0.5 sin = 0.354)
    assert np.sqrt(np.mean(y[400:-400] ** 2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.01)


def test_factor_one_is_the_clip_itself_and_ratios_are_exact() -> None:
    x = _tone(300.0, 0.5)
    assert resample_speed(x, 1.0) is x
    assert speed_ratio(1.1) == (10, 11)
    assert speed_ratio(0.9) == (10, 9)
    assert speed_ratio(0.95) == (20, 19)


def test_parse_factors() -> None:
    assert parse_factors("") == ()
    assert parse_factors("0.9,1.0,1.1") == (0.9, 1.0, 1.1)
    with pytest.raises(ValueError, match=r"\[0.5, 2\]"):
        parse_factors("0.9,3")
    with pytest.raises(ValueError, match="numbers separated by commas"):
        parse_factors("0.9;1.1")


ROW = {"id": "c-00001", "text": "a b c", "words": ["a", "b", "c"], "duration": 3.3,
       "word_start": [0.2, 1.1, 2.2], "word_end": [0.9, 2.0, 3.0]}


def test_speed_row_scales_times_and_duration_and_keeps_the_original() -> None:
    fast = speed_row(ROW, 1.1)
    assert fast["speed"] == 1.1
    assert fast["duration"] == pytest.approx(3.0)
    assert fast["word_start"] == pytest.approx([0.2 / 1.1, 1.0, 2.0])
    assert fast["word_end"] == pytest.approx([0.9 / 1.1, 2.0 / 1.1, 3.0 / 1.1])
    assert fast["text"] == ROW["text"] and fast["id"] == ROW["id"]
    assert "speed" not in ROW and ROW["duration"] == 3.3  # not modified in place
    joined = speed_row(joined_row([ROW, {**ROW, "id": "c-00002"}]), 0.9)
    assert [p["speed"] for p in joined["parts"]] == [0.9, 0.9]
    assert joined["parts"][1]["word_end"][-1] == pytest.approx(3.0 / 0.9)


def test_perturb_rows_draws_every_factor_deterministically() -> None:
    rows = [{**ROW, "id": f"c-{i}"} for i in range(4)]
    assert perturb_rows(rows, (), seed=0, step=3) == rows
    factors = (0.9, 1.0, 1.1)
    seen = Counter()
    for step in range(100):
        out = perturb_rows(rows, factors, seed=0, step=step)
        assert out == perturb_rows(rows, factors, seed=0, step=step)
        assert [r["id"] for r in out] == [r["id"] for r in rows]
        for r, o in zip(rows, out, strict=True):
            seen[o.get("speed", 1.0)] += 1
            if "speed" not in o:  # factor 1: the row itself (its usual cache entry)
                assert o is r
    assert set(seen) == set(factors)
    assert min(seen.values()) > 100  # 400 draws, about 133 each
    other = [[o.get("speed", 1.0) for o in perturb_rows(rows, factors, seed=1, step=s)]
             for s in range(20)]
    assert other != [[o.get("speed", 1.0) for o in perturb_rows(rows, factors, seed=0, step=s)]
                     for s in range(20)]


def _fake_encoder():
    """A model/processor pair whose 'encoder output' is the audio length, for the cache."""
    seen = []

    def features(audio):
        seen.append(len(audio))
        return torch.full((1, 4), float(len(audio)))

    def tower(feats):
        return SimpleNamespace(last_hidden_state=feats.reshape(1, 1, 4))

    model = SimpleNamespace(model=SimpleNamespace(audio_tower=tower))
    return model, SimpleNamespace(features=features), seen


def test_encoder_cache_resamples_and_names_a_perturbed_clip(tmp_path) -> None:
    audio = tmp_path / "c.flac"
    sf.write(audio, _tone(440.0, 1.1), SR, subtype="PCM_16")
    row = {**ROW, "abs_path": str(audio)}
    model, proc, seen = _fake_encoder()
    cache = tmp_path / "cache"
    plain = encoder_cache(model, proc, row, cache)
    fast = encoder_cache(model, proc, speed_row(row, 1.1), cache)
    assert seen == [17600, 16000]  # the encoder heard the resampled audio
    assert plain[0, 0].item() == 17600 and fast[0, 0].item() == 16000
    names = sorted(p.name for p in cache.iterdir())
    assert names == [encoder_cache_file(row, cache).name, encoder_cache_file(speed_row(row, 1.1), cache).name]
    assert names[0].startswith("c-00001-") and names[1].endswith("@x1.1.npy")
    encoder_cache(model, proc, speed_row(row, 1.1), cache)  # from the cache: no new encoding
    assert seen == [17600, 16000]
    # a corpus regenerated into the same folder: the same id, another clip, encoded afresh
    for change in ({"text": ROW["text"] + " again"}, {"voice": "other"}, {"rate": 1.5},
                   {"duration": 9.0}):
        other = {**row, **change}
        assert encoder_cache_file(other, cache) != encoder_cache_file(row, cache), change
        encoder_cache(model, proc, other, cache)
    assert seen == [17600, 16000] + [17600] * 4
