"""``kvsim study voxzip-decay`` (VoxZip Table 5 analogue): the decayed score against a direct
computation from the trace's arrays, the table, and the live part on the tiny backbone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import soundfile as sf
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.replay.engine import ReplayConfig
from kvsim.studies.voxzip_decay import PAPER_COLUMN, PAPER_TABLE5_PM_ACCURACY, replay_sweep
from kvsim.synth import SynthConfig, synthesize
from kvsim.trace import Trace, write_trace

#: float32 softmax rows (each probability within ~1e-6 relative of float64), summed over at most
#: 32 window queries and a GQA group: absolute error far below 1e-5 on scores of order 1.
TOL = 1e-5


def _trace(tmp_path: Path) -> Trace:
    data = synthesize(SynthConfig(preset="tiny", audio_seconds=12, decode_steps=8, seed=5))
    return Trace(write_trace(tmp_path / "tiny.kvtrace", data))


def _window_attention(trace: Trace, layer: int) -> np.ndarray:
    """(H_kv, W, T_a) float64: each window query's softmax over every key it sees, audio
    columns, summed over the q-heads of each KV group (computed here from the raw arrays)."""
    m = trace.meta.model
    g = m.n_q_heads // m.n_kv_heads
    window = np.asarray(trace.window_positions)
    rows = [trace.query_index(int(p)) for p in window]
    q = np.asarray(trace.queries(layer), dtype=np.float64)[:, rows]  # (H_q, W, D)
    k = np.asarray(trace.keys(layer), dtype=np.float64)  # (H_kv, N, D)
    logits = np.einsum("hwd,hnd->hwn", q, np.repeat(k, g, axis=0)) / np.sqrt(m.head_dim)
    logits[:, np.arange(k.shape[1])[None, :] > window[:, None]] = -np.inf
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p[:, :, trace.audio_positions].reshape(m.n_kv_heads, g, len(window), -1).sum(1)


def test_decayed_score_matches_a_direct_computation(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    # the audio-only scope keeps the prefill score (the generation scope adds decode steps to it)
    frame, results = replay_sweep([trace], [0.5, 1.0], [0.3], ReplayConfig(error_stride=4), scope="audio")
    assert frame["gamma"].to_list() == [0.5, 1.0] and frame["budget"].to_list() == [0.3, 0.3]
    by_gamma = {r.spec.params["gamma"]: r.policy.scores_ for r in results}
    for layer in range(trace.meta.model.n_layers):
        att = _window_attention(trace, layer)
        w = att.shape[1]
        # γ = 1.0: the plain accumulated score, the sum of the window's attention
        np.testing.assert_allclose(by_gamma[1.0][layer], att.sum(1), atol=TOL, rtol=0)
        # γ = 0.5: the latest window query weighs 1, the one before 0.5, ... (A ← γ·A + a)
        weights = 0.5 ** np.arange(w - 1, -1, -1)
        np.testing.assert_allclose(by_gamma[0.5][layer], np.einsum("hwt,w->ht", att, weights), atol=TOL, rtol=0)
    # the decay changes which audio the policy keeps on this trace, and so what replay measures
    assert not np.array_equal(*(np.argsort(-by_gamma[g], axis=-1)[..., :5] for g in (0.5, 1.0)))


def _dataset(root: Path) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir()
    sf.write(str(root / "c0.wav"), (0.1 * rng.standard_normal(16000 * 4)).astype(np.float32), 16000)
    pl.DataFrame({"id": ["c0"], "audio_path": ["c0.wav"], "text": ["some reference words"],
                  "duration": [4.0], "split": ["test_30_60"]}).write_parquet(root / "manifest.parquet")
    return root


def test_study_end_to_end_replay_and_tiny_live(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    out = tmp_path / "out"
    args = ["study", "voxzip-decay", str(trace.path), "--gamma", "0.95,1.0", "-b", "0.05,0.3",
            "--model", "tiny", "--dataset-root", str(_dataset(tmp_path / "data")), "--limit", "1",
            "--max-new-tokens", "4", "-o", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    for suffix in (".md", ".parquet", "_live.parquet", ".html", ".png"):
        assert (out / f"voxzip-decay{suffix}").exists(), suffix
    replay = pl.read_parquet(out / "voxzip-decay.parquet")
    assert replay.height == 4 and set(replay["gamma"]) == {0.95, 1.0}
    # VoxZip's generation scope: each head starts at b = floor(r·T_a) and loses one audio token
    # per generated token down to its min(4, b) sinks, so the mean r_GPU lies between the two
    n_audio = trace.n_audio
    for b, r in zip(replay["budget"], replay["r_gpu"], strict=True):
        per_head = int(b * n_audio)
        assert min(4, per_head) / n_audio - 1e-9 <= r <= per_head / n_audio + 1e-9
    # more budget keeps more of the attention, at every γ
    recall = {(b, g): r for b, g, r in replay.select("budget", "gamma", "attn_recall").iter_rows()}
    assert all(recall[(0.3, g)] > recall[(0.05, g)] for g in (0.95, 1.0))
    live = pl.read_parquet(out / "voxzip-decay_live.parquet")
    assert sorted(live["label"].to_list()) == ["full", "voxzip(gamma=0.95)", "voxzip(gamma=0.95)",
                                              "voxzip(gamma=1.0)", "voxzip(gamma=1.0)"]
    assert live["wer"].is_not_null().all() and (out / "live-voxzip-decay" / "runs.parquet").exists()
    md = (out / "voxzip-decay.md").read_text()
    assert "Encoder padding: counted as audio" in md
    rows = [line.split(" | ") for line in md.splitlines() if line.startswith(("| full |", "| voxzip |"))]
    assert [r[0] for r in rows] == ["| full"] + ["| voxzip"] * 4  # full cache once, then budget × γ
    assert [r[1] for r in rows] == ["1.000", "0.050", "0.050", "0.300", "0.300"]
    assert [r[2] for r in rows] == ["–", "0.950", "1.000", "0.950", "1.000"]
    assert PAPER_COLUMN.split(" (")[0] in md
    assert f"{PAPER_TABLE5_PM_ACCURACY[0.95]:.3f}" in md and f"{PAPER_TABLE5_PM_ACCURACY[1.0]:.3f}" in md


def test_paper_constants_and_bad_input(tmp_path: Path) -> None:
    assert PAPER_TABLE5_PM_ACCURACY == {1.0: 62.6, 0.95: 76.5}  # VoxZip Table 5, quoted in its text
    res = CliRunner().invoke(app, ["study", "voxzip-decay", "--gamma", "0", "--no-live", "-o", str(tmp_path)])
    assert res.exit_code == 2 and "gamma" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["study", "voxzip-decay", "--dataset-root", str(tmp_path / "nope"),
                                   "-o", str(tmp_path)])
    assert res.exit_code == 2 and "nope" in res.output
