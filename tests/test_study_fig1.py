"""``kvsim study fig1`` (WnW §2.1 / Fig. 1) on a trace whose attention is known in closed form."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.studies.fig1 import GRID_BINS, cumulative_on_grid
from kvsim.studies.mismatch import PAPER_VOXTRAL
from kvsim.synth import SynthConfig, synthesize
from kvsim.trace import write_trace

N_AUDIO = 250  # 20 s at 12.5 audio tokens/s
LOGIT = 4.0  # logit of the favoured audio tokens; every other audio logit is 0
PREFILL_TOP = np.arange(0, 100)  # audio tokens the first answer token favours
DECODE_TOP = np.arange(50, 150)  # audio tokens every decode step favours
#: float32 softmax over a few hundred keys: each probability within ~1e-6 relative of the
#: float64 value; sums of 250 of them and the linear interpolation stay well within 1e-5.
TOL = 1e-5


def _known_trace(tmp_path: Path, name: str = "known") -> tuple[Path, int]:
    """A tiny trace whose audio keys carry ``LOGIT`` along e0 on PREFILL_TOP and along e1 on
    DECODE_TOP (every other key zero); the first answer token's query reads e0 and every decode
    query e1, so the prefill distribution is ∝ exp(LOGIT) on PREFILL_TOP and 1 elsewhere, and
    each decode step's the same on DECODE_TOP. Returns the path and the answer-token count."""
    data = synthesize(SynthConfig(preset="tiny", audio_seconds=N_AUDIO / 12.5, decode_steps=6, seed=1))
    d = data.meta.model.head_dim
    audio = np.flatnonzero(data.positions["kind"].to_numpy() == "audio")
    assert len(audio) == N_AUDIO
    data.keys[:] = 0.0
    data.keys[:, :, audio[PREFILL_TOP], 0] = LOGIT
    data.keys[:, :, audio[DECODE_TOP], 1] = LOGIT
    data.queries[:] = 0.0
    qpos = np.asarray(data.query_positions)
    first = data.meta.n_prefill - 1
    data.queries[:, :, qpos == first, 0] = np.sqrt(d)  # q·k/√d = LOGIT on PREFILL_TOP
    data.queries[:, :, qpos > first, 1] = np.sqrt(d)
    return write_trace(tmp_path / f"{name}.kvtrace", data), int((qpos >= first).sum())


def _expected(n_answer: int) -> tuple[np.ndarray, np.ndarray]:
    """The prefill and decode-cumulative audio distributions in float64, in closed form."""
    def peaked(top: np.ndarray) -> np.ndarray:
        w = np.ones(N_AUDIO)
        w[top] = np.exp(LOGIT)
        return w / w.sum()

    pre = peaked(PREFILL_TOP)
    return pre, (pre + (n_answer - 1) * peaked(DECODE_TOP)) / n_answer


def test_cumulative_on_grid_known_answers() -> None:
    x, cum = cumulative_on_grid(np.ones(7), bins=10)
    np.testing.assert_allclose(cum, x, atol=1e-15)  # uniform mass: the diagonal
    x, cum = cumulative_on_grid(np.array([1.0, 0.0, 0.0, 1.0]), bins=4)
    assert cum.tolist() == [0.0, 0.5, 0.5, 0.5, 1.0]  # each token's mass over its quarter
    with pytest.raises(ValueError):
        cumulative_on_grid(np.zeros(3))


def test_fig1_on_a_known_trace(tmp_path: Path) -> None:
    path, n_answer = _known_trace(tmp_path)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["study", "fig1", str(path), "-o", str(out)])
    assert res.exit_code == 0, res.output
    for suffix in (".md", ".parquet", "_heads.parquet", "_stats.parquet", ".html", ".png"):
        assert (out / f"fig1{suffix}").exists(), suffix
    curves = pl.read_parquet(out / "fig1.parquet")
    pre, dec = _expected(n_answer)
    for label, p in (("prefill", pre), ("decode-cumulative", dec)):
        c = curves.filter(pl.col("distribution") == label)
        cum = c["cumulative"].to_numpy()
        assert c.height == GRID_BINS + 1 and cum[0] == 0.0 and cum[-1] == 1.0
        assert (np.diff(cum) >= 0).all()
        # where x·T_a is a whole number n of tokens, the curve is the mass of the first n tokens
        tokens = c["position"].to_numpy() * N_AUDIO
        whole = np.abs(tokens - np.rint(tokens)) < 1e-9
        assert whole.sum() == GRID_BINS // 2 + 1  # x = k/100, T_a = 250: every even k
        expected = np.concatenate([[0], np.cumsum(p)])[np.rint(tokens[whole]).astype(int)]
        np.testing.assert_allclose(cum[whole], expected, atol=TOL)
    # top-100 sets: PREFILL_TOP vs DECODE_TOP (decode weighs n_answer-1 steps against 1): 50/150
    heads = pl.read_parquet(out / "fig1_heads.parquet")
    assert heads.height == 2 * 2 and heads["jaccard"].to_list() == [pytest.approx(1 / 3, abs=1e-12)] * 4
    stats = pl.read_parquet(out / "fig1_stats.parquet").row(0, named=True)
    assert stats["prefill_first10"] == pytest.approx(pre[:25].sum(), abs=TOL)
    assert stats["decode_first_half"] == pytest.approx(dec[:125].sum(), abs=TOL)
    md = (out / "fig1.md").read_text()
    assert f"{PAPER_VOXTRAL['jaccard_top100']:.3f}" in md and "| 0.333 |" in md


def test_quick_takes_the_first_trace_and_bad_input_is_one_line(tmp_path: Path) -> None:
    a, _ = _known_trace(tmp_path, "a")
    b, _ = _known_trace(tmp_path, "b")
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["study", "fig1", str(a), str(b), "--quick", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert pl.read_parquet(out / "fig1_stats.parquet")["trace"].to_list() == ["a"]
    res = CliRunner().invoke(app, ["study", "fig1", str(tmp_path / "missing.kvtrace"), "-o", str(out)])
    assert res.exit_code == 2 and "missing.kvtrace" in res.output and "Traceback" not in res.output
    (b / "meta.json").write_text("{")
    res = CliRunner().invoke(app, ["study", "fig1", str(a), str(b), "-o", str(out)])
    assert res.exit_code == 2 and "b.kvtrace" in res.output and "meta.json" in res.output


def test_paper_constants_are_the_papers() -> None:
    from kvsim.studies.fig1 import (
        HEAD_K,
        PAPER_N_HEADS,
        PAPER_N_SAMPLES,
        PAPER_RANDOM_JACCARD_TOP100,
    )

    # WnW §2.1: "random baseline ≈ K/T_a (0.013 at K=100)"; "per-head Jaccard (K=100) ... across
    # the 240 heads"; Fig. 1: "averaged across 50 samples"
    assert (PAPER_RANDOM_JACCARD_TOP100, HEAD_K, PAPER_N_HEADS, PAPER_N_SAMPLES) == (0.013, 100, 240, 50)
