"""H2O: heavy hitters + recent audio window, accumulated scores, budget at every step."""

from __future__ import annotations

import numpy as np
import pytest
from float32_bounds import U32, gamma, logit_bound, softmax_rel_bound
from zoo_fakes import FakePrefill, FakeStep, drive, make_ctx, random_prefill

from kvsim.policies import Tier, make
from kvsim.policies.base import kv_group_sum


def _hand_view(scores_per_q: np.ndarray, n_layers: int = 1) -> FakePrefill:
    """A prefill view whose single-query attention is ``scores_per_q`` (H_q, T_a)."""
    att = np.broadcast_to(
        scores_per_q[None, :, None, :],
        (n_layers, *scores_per_q.shape[:1], 1, scores_per_q.shape[1]),
    )
    keys = np.zeros((n_layers, 1, scores_per_q.shape[1], 4), dtype=np.float32)
    return FakePrefill(np.ascontiguousarray(att, dtype=np.float32), keys)


def test_hand_case_heavy_plus_recent() -> None:
    # T_a = 10, r = 0.4 -> B = 4: 2 recent (positions 8, 9) + 2 heavy hitters
    ctx = make_ctx(n_layers=1, n_q_heads=2, n_kv_heads=1, n_audio=10)
    s = np.array([[0.0, 0.3, 0.0, 0.0, 0.0, 0.2, 0.1, 0.0, 0.5, 0.0]] * 2)
    s[1, 6] = 0.25  # only one q-head of the group likes position 6: group sum 0.35 < 0.4
    tiers = make("h2o", 0.4).prefill(ctx, _hand_view(s))
    kept = np.flatnonzero(tiers[0, 0] == Tier.GPU).tolist()
    # group sums: p1 .6, p5 .4, p6 .35, p8 1.0 (recent anyway) -> heavy = {1, 5}
    assert kept == [1, 5, 8, 9]
    assert set(np.unique(tiers)) == {Tier.GPU, Tier.GONE}


def test_recent_fraction_zero_is_pure_heavy_hitters() -> None:
    ctx = make_ctx(n_layers=1, n_q_heads=1, n_kv_heads=1, n_audio=8)
    s = np.array([[0.1, 0.9, 0.0, 0.5, 0.2, 0.0, 0.0, 0.05]])
    tiers = make("h2o", 0.25, recent_fraction=0.0).prefill(ctx, _hand_view(s))
    assert np.flatnonzero(tiers[0, 0] == Tier.GPU).tolist() == [1, 3]


def test_scores_accumulate_step_attention() -> None:
    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, n_audio=30)
    view = random_prefill(ctx, n_window=3)
    pol = make("h2o", 0.5)
    pol.prefill(ctx, view)
    expected = np.stack(
        [kv_group_sum(view.attention[layer].sum(axis=1, dtype=np.float64), 2) for layer in range(2)]
    )
    assert np.allclose(pol.scores, expected)
    rng = np.random.default_rng(3)
    for step in range(4):
        att = rng.random((2, 4, 30)).astype(np.float32)
        assert pol.decode_step(FakeStep(step, att)) is None  # the audio never grows: no eviction
        expected += np.stack([kv_group_sum(att[layer].astype(np.float64), 2) for layer in range(2)])
    assert np.allclose(pol.scores, expected)


