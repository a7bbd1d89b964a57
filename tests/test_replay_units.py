"""The replay engine's units on hand-made inputs: step-log transfer counts, tier updates that
write through to the arrays shared by all runs, the step-attention buffers, and the batched
metrics' exact cases."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvsim.policies.base import (
    TIER_CPU,
    TIER_DTYPE,
    TIER_GONE,
    TIER_GPU,
    BufferStepView,
    HeadLayout,
    Tier,
    all_audio_attention,
)
from kvsim.replay.buffers import StepAttentionBuffers
from kvsim.replay.engine import PolicySpec
from kvsim.replay.logwriter import StepLogWriter
from kvsim.replay.metrics import (
    LayerMass,
    MetricAccumulator,
    non_audio_mass,
    output_error,
    top_k_indicator,
)
from kvsim.replay.runstate import PolicyRun
from kvsim.replay.steploop import share_gpu_masks
from kvsim.replay.tensors import LayerAttention
from tests.float32_bounds import U32, gamma

HEADS = HeadLayout(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=8)
N_AUDIO = 6


def test_transfer_counts_split_runs_at_row_ends() -> None:
    log = StepLogWriter(HEADS, N_AUDIO, n_steps=2, dtype_bytes=2)
    # flat (layer, KV-head, position) indices, rows of 6 and layers of 12: 4,5 | 6,7 end and
    # start rows, 13 and 15 are apart, 13-20 are in layer 1; 9 goes GPU -> CPU, 10 CPU -> GONE
    changed = np.array([4, 5, 6, 7, 9, 10, 13, 15, 20])
    before = np.array([1, 1, 1, 1, 2, 1, 1, 1, 1], dtype=np.uint8)
    after = np.array([2, 2, 2, 2, 1, 0, 2, 2, 2], dtype=np.uint8)
    log.record_transfers(1, changed, before, after)
    frame = log.frame(n_prefill=10)
    row = frame.row(1, named=True)
    assert row["h2d_tokens"] == 7
    assert row["h2d_transfers"] == 5  # {4,5} {6,7} (a row ends at 5) {13} {15} {20}
    assert row["h2d_tokens_by_layer"] == [4, 3]
    assert row["h2d_transfers_by_layer"] == [2, 3]
    assert row["h2d_bytes"] == 7 * 2 * HEADS.head_dim * 2
    assert row["released_tokens"] == 1
    assert frame["context_tokens"].to_list() == [11, 12]
    assert frame["non_audio_tokens"].to_list() == [11 - N_AUDIO, 12 - N_AUDIO]
    assert frame.row(0, named=True)["h2d_tokens"] == 0


def _run(tiers: np.ndarray) -> PolicyRun:
    run = PolicyRun(PolicySpec("full", 1.0), None, StepLogWriter(HEADS, N_AUDIO, 1, 2))
    run.set_tiers(tiers)
    return run


def test_tier_scalars_are_the_tiers_in_the_tier_dtype() -> None:
    """The scalars the hot paths compare tier arrays with: the enum's values, in the arrays'
    own dtype, so that a comparison or ``np.where`` never widens a tier array."""
    assert [TIER_GONE, TIER_CPU, TIER_GPU] == [Tier.GONE, Tier.CPU, Tier.GPU] == [0, 1, 2]
    assert {type(t) for t in (TIER_GONE, TIER_CPU, TIER_GPU)} == {TIER_DTYPE}
    tiers = np.array([0, 1, 2, 2], dtype=TIER_DTYPE)
    assert (tiers == TIER_GPU).tolist() == (tiers == Tier.GPU).tolist() == [False, False, True, True]
    assert np.where(tiers > TIER_GONE, TIER_GPU, TIER_CPU).dtype == TIER_DTYPE


def test_tier_updates_write_through_to_the_shared_masks() -> None:
    rng = np.random.default_rng(0)
    shape = (HEADS.n_layers, HEADS.n_kv_heads, N_AUDIO)
    first, second = (rng.integers(0, 3, shape).astype(np.uint8) for _ in range(2))
    runs = [_run(first), _run(second)]
    masks, resident = share_gpu_masks(runs, HEADS, N_AUDIO)
    assert (masks[:, 2] == 1).all()  # the full model's slot
    new = rng.integers(0, 3, shape).astype(np.uint8)
    changed = np.flatnonzero(new != second)
    runs[1].update_tiers(changed, second.ravel()[changed], new.ravel()[changed])
    fresh = _run(new)  # the same tiers adopted from scratch: exact (0/1 and integer counts)
    np.testing.assert_array_equal(masks[:, 1], fresh.gpu_mask)
    np.testing.assert_array_equal(resident[:, 1], fresh.resident)
    np.testing.assert_array_equal(masks[:, 0], first == Tier.GPU)  # the other run untouched
    assert (runs[1].n_gpu, runs[1].n_cpu) == (fresh.n_gpu, fresh.n_cpu)


def _reader(layers: list[int] | None) -> PolicyRun:
    """A run whose policy reads the step attention of ``layers`` (None: every layer)."""
    policy = SimpleNamespace(needs_step_attention=True, step_attention_layers=lambda: layers)
    return PolicyRun(PolicySpec("full", 1.0), policy, StepLogWriter(HEADS, N_AUDIO, 1, 2))


def test_step_attention_buffers_hold_the_layers_read() -> None:
    """Runs reading every layer share one array; a run reading some layers holds only those
    plus one NaN row for the others; every layer read gets the renormalised restriction."""
    rng = np.random.default_rng(3)
    runs = [_reader([1]), _reader(None), _run(np.zeros((2, 2, N_AUDIO), np.uint8)), _reader(None)]
    runs[2].policy = SimpleNamespace(needs_step_attention=False)
    buffers = StepAttentionBuffers(runs, HEADS, N_AUDIO)
    assert runs[0].buffer.shape == (2, HEADS.n_q_heads, N_AUDIO)  # layer 1 and the NaN row
    assert buffers.buffers.shape[0] == 2 and runs[2].buffer is None
    group = HEADS.group
    expected = {}
    n_layers = HEADS.n_layers  # both layers in one call, as a group of layers
    att = rng.random((n_layers, HEADS.n_kv_heads, group, N_AUDIO)).astype(np.float32)
    masks = rng.integers(0, 2, (n_layers, len(runs), HEADS.n_kv_heads, N_AUDIO)).astype(np.float32)
    norm = rng.uniform(0.5, 1.0, (n_layers, len(runs), HEADS.n_q_heads)).astype(np.float32)
    buffers.fill_layers(range(n_layers), att, masks, norm)
    for layer in range(n_layers):
        for r in range(len(runs)):  # elementwise float32: exact
            kept = (att[layer] * masks[layer, r][:, None, :]
                    / norm[layer, r].reshape(HEADS.n_kv_heads, group, 1))
            expected[r, layer] = kept.reshape(HEADS.n_q_heads, N_AUDIO)
    views = [BufferStepView(0, run.buffer, run.buffer_rows) for run in runs]
    for r in (0, 1, 3):
        for layer in range(HEADS.n_layers):
            got = views[r].audio_attention(layer)
            if r == 0 and layer == 0:
                assert np.isnan(got).all()  # not read: NaN, never stale
            else:
                assert got.tobytes() == expected[r, layer].tobytes()
    assert all_audio_attention(views[1], HEADS.n_layers) is runs[1].buffer
    assert np.isnan(all_audio_attention(views[0], HEADS.n_layers)[0]).all()


@pytest.mark.parametrize("n_static", [0, 3, 2], ids=["stepwise", "static", "mixed"])
def test_metrics_exact_cases_and_recall_bound(n_static: int) -> None:
    """The same figures whether a run is measured step by step or, its reads fixed, over a
    block of steps (here a block of one step)."""
    rng = np.random.default_rng(1)
    n_kv, group, n_audio, k_top = 2, 2, 50, 5
    heads = HeadLayout(n_layers=1, n_q_heads=n_kv * group, n_kv_heads=n_kv, head_dim=8)
    full_att = rng.dirichlet(np.ones(n_audio + 7), size=n_kv * group)
    att, text_mass = full_att[:, :n_audio], full_att[:, n_audio:].sum(-1).astype(np.float32)
    audio_att = att.astype(np.float32).reshape(n_kv, group, n_audio)
    top = np.argsort(-audio_att, axis=-1)[..., :k_top]  # per q-head
    masks = np.zeros((4, n_kv, n_audio), dtype=np.float32)  # whole, empty, random, full
    masks[0] = 1.0
    masks[2] = rng.random((n_kv, n_audio)) < 0.5
    masks[2, 0, top[0, 0]] = masks[2, 0, top[0, 1]] = 1.0  # head 0 keeps its q-heads' top-K
    masks[2, 1, top[1, 0]] = 0.0
    masks[3] = 1.0
    resident = masks[:3].sum(-1).astype(np.int64)
    acc = MetricAccumulator(3, heads, n_audio, n_steps=1, topk=k_top, n_static=n_static)
    acc.set_static_masks(masks[None])
    acc.start_block(0, 0, audio_att[:, :, None], resident)
    mass = acc.add_layers(0, range(1), audio_att[None], masks[None], resident[None], text_mass[None])
    recall = acc.recall_sum[:, 0]
    assert (mass.normaliser[0, 1] == text_mass).all()  # nothing read: the text mass alone
    assert (recall[0] == 1.0).all() and (mass.normaliser[0, 0] == 1.0).all()  # by construction
    assert (recall[1] == 0.0).all()
    assert acc.step_jaccard[0, 0] == 1.0 and acc.step_jaccard[1, 0] == 0.0
    # random mask: kept and full mass are float32 sums of T_a non-negative terms (γ_{T_a}
    # each, any order) and one division (u)
    exact = (audio_att.astype(np.float64) * masks[2][:, None]).sum(-1) / audio_att.sum(-1)
    bound = (1 + gamma(n_audio)) * (1 + U32) / (1 - gamma(n_audio)) - 1
    np.testing.assert_allclose(recall[2], exact.ravel(), rtol=bound, atol=0)
    assert ((recall[2] > 0) & (recall[2] < 1)).all()  # a case that is not exact by construction
    jaccard = acc.step_jaccard[2, 0] * 4  # sum over q-heads; the kv-head-0 q-heads read top-K
    assert jaccard >= 2.0 and acc.step_jaccard[2, 0] < 1.0


def test_top_k_indicator_matches_a_stable_sort_with_heavy_ties() -> None:
    """The top-K indicator is the K largest of every row, ties at the K-th value broken towards
    the lowest positions (a stable descending sort), written into a strided block of a larger
    array without touching the rest of it."""
    rng = np.random.default_rng(3)
    for _ in range(100):
        n_kv, group, n = (int(v) for v in rng.integers((1, 1, 5), (4, 5, 60)))
        k = int(rng.integers(1, n + 1))
        scores = rng.integers(0, 6, size=(n_kv, group, n)).astype(np.float32)  # many ties
        block = np.full((n_kv, 2 * group, n), 7.0, dtype=np.float32)
        top_k_indicator(scores, k, out=block[:, group:])
        order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
        expected = np.zeros_like(scores)
        np.put_along_axis(expected, order, 1.0, axis=-1)
        assert (block[:, group:] == expected).all()
        assert (block[:, :group] == 7.0).all()


def test_output_error_reads_contiguous_audio_through_views_as_the_gathered_positions() -> None:
    """The text part of the output comes from views of the positions around contiguous audio,
    or from the gathered non-audio positions: the same sums in another grouping, so within
    float32 rounding of each other and of a float64 reference; a full mask's error is 0."""
    rng = np.random.default_rng(5)
    n_kv, group, d, n = 2, 3, 16, 60
    audio = np.arange(7, 47)
    full = rng.dirichlet(np.ones(n), size=n_kv * group).astype(np.float32)
    att = LayerAttention(full, full[:, audio].reshape(n_kv, group, -1))
    values = rng.standard_normal((n_kv, n + 5, d)).astype(np.float32)
    non_audio = np.ones(n, dtype=bool)
    non_audio[audio] = False
    masks = np.ones((3, n_kv, audio.size), dtype=np.float32)
    masks[0] = rng.random((n_kv, audio.size)) < 0.5  # slot 1: a run reading everything
    resident = masks[:2].sum(-1).astype(np.int64)
    kept = (full.reshape(n_kv, group, -1)[:, :, audio] * masks[:2, :, None]).sum(-1)
    whole = (resident == audio.size)[:, np.arange(n_kv * group) // group]
    text = non_audio_mass(full, slice(7, 47), non_audio)
    # the same non-negative terms in another grouping: within γ_n of each other
    np.testing.assert_allclose(text, non_audio_mass(full, audio, non_audio), rtol=2 * gamma(n), atol=0)
    normaliser = np.where(whole, 1.0, text + kept.reshape(2, -1))
    mass = LayerMass(whole, normaliser.astype(np.float32))
    by_view = output_error(att, values, slice(7, 47), non_audio, masks, mass)
    gathered = output_error(att, values, audio, non_audio, masks, mass)
    assert by_view[1] == gathered[1] == 0.0
    # float64 reference of run 0
    p64, v64 = full.astype(np.float64).reshape(n_kv, group, -1), values[:, :n].astype(np.float64)
    keep = non_audio[None, None, :].repeat(n_kv, 0).repeat(group, 1).astype(np.float64)
    keep[:, :, audio] = masks[0][:, None, :]
    o = p64 @ v64
    o_c = ((p64 * keep) @ v64) / (p64 * keep).sum(-1, keepdims=True)
    exact = (np.linalg.norm(o_c - o, axis=-1) / np.linalg.norm(o, axis=-1)).mean()
    # each output is a float32 sum of n terms (γ_n relative to the sum of magnitudes, which
    # this bounds by the values' largest row norm over the output norm)
    scale = np.abs(v64).max() * np.sqrt(d) / np.linalg.norm(o, axis=-1).min()
    bound = 4 * gamma(n) * scale * (1 + exact)
    assert by_view[0] == pytest.approx(exact, abs=bound)
    assert gathered[0] == pytest.approx(exact, abs=bound)


def test_output_error_of_a_head_that_puts_its_mass_on_evicted_audio() -> None:
    """A head with nearly all its mass on a few audio positions (the aligning heads of a
    trained speech LLM), and a run that evicted them: the compressed output is the average of
    what it kept, weighted by those tiny probabilities, so its error is of the order of the
    values' norms over the output's, as in a float64 reference. The normaliser must be the
    sum of those probabilities: ``1 - audio mass + kept`` cancels in float32 (absolute error
    ~6e-8, far above the true normaliser here) and multiplied such errors by up to 1e5."""
    rng = np.random.default_rng(11)
    n_kv, group, d, n = 1, 2, 16, 80
    audio = np.arange(10, 70)
    logits = rng.standard_normal((n_kv * group, n))
    logits[:, audio[30:33]] += 40.0  # a peak of three audio positions: 1 - its mass ~ 1e-16
    full64 = np.exp(logits - logits.max(-1, keepdims=True))
    full64 /= full64.sum(-1, keepdims=True)
    full = full64.astype(np.float32)
    att = LayerAttention(full, full[:, audio].reshape(n_kv, group, -1))
    values = rng.standard_normal((n_kv, n, d)).astype(np.float32)
    non_audio = np.ones(n, dtype=bool)
    non_audio[audio] = False
    masks = np.ones((2, n_kv, audio.size), dtype=np.float32)
    masks[0, :, 25:40] = 0.0  # the run evicted the peak
    heads = HeadLayout(n_layers=1, n_q_heads=n_kv * group, n_kv_heads=n_kv, head_dim=d)
    acc = MetricAccumulator(1, heads, audio.size, n_steps=1, topk=5, n_static=0)
    resident = masks[:1].sum(-1).astype(np.int64)
    acc.start_block(0, 0, att.audio[:, :, None], resident)
    text = non_audio_mass(full, slice(10, 70), non_audio)
    mass = acc.add_layers(0, range(1), att.audio[None], masks[None], resident[None], text[None])
    got = output_error(att, values, slice(10, 70), non_audio, masks,
                       LayerMass(mass.whole[0], mass.normaliser[0]))[0]
    keep = non_audio.astype(np.float64)
    keep[audio] = masks[0, 0]
    v64 = values[0].astype(np.float64)
    o = full64 @ v64
    o_c = ((full64 * keep) @ v64) / (full64 * keep).sum(-1, keepdims=True)
    exact = (np.linalg.norm(o_c - o, axis=-1) / np.linalg.norm(o, axis=-1)).mean()
    # float32 probabilities (relative u each) and float32 sums: a few ulps of the ratio
    assert got == pytest.approx(exact, rel=1e-4)
    assert exact < 10.0  # the figure is of the order of the values' norms, not 1e5
