"""``--padding count|drop``: whether the encoder's padding counts as audio in a replay.

``count`` is the trace as recorded; ``drop`` takes the padding out of the cache before any
policy sees it (kvsim.replay.padding), so budgets, r_GPU, recall and the attention are over the
real audio only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.policies.base import Policy, PolicyContext, PrefillView, StepView, Tier, full_tiers
from kvsim.policies.registry import register
from kvsim.replay.engine import PolicySpec, ReplayConfig, RunResult, replay_trace
from kvsim.replay.padding import PaddingDroppedTrace
from kvsim.synth import SynthConfig, synthesize
from kvsim.trace import Trace, write_trace
from kvsim.trace.writer import TraceData
from tests.float32_bounds import logit_bound, softmax_rel_bound

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "traces" / "minivox-test_30_60-00013.kvtrace"
N_PAD = 23  # padding tokens marked at the end of the synthetic audio


@register
@dataclass
class _PaddingRecorder(Policy):
    """Test policy: keeps every audio token on GPU and records the step attention it sees."""

    name = "_test_padding_recorder"
    needs_step_attention = True
    seen: list = field(default_factory=list, repr=False)

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        self.n_layers = ctx.heads.n_layers
        self.window = [view.audio_attention(la).copy() for la in range(self.n_layers)]
        return full_tiers(ctx)

    def decode_step(self, view: StepView) -> None:
        self.seen.append(np.stack([view.audio_attention(la).copy() for la in range(self.n_layers)]))
        return None


def _synth() -> TraceData:
    return synthesize(SynthConfig(preset="small", audio_seconds=12, decode_steps=10, seed=7))


def _marked(n_pad: int) -> tuple[TraceData, np.ndarray]:
    """The synthetic trace with its last ``n_pad`` audio tokens marked as padding, and the
    (N,) padding mask."""
    data = _synth()
    kinds = data.positions["kind"].to_numpy()
    audio = np.flatnonzero(kinds == "audio")
    pad = np.zeros(len(kinds), dtype=bool)
    pad[audio[len(audio) - n_pad:]] = True
    data.positions = data.positions.with_columns(pl.Series("padding", pad))
    return data, pad


def _cut(data: TraceData, pad: np.ndarray) -> TraceData:
    """The same trace recorded without the padding tokens: their keys, values, queries and
    rows removed, the positions renumbered."""
    keep = ~pad
    q_keep = keep[data.query_positions]
    qpos = (np.cumsum(keep) - 1)[data.query_positions[q_keep]]
    positions = data.positions.filter(pl.Series(keep)).drop("padding")
    qidx = np.full(positions.height, -1, dtype=np.int64)
    qidx[qpos] = np.arange(len(qpos))
    positions = positions.with_columns(pl.Series("position", np.arange(positions.height)),
                                       pl.Series("query_index", qidx))
    meta = dataclasses.replace(data.meta, n_positions=int(keep.sum()),
                               n_prefill=data.meta.n_prefill - int(pad.sum()))
    return TraceData(meta=meta, keys=data.keys[:, :, keep], values=data.values[:, :, keep],
                     queries=data.queries[:, :, q_keep], query_positions=qpos,
                     positions=positions, head_scores=data.head_scores)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trace, Trace]:
    """(the trace with its padding marked, the same trace without the padding column)."""
    d = tmp_path_factory.mktemp("padding")
    marked, _ = _marked(N_PAD)
    return (Trace(write_trace(d / "pad.kvtrace", marked)),
            Trace(write_trace(d / "plain.kvtrace", _synth())))


SPECS = [PolicySpec("full", 1.0), PolicySpec("snapkv", 0.2), PolicySpec("streaming", 0.3),
         PolicySpec("h2o", 0.25), PolicySpec("quest", 0.3)]


def _runs(trace: Trace, padding: str, specs: list[PolicySpec] = SPECS) -> list[RunResult]:
    return replay_trace(trace, specs, ReplayConfig(record_tiers=True, error_stride=1,
                                                   padding=padding))


def test_count_is_the_trace_as_recorded_bit_for_bit(traces: tuple[Trace, Trace]) -> None:
    """``count`` (the default) ignores the padding marks: the trace with them and the same
    trace without the column replay to identical summaries, step logs and tiers."""
    marked, plain = traces
    counted = _runs(marked, "count")
    for a, b, default in zip(counted, _runs(plain, "count"),
                             replay_trace(marked, SPECS, ReplayConfig(record_tiers=True, error_stride=1)),
                             strict=True):
        for other in (b, default):
            assert {k: v for k, v in a.summary.items() if k not in ("trace", "policy_seconds")} == \
                {k: v for k, v in other.summary.items() if k not in ("trace", "policy_seconds")}
            assert a.step_log.drop("policy_seconds", strict=False).equals(
                other.step_log.drop("policy_seconds", strict=False))
            assert all(np.array_equal(x, y) for x, y in zip(a.tiers, other.tiers, strict=True))
        assert a.summary["padding"] == "count" and a.summary["n_audio"] == marked.n_audio


def test_drop_full_keeps_the_real_audio_and_recall_one(traces: tuple[Trace, Trace]) -> None:
    marked, _ = traces
    t_a = marked.n_audio
    (full,) = _runs(marked, "drop", [PolicySpec("full", 1.0)])
    assert full.summary["padding"] == "drop" and full.summary["n_audio"] == t_a - N_PAD
    heads = marked.head_layout
    for tiers in full.tiers:
        assert tiers.shape == (heads.n_layers, heads.n_kv_heads, t_a - N_PAD)
        assert ((tiers == Tier.GPU).sum(-1) == t_a - N_PAD).all()
    # exact by construction: a run that keeps the whole (real) audio is the full model
    assert full.summary["attn_recall"] == 1.0 and full.summary["output_error"] == 0.0
    assert full.summary["r_gpu"] == 1.0 and full.facts.n_audio == t_a - N_PAD


@pytest.mark.parametrize("name,budget", [("snapkv", 0.2), ("streaming", 0.3), ("h2o", 0.25)])
def test_drop_budget_is_floor_r_times_the_real_audio(traces: tuple[Trace, Trace], name: str,
                                                     budget: float) -> None:
    marked, _ = traces
    t_real = marked.n_audio - N_PAD
    (run,) = _runs(marked, "drop", [PolicySpec(name, budget)])
    want = math.floor(budget * t_real)
    assert want != math.floor(budget * marked.n_audio)  # the test tells the two apart
    assert ((run.tiers[0] == Tier.GPU).sum(-1) == want).all()
    assert ((run.tiers[-1] == Tier.GPU).sum(-1) <= want).all()
    assert run.summary["r_gpu_prefill"] == pytest.approx(want / t_real, rel=1e-6)


def test_drop_attention_is_a_softmax_over_the_non_padding_keys(traces: tuple[Trace, Trace]) -> None:
    """The attention the engine hands a policy under ``drop`` equals a float64 softmax of the
    stored query over every key up to the current position except the padding, within the
    worst-case float32 error of the engine (tests/float32_bounds.py: logits ``γ_{D+2}``, then
    softmax over n keys), far below the padding's own share of the mass."""
    marked, _ = traces
    (run,) = _runs(marked, "drop", [PolicySpec("_test_padding_recorder", 1.0)])
    seen = run.policy.seen
    m = marked.meta
    n_q, g = m.model.n_q_heads, m.model.n_q_heads // m.model.n_kv_heads
    audio, pad = marked.audio_positions, marked.padding_positions
    real_audio = audio[~np.isin(audio, pad)]
    assert len(seen) == m.n_decode and len(pad) == N_PAD
    told_apart = []
    for step in (0, 4, m.n_decode - 1):
        p = m.n_prefill + step
        kept = np.setdiff1d(np.arange(p + 1), pad)
        for layer in range(m.model.n_layers):
            q = marked.queries(layer)[:, marked.query_index(p)].astype(np.float64)
            k = marked.keys(layer)[:, kept].astype(np.float64)
            got = seen[step][layer]
            for h in range(n_q):
                logits = k[h // g] @ q[h] / np.sqrt(m.model.head_dim)
                e = np.exp(logits - logits.max())
                ref = (e / e.sum())[np.isin(kept, real_audio)]
                bound = ref * softmax_rel_bound(logit_bound(q[h], k[h // g]), len(kept))
                np.testing.assert_array_less(np.abs(got[h] - ref), bound + 1e-30)
                # counting the padding would renormalise by the mass it holds: a head whose
                # padding mass exceeds the bound tells the two apart
                with_pad = np.exp(marked.keys(layer)[h // g, : p + 1].astype(np.float64) @ q[h]
                                  / np.sqrt(m.model.head_dim) - logits.max())
                counted = (with_pad / with_pad.sum())[real_audio]
                told_apart.append(bool((np.abs(counted - ref) > bound).any()))
    assert np.mean(told_apart) > 0.5, np.mean(told_apart)


def test_drop_prefill_view_is_the_window_without_padding_over_the_real_audio(
        traces: tuple[Trace, Trace]) -> None:
    """At prefill a policy sees the observation window's non-padding queries (the synthetic
    window's 20 audio queries are all padding: 12 text queries remain), each a float64 softmax
    over the non-padding keys up to its own position, within the float32 bounds."""
    marked, _ = traces
    (run,) = _runs(marked, "drop", [PolicySpec("_test_padding_recorder", 1.0)])
    m = marked.meta
    g = m.model.n_q_heads // m.model.n_kv_heads
    pad = marked.padding_positions
    real_audio = np.setdiff1d(marked.audio_positions, pad)
    window = np.setdiff1d(marked.window_positions, pad)
    assert len(marked.window_positions) == 32 and len(window) == 12
    for layer in (0, m.model.n_layers - 1):
        got = run.policy.window[layer]  # (H_q, W, T_a - n_pad)
        assert got.shape == (m.model.n_q_heads, 12, len(real_audio))
        for w, p in enumerate(window):
            kept = np.setdiff1d(np.arange(p + 1), pad)
            q = marked.queries(layer)[:, marked.query_index(int(p))].astype(np.float64)
            k = marked.keys(layer)[:, kept].astype(np.float64)
            for h in range(m.model.n_q_heads):
                logits = k[h // g] @ q[h] / np.sqrt(m.model.head_dim)
                e = np.exp(logits - logits.max())
                ref = (e / e.sum())[np.isin(kept, real_audio)]
                bound = ref * softmax_rel_bound(logit_bound(q[h], k[h // g]), len(kept))
                np.testing.assert_array_less(np.abs(got[h, w] - ref), bound + 1e-30)


def test_drop_is_the_trace_recorded_without_the_padding(traces: tuple[Trace, Trace],
                                                         tmp_path: Path) -> None:
    """End to end: ``drop`` on the marked trace replays bit for bit like ``count`` on the same
    trace with the padding tokens physically cut out (keys, values, queries, positions): the
    same tiers, step logs, per-head recall and every summary figure (output error included,
    so values are cut alike)."""
    marked, _ = traces
    data, pad = _marked(N_PAD)
    cut = Trace(write_trace(tmp_path / "cut.kvtrace", _cut(data, pad)))
    assert cut.n_audio == marked.n_audio - N_PAD
    varying = ("trace", "padding", "policy_seconds")
    for d, c in zip(_runs(marked, "drop"), _runs(cut, "count"), strict=True):
        assert {k: v for k, v in d.summary.items() if k not in varying} == \
            {k: v for k, v in c.summary.items() if k not in varying}
        assert d.step_log.drop("policy_seconds", strict=False).equals(
            c.step_log.drop("policy_seconds", strict=False))
        assert all(np.array_equal(x, y) for x, y in zip(d.tiers, c.tiers, strict=True))
        np.testing.assert_array_equal(d.per_head_recall, c.per_head_recall)
        assert d.facts == c.facts


def test_drop_on_a_trace_without_recorded_padding_is_one_line(traces: tuple[Trace, Trace],
                                                              tmp_path: Path) -> None:
    _, plain = traces
    with pytest.raises(ValueError, match=r"plain\.kvtrace: --padding drop: .*'padding' column"):
        PaddingDroppedTrace(plain)
    with pytest.raises(ValueError, match="--padding"):
        ReplayConfig(padding="mask")
    runner = CliRunner()
    out = runner.invoke(app, ["replay", str(plain.path), "-p", "full", "--padding", "drop",
                              "-o", str(tmp_path / "r")], terminal_width=200)
    assert out.exit_code == 1 and "Traceback" not in out.output
    errors = [line for line in out.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(plain.path) in errors[0] and "padding" in errors[0]
    bad = runner.invoke(app, ["replay", str(plain.path), "--padding", "mask",
                              "-o", str(tmp_path / "r2")], terminal_width=200)
    assert bad.exit_code == 2 and "--padding" in bad.output and "Traceback" not in bad.output


def test_cli_results_say_which_padding(traces: tuple[Trace, Trace], tmp_path: Path) -> None:
    marked, _ = traces
    for mode, t_a in (("count", marked.n_audio), ("drop", marked.n_audio - N_PAD)):
        out = CliRunner().invoke(app, ["replay", str(marked.path), "-p", "full,streaming",
                                       "-b", "0.3", "--padding", mode, "--wide",
                                       "-o", str(tmp_path / mode)], terminal_width=250)
        assert out.exit_code == 0, out.output
        res = pl.read_parquet(tmp_path / mode / "results.parquet")
        assert res["padding"].to_list() == [mode, mode] and res["n_audio"].to_list() == [t_a, t_a]
        assert f" {mode} " in out.output and f" {t_a} " in out.output


@pytest.mark.skipif(not SHIPPED.exists(), reason="shipped trace not in this checkout")
def test_shipped_trace_streaming_window_ends_at_the_last_real_audio_token() -> None:
    """The shipped minivox clip (59.57 s) ends in 5 padding tokens. Counted, StreamingLLM's
    recent window ends on them; dropped, it ends at the last real audio token and the budget
    is floor(0.2 · 745)."""
    trace = Trace(SHIPPED)
    t_a, n_pad = trace.n_audio, len(trace.padding_positions)
    assert (t_a, n_pad) == (750, 5)
    cfg = {"record_tiers": True, "max_steps": 1}
    (count,) = replay_trace(trace, [PolicySpec("streaming", 0.2)], ReplayConfig(**cfg))
    (drop,) = replay_trace(trace, [PolicySpec("streaming", 0.2)], ReplayConfig(padding="drop", **cfg))
    gpu_count, gpu_drop = count.tiers[0] == Tier.GPU, drop.tiers[0] == Tier.GPU
    b_count, b_drop = math.floor(0.2 * t_a), math.floor(0.2 * (t_a - n_pad))
    assert (gpu_count.sum(-1) == b_count).all() and (gpu_drop.sum(-1) == b_drop).all()
    assert gpu_count[..., t_a - n_pad:].all()  # counted: the padding is the recent window
    real = t_a - n_pad  # dropped: indices are the real audio tokens 0..744
    assert gpu_drop.shape[-1] == real and gpu_drop[..., :4].all()
    recent = b_drop - 4
    assert gpu_drop[..., real - recent:].all() and not gpu_drop[..., 4: real - recent].any()
