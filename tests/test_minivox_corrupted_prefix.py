"""scripts/minivox_corrupted_prefix.py: the corrupted transcript and the read error."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import load_script


def _script():
    return load_script("minivox_corrupted_prefix")


def test_corrupted_text_replaces_the_words_at_the_fraction_and_keeps_the_rest():
    text = " ".join(f"t{i}" for i in range(20))
    other = " ".join(f"o{i}" for i in range(10))
    out, first = _script().corrupted_text(text, other, at=0.4, n_words=5)
    assert first == 8
    assert out.split() == [f"t{i}" for i in range(8)] + [f"o{i}" for i in range(5)] + [
        f"t{i}" for i in range(13, 20)]
    # near the end the passage moves back so that one true word still follows it
    out, first = _script().corrupted_text(text, other, at=0.99, n_words=5)
    assert first == 14 and out.split()[-1] == "t19" and out.split()[14:19] == [f"o{i}" for i in range(5)]
    with pytest.raises(ValueError, match="need 12 words"):
        _script().corrupted_text(text, other, at=0.4, n_words=12)


def test_read_error_is_zero_inside_the_word_and_seconds_outside():
    spans = np.array([[10, 20], [10, 20], [10, 20], [10, 20]])  # audio tokens [10, 20)
    peak = np.array([15, 19, 20, 5])
    err = _script().read_error_s(peak, spans)
    # 12.5 audio tokens per second: one token past the last one is 0.08 s, five before 0.4 s
    assert err.tolist() == pytest.approx([0.0, 0.0, 0.08, 0.4])