@pytest.mark.parametrize(("n_q", "n_kv"), [(6, 2), (8, 2), (3, 3)])
def test_vectorised_step_scores_equal_per_layer_group_sums(n_q: int, n_kv: int) -> None:
    """decode_step adds every layer at once; bit-identical to kv_group_sum layer by layer,
    through the engine's BufferStepView and through a plain per-layer view."""
    from kvsim.policies.base import BufferStepView

    ctx = make_ctx(n_layers=3, n_q_heads=n_q, n_kv_heads=n_kv, n_audio=37)
    rng = np.random.default_rng(n_q)
    pols = [make("h2o", 0.6) for _ in range(2)]
    for pol in pols:
        pol.prefill(ctx, random_prefill(ctx))
    expected = pols[0].scores.copy()
    for step in range(5):
        att = rng.random((3, n_q, 37)).astype(np.float32)
        pols[0].decode_step(BufferStepView(step, att))
        pols[1].decode_step(FakeStep(step, att))
        expected += np.stack([kv_group_sum(att[layer].astype(np.float64), n_q // n_kv)
                              for layer in range(3)])
        assert np.array_equal(pols[0].scores, expected)
        assert np.array_equal(pols[1].scores, expected)


def test_budget_every_step_and_gone_absorbing() -> None:
    ctx = make_ctx(n_audio=64)
    pol = make("h2o", 0.3)
    log = drive(pol, ctx, random_prefill(ctx), n_steps=6)
    b = int(np.floor(0.3 * 64))
    for prev, cur in zip(log.tiers, log.tiers[1:], strict=False):
        assert ((cur == Tier.GPU).sum(axis=-1) <= b).all()
        assert not ((prev == Tier.GONE) & (cur != Tier.GONE)).any()
    assert (log.tiers[0] == Tier.GPU).sum() <= pol.gpu_capacity()


def test_bad_hyperparameter_is_clear() -> None:
    with pytest.raises(ValueError, match="recent_fraction"):
        make("h2o", 0.3, recent_fraction=1.5)


def test_engine_accumulates_compressed_attention() -> None:
    """Through the real engine: H2O's scores = observation-window attention + the attention the
    compressed model computed at every step (softmax over non-audio + resident audio),
    recomputed here from the trace's queries and keys in float64."""
    import tempfile
    from pathlib import Path
    from unittest import mock

    from kvsim.policies import registry
    from kvsim.replay.engine import PolicySpec, ReplayConfig, replay_trace
    from kvsim.synth import SynthConfig, synthesize
    from kvsim.trace.reader import Trace
    from kvsim.trace.writer import write_trace

    made = []

    def _make(spec: PolicySpec):
        made.append(registry.make(spec.name, spec.budget, **spec.params))
        return made[-1]

    data = synthesize(SynthConfig(preset="tiny", audio_seconds=8, decode_steps=5, seed=7))
    with tempfile.TemporaryDirectory() as tmp:
        trace = Trace(write_trace(Path(tmp) / "t.kvtrace", data))
        with mock.patch.object(PolicySpec, "make", _make):
            (run,) = replay_trace(trace, [PolicySpec("h2o", 0.3)], ReplayConfig(record_tiers=True))
        pol = made[0]
        heads, audio = trace.head_layout, trace.audio_positions
        g, d = heads.group, heads.head_dim
        n_prefill = trace.meta.n_prefill
        expected = np.zeros_like(pol.scores)
        window_part = np.zeros_like(pol.scores)
        bound = np.zeros_like(pol.scores)  # worst-case float32 error of every score
        n_audio = len(audio)
        for layer in range(heads.n_layers):
            keys = np.asarray(trace.keys(layer), dtype=np.float64)  # (H_kv, N, D)
            kq = keys[np.arange(heads.n_q_heads) // g]  # (H_q, N, D)
            resident = run.tiers[0][layer] == Tier.GPU  # static after prefill
            for p in trace.window_positions:  # audio ones too: causal, keys after p get 0
                q = np.asarray(trace.queries(layer)[:, trace.query_index(int(p))], dtype=np.float64)
                logit = np.einsum("hd,hnd->hn", q, kq) / np.sqrt(d)
                logit[:, p + 1:] = -np.inf
                w = np.exp(logit - logit.max(axis=-1, keepdims=True))
                att = (w / w.sum(axis=-1, keepdims=True))[:, audio]
                rel = softmax_rel_bound(logit_bound(q, kq[:, : p + 1]), p + 1)
                window_part[layer] += kv_group_sum(att, g)
                bound[layer] += kv_group_sum(att * rel, g)
            expected[layer] = window_part[layer]
            for s in range(run.summary["steps"]):
                p = n_prefill + s
                q = np.asarray(trace.queries(layer)[:, trace.query_index(p)], dtype=np.float64)
                logit = np.einsum("hd,hnd->hn", q, kq[:, : p + 1]) / np.sqrt(d)
                visible = np.ones((heads.n_q_heads, p + 1), dtype=bool)
                visible[:, audio] = np.repeat(resident, g, axis=0)
                e = np.exp(logit - logit.max(axis=-1, keepdims=True))
                full = e / e.sum(axis=-1, keepdims=True)
                z = np.where(visible, full, 0.0).sum(axis=-1, keepdims=True)
                att = (np.where(visible, full, 0.0) / z)[:, audio]
                expected[layer] += kv_group_sum(att, g)
                # the engine renormalises the full softmax P (relative error e_p) by
                # z = 1 - audio mass + kept audio mass, two float32 sums of T_a terms
                e_p = softmax_rel_bound(logit_bound(q, kq[:, : p + 1]), p + 1)
                e_z = (U32 + 2 * (e_p + gamma(n_audio))) / z + U32
                bound[layer] += kv_group_sum(att * (e_p + e_z + U32), g)
        n_terms = len(trace.window_positions) * g + run.summary["steps"] * g
        bound += gamma(n_terms) * expected  # float32 accumulation of non-negative terms
    np.testing.assert_array_less(np.abs(pol.scores - expected), bound + 1e-30)
    # the bound is tight enough to mean something: far below a missed step or a wrong renormaliser
    decode_part = (expected - window_part).sum()
    assert bound.sum() < 0.1 * decode_part, bound.sum() / decode_part
    gained = pol.scores - window_part
    kept = run.tiers[0] == Tier.GPU
    assert gained[kept].sum() > 0.5  # decode steps added attention to resident positions
    # evicted positions receive none: what remains is the window part's rounding
    assert (np.abs(gained[~kept]) <= bound[~kept]).all()  # evicted positions receive none
