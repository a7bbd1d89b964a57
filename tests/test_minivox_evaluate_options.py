"""python -m kvsim.minivox.evaluate: which clips an evaluation decodes (--limit, --shard, --ids)
and the --speed experiment's range."""

from __future__ import annotations

import polars as pl
import pytest

from kvsim.minivox.evaluate import EvalOptions, evaluate


@pytest.fixture
def corpus(tmp_path):
    ids = [f"t-{i:05d}" for i in range(6)]
    pl.DataFrame({"id": ids, "split": ["t"] * 6, "audio_path": [f"audio/{i}.flac" for i in ids]}
                 ).write_parquet(tmp_path / "manifest.parquet")
    return tmp_path


def _ids(rows):
    return [r["id"] for r in rows]


def test_limit_then_shard_then_ids(corpus):
    assert _ids(EvalOptions().rows(corpus, "t")) == [f"t-{i:05d}" for i in range(6)]
    assert _ids(EvalOptions(limit=4, shard=(1, 2)).rows(corpus, "t")) == ["t-00001", "t-00003"]
    picked = EvalOptions(ids=frozenset({"t-00005", "t-00002"})).rows(corpus, "t")
    assert _ids(picked) == ["t-00002", "t-00005"]  # manifest order
    assert _ids(EvalOptions(limit=3, ids=frozenset({"t-00005"})).rows(corpus, "t")) == []
    assert picked[0]["abs_path"] == f"{corpus}/audio/t-00002.flac"


@pytest.mark.parametrize("speed", [0.49, 2.01, 0.0])
def test_a_speed_out_of_range_fails_before_the_model_loads(corpus, speed):
    with pytest.raises(ValueError, match="--speed"):
        evaluate(corpus, ["t"], None, None, EvalOptions(speed=speed))


def test_an_unknown_id_is_one_line_naming_it(corpus, capsys):
    from kvsim.minivox.evaluate import main

    with pytest.raises(ValueError, match="split 't' has no clip 'nope' \\(1 of the --ids unknown\\)"):
        EvalOptions(ids=frozenset({"t-00001", "nope"})).rows(corpus, "t")
    with pytest.raises(SystemExit) as exit_:
        main(["--data", str(corpus), "--splits", "t", "--ids", "t-00001,nope"])
    assert str(exit_.value) == f"error: {corpus}: split 't' has no clip 'nope' (1 of the --ids unknown)"


def test_audio_pieces_cover_the_clip_in_order():
    import numpy as np

    from kvsim.minivox.evaluate import audio_pieces

    audio = np.arange(16000 * 130, dtype=np.float32)
    assert audio_pieces(audio, 0)[0] is audio
    pieces = audio_pieces(audio, 60)
    assert [p.size for p in pieces] == [960000, 1120000]  # the last 10 s (< 15 s) join the 2nd
    assert np.array_equal(np.concatenate(pieces), audio)
    long = np.arange(16000 * 140, dtype=np.float32)
    assert [p.size for p in audio_pieces(long, 60)] == [960000, 960000, 320000]  # 20 s kept
    assert [p.size for p in audio_pieces(audio[: 16000 * 59], 60)] == [16000 * 59]


def test_a_negative_chunk_length_fails_before_the_model_loads(corpus):
    with pytest.raises(ValueError, match="--chunk-seconds -1"):
        evaluate(corpus, ["t"], None, None, EvalOptions(chunk_seconds=-1))


def test_beam_search_is_an_option_refused_beside_the_read_window(corpus):
    from kvsim.decoding.read_window import ReadWindowConfig
    from kvsim.minivox.evaluate import generation_options, main

    assert generation_options() == {"do_sample": False}  # the protocol: greedy
    assert generation_options(num_beams=4) == {"do_sample": False, "num_beams": 4}
    with pytest.raises(ValueError, match="--num-beams must be >= 1"):
        generation_options(num_beams=0)
    with pytest.raises(ValueError, match="--num-beams: not with --read-window"):
        EvalOptions(num_beams=2, read_window=ReadWindowConfig.parse("2,3,8"))
    with pytest.raises(SystemExit) as exit_:
        main(["--data", str(corpus), "--splits", "t", "--num-beams", "2", "--read-window", "2,3,8"])
    assert str(exit_.value).startswith("error: --num-beams: not with --read-window")
