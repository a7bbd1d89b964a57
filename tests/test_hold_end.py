"""Hold the end (kvsim.decoding.hold_end): no end of answer before the reader is near the end of the speech."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvsim.decoding.hold_end import HoldEnd, speech_tokens, speech_tokens_of
from kvsim.decoding.read_window import ReadWindow, ReadWindowConfig, register_read_window
from kvsim.minivox.evaluate import EvalOptions, decode_clip, generation_options, main
from kvsim.minivox.modeling import AUDIO_TOKENS_PER_SECOND as RATE
from tests.test_minivox_model import _tiny_model, _tiny_tokenizer


def test_speech_tokens_count_every_token_that_holds_a_sample():
    assert speech_tokens(1280, 16000, 12.5) == 1  # one token is 80 ms
    assert speech_tokens(1281, 16000, 12.5) == 2
    assert speech_tokens(16000 * 40, 16000, 12.5) == 500  # 40 s of a 60 s (750-token) prompt


@pytest.mark.parametrize("samples", [1, 1280, 1281, 16000 * 40, 16000 * 40 + 7, 16000 * 60])
def test_the_padding_marks_count_the_same_speech_tokens(samples):
    """The prompt's padding marks (kvsim live) and the sample count (the evaluation) agree:
    a token starting at or after the input's end is padding (the tracer's rule)."""
    from kvsim.tracer.backbones.base import Backbone

    starts = np.arange(750) / 12.5  # one 60 s window of 750 tokens
    padding = Backbone.padding_beyond(starts, samples / 16000)
    assert speech_tokens_of(padding) == speech_tokens(samples, 16000, 12.5)


def test_speech_tokens_of_reads_the_last_token_that_is_not_padding():
    assert speech_tokens_of(np.array([False, False, True, True])) == 2
    assert speech_tokens_of(np.array([False, True, False, True])) == 3
    assert speech_tokens_of(np.zeros(5, dtype=bool)) == 5
    assert speech_tokens_of(np.ones(5, dtype=bool)) == 0


def _window(n_audio: int = 100) -> ReadWindow:
    return ReadWindow(ReadWindowConfig(layers=(1,)), audio_start=2, n_audio=n_audio, audio_tokens_per_s=RATE)


def test_the_end_is_held_until_the_position_is_within_the_margin():
    window = _window()
    hold = HoldEnd(window, n_speech=90, hold_s=2.0, eos_ids=[2, 5], audio_tokens_per_s=RATE)
    assert hold.end == 90 - 25
    scores = torch.zeros(1, 8)
    scores[0, 5] = 3.0  # an end token is the greedy choice
    for position, held in ((0, True), (64, True), (65, False), (99, False)):
        window.reading.position = position
        out = hold(torch.zeros(1, 4, dtype=torch.long), scores)
        assert hold.holding is held
        if held:
            assert math.isinf(out[0, 2]) and math.isinf(out[0, 5]) and out[0, 2] < 0
            assert torch.equal(out[0, [0, 1, 3, 4, 6, 7]], scores[0, [0, 1, 3, 4, 6, 7]])
        else:
            assert torch.equal(out, scores)
    assert hold.held == 2 and scores[0, 5] == 3.0  # the caller's scores are left as they were
    scores = torch.zeros(1, 8)
    scores[0, 7] = 3.0  # not an end: held back nothing, though the end tokens stay banned
    window.reading.position = 0
    assert math.isinf(hold(torch.zeros(1, 4, dtype=torch.long), scores)[0, 2]) and hold.held == 2


@pytest.mark.parametrize("n_speech, hold_s, message", [
    (0, 1.0, "0 speech tokens"), (101, 1.0, "101 speech tokens of 100"), (50, -1.0, "must be >= 0"),
    (50, math.inf, "must be >= 0")])
def test_bad_hold_end_arguments_are_refused(n_speech, hold_s, message):
    with pytest.raises(ValueError, match=message):
        HoldEnd(_window(), n_speech, hold_s, [2], RATE)
    assert HoldEnd(_window(), 100, 0.0, [2], RATE).end == 100  # speech to the last token, no margin


@pytest.fixture
def tiny_with_an_end():
    """The tiny minivox whose end token is what it writes first from the clip below: plain
    greedy decoding ends after one token."""
    from kvsim.minivox.processing import MinivoxProcessor

    tok = _tiny_tokenizer()
    model = _tiny_model(len(tok))
    model.set_attn_implementation({"text_config": register_read_window()})
    proc = MinivoxProcessor(tok, "<empty_output>")
    audio = (np.random.default_rng(5).standard_normal(16000 * 3) * 0.1).astype(np.float32)
    first = model.generate(**proc(audio=audio), max_new_tokens=1, do_sample=False)[0, -1]
    model.generation_config.eos_token_id = int(first)
    return model, proc, audio, int(first)


def test_decoding_goes_on_past_a_held_end_and_ends_near_the_end_of_the_speech(tiny_with_an_end):
    model, proc, audio, eos = tiny_with_an_end
    window = ReadWindowConfig(0.2, 0.4, 2, layers=(1, 2))
    plain = decode_clip(model, proc, audio, 400, EvalOptions(read_window=window), generation_options())
    assert plain.n_gen == 1 and plain.end_holds == 0
    held = decode_clip(model, proc, audio, 400, EvalOptions(read_window=window, hold_end=0.5),
                       generation_options())
    assert held.n_gen > 1 and held.end_holds >= 1
    # token by token: an end token only where the position had come within the margin
    from transformers import LogitsProcessorList

    from kvsim.decoding.read_window import ReadPastEnd, reading_with

    inp = proc(audio=audio)
    reader = ReadWindow.for_inputs(window, inp["input_ids"], proc.audio_token_id, RATE)
    hold = HoldEnd(reader, speech_tokens(audio.size, 16000, RATE), 0.5, [eos], RATE)
    with reading_with(reader), torch.no_grad():
        out = model.generate(**inp, max_new_tokens=200, do_sample=False,
                             logits_processor=LogitsProcessorList([hold]),
                             stopping_criteria=ReadPastEnd.criteria(reader))
    tokens = out[0, inp["input_ids"].shape[1]:].tolist()
    assert eos not in tokens[:-1] and hold.held >= 1
    # token i > 0 was chosen after decode step i - 1 moved the position to path[i - 1]
    assert tokens[-1] != eos or reader.reading.path[len(tokens) - 2] >= hold.end
    assert tokens[-1] == eos or reader.reading.past_end or len(tokens) == 200


def test_the_cli_needs_the_window_and_records_the_holds(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--hold-end: needs --read-window"):
        main(["--data", str(tmp_path), "--splits", "dev", "--hold-end", "3"])
    with pytest.raises(SystemExit, match="--hold-end -1.0: seconds >= 0"):
        main(["--data", str(tmp_path), "--splits", "dev", "--read-window", "2,3,8", "--hold-end", "-1"])


def test_the_records_carry_the_hold_and_the_reach(tiny_with_an_end, tmp_path, monkeypatch):
    import json

    import polars as pl
    import soundfile as sf

    import kvsim.minivox.evaluate as ev

    model, proc, audio, _ = tiny_with_an_end
    (tmp_path / "audio").mkdir()
    sf.write(tmp_path / "audio" / "t-0.flac", audio, 16000)
    pl.DataFrame({"id": ["t-0"], "split": ["t"], "audio_path": ["audio/t-0.flac"],
                  "duration": [3.0], "text": ["a b c"]}).write_parquet(tmp_path / "manifest.parquet")
    monkeypatch.setattr(ev, "load_for", lambda adapter, opts: (model, proc))
    out = tmp_path / "r.jsonl"
    main(["--data", str(tmp_path), "--splits", "t", "--read-window", "0.2,0.4,2,1-2",
          "--hold-end", "0.5", "--others-reach", "1,inf", "--out", str(out)])
    rec = json.loads(out.read_text())
    assert (rec["read_window"], rec["hold_end"], rec["others_reach"]) == ("0.2,0.4,2,1-2", 0.5, "1,inf")
    assert rec["end_holds"] >= 1 and rec["n_gen"] > 1
    main(["--data", str(tmp_path), "--splits", "t", "--read-window", "0.2,0.4,2,1-2", "--out", str(out)])
    rec = json.loads(out.read_text())
    assert rec["n_gen"] == 1 and not {"hold_end", "end_holds", "others_reach"} & rec.keys()
