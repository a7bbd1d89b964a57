"""The shared attention pass computed several decode steps at a time
(:func:`kvsim.core.attention.decode_attention_block`): every row within float32 rounding of a
float64 softmax, a block of one step the per-step computation bit for bit, and a replay whose
step values do not depend on how many steps it replays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvsim.core.attention import decode_attention_block, gqa_logits, softmax_
from kvsim.core.shapes import HeadLayout
from kvsim.replay import steploop
from kvsim.replay.engine import PolicySpec, ReplayConfig, Replayer, replay_trace
from kvsim.replay.tensors import steps_per_block
from kvsim.trace import Trace
from tests.conftest import make_trace
from tests.float32_bounds import U32, gamma, logit_bound, softmax_rel_bound


def _operands(seed: int = 0, h_kv: int = 2, group: int = 4, n: int = 90, d: int = 32):
    rng = np.random.default_rng(seed)
    keys = (rng.standard_normal((h_kv, n, d)) * 2).astype(np.float32)
    queries = (rng.standard_normal((h_kv * group, 6, d)) * 2).astype(np.float32)
    positions = np.arange(n - 6, n)
    return queries, keys, positions, group


def _softmax64(q64: np.ndarray, k_row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float64 softmax of every q-head's query (H_q, D) over its keys (H_q, n, D), and the
    relative error bound of a float32 computation of it."""
    logits = np.einsum("hd,hnd->hn", q64, k_row) / np.sqrt(q64.shape[-1])
    exact = np.exp(logits - logits.max(-1, keepdims=True))
    exact /= exact.sum(-1, keepdims=True)
    return exact, softmax_rel_bound(logit_bound(q64, k_row), k_row.shape[1])


def test_every_row_of_a_block_is_a_softmax_within_float32_rounding() -> None:
    queries, keys, positions, group = _operands()
    block = decode_attention_block(queries, keys, positions)
    assert block.shape == (queries.shape[0], len(positions), positions[-1] + 1)
    k64 = np.repeat(keys.astype(np.float64), group, axis=0)  # (H_q, N, D): each q-head's keys
    for b, position in enumerate(positions):
        q64 = queries[:, b].astype(np.float64)
        k_row = k64[:, : position + 1]
        exact, bound = _softmax64(q64, k_row)
        got = block[:, b, : position + 1].astype(np.float64)
        assert (np.abs(got - exact) <= bound * exact).all()


def test_a_block_of_one_step_is_the_per_step_computation_bit_for_bit() -> None:
    queries, keys, positions, _ = _operands(seed=1)
    for b, position in enumerate(positions):
        one = decode_attention_block(np.ascontiguousarray(queries[:, b : b + 1]), keys,
                                     positions[b : b + 1])
        per_step = softmax_(gqa_logits(np.ascontiguousarray(queries[:, b]),
                                       keys[:, : position + 1]))
        assert one[:, 0].tobytes() == per_step.tobytes()


def test_steps_per_block_fits_the_memory_given() -> None:
    heads = HeadLayout(n_layers=30, n_q_heads=32, n_kv_heads=8, head_dim=128)
    per_step = 30 * 32 * 1618 * 4
    assert steps_per_block(heads, 1618, 0) == 1
    assert steps_per_block(heads, 1618, per_step * 3 + 1) == 3
    assert steps_per_block(heads, 1618, 2**40) == 16
    assert steps_per_block(heads, 1618, 2**40, most=4) == 4


@pytest.fixture(scope="module")
def block_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_trace(tmp_path_factory.mktemp("block") / "t.kvtrace", preset="small",
                      seconds=12, steps=21, seed=4)


def test_replayed_steps_do_not_depend_on_how_many_are_replayed(block_trace: Path) -> None:
    """Blocks are a fixed grid from the first decode step: a step's attention, hence its
    metrics, are the same bits whether the replay stops after it or goes on."""
    trace = Trace(block_trace)
    assert Replayer(trace).tensors.step_block > 7  # several steps per block: the case tested
    specs = [PolicySpec("snapkv", 0.3), PolicySpec("h2o", 0.3)]
    whole = replay_trace(trace, specs)
    for max_steps in (7, 16):
        part = replay_trace(trace, specs, ReplayConfig(max_steps=max_steps))
        for a, b in zip(whole, part, strict=True):
            assert a.step_recall[:max_steps].tobytes() == b.step_recall.tobytes()
            assert a.step_log.head(max_steps).equals(b.step_log)


def test_blocked_and_per_step_replays_agree_within_rounding(block_trace: Path) -> None:
    """Two float32 computations of the same probabilities (a product B steps tall or one step
    tall) each lie within the softmax bound of the exact ones; a recall is a ratio of two
    T_a-term sums of them. The tiers of prefill-only policies do not read the decode
    attention, so they are equal exactly."""
    trace = Trace(block_trace)
    specs = [PolicySpec("snapkv", 0.3), PolicySpec("streaming", 0.5), PolicySpec("random", 0.4)]
    blocked = replay_trace(trace, specs)
    per_step = replay_trace(trace, specs, ReplayConfig(attention_block_mib=0))
    rel = _worst_probability_bound(trace) + gamma(trace.n_audio)
    for a, b in zip(blocked, per_step, strict=True):
        assert a.step_log.equals(b.step_log)
        recall_bound = 2 * (2 * rel + U32)  # each side: kept and full mass, one division
        np.testing.assert_allclose(a.per_head_recall, b.per_head_recall, rtol=recall_bound, atol=0)
        assert a.summary["r_gpu"] == b.summary["r_gpu"]


def _worst_probability_bound(trace: Trace) -> float:
    """The largest relative error bound of a float32 decode-step probability of ``trace``."""
    heads, meta = trace.head_layout, trace.meta
    worst = 0.0
    for layer in range(heads.n_layers):
        k64 = np.repeat(np.asarray(trace.keys(layer), dtype=np.float64), heads.group, axis=0)
        for step in range(meta.n_decode):
            position = meta.n_prefill + step
            q64 = np.asarray(trace.queries(layer)[:, trace.query_index(position)], dtype=np.float64)
            worst_row = _softmax64(q64, k64[:, : position + 1])[1]
            worst = max(worst, float(worst_row.max()))
    return worst


def test_every_decode_step_the_replay_reads_is_its_own_softmax(block_trace: Path) -> None:
    """What the engine reads at a (step, layer) is that step's softmax over positions up to
    its own, whichever row of which block it comes from: within the float32 bound of a
    float64 softmax, and its audio columns the matching view."""
    trace = Trace(block_trace)
    tensors = Replayer(trace).tensors
    heads, meta = trace.head_layout, trace.meta
    assert tensors.step_block > 7
    for layer in range(heads.n_layers):
        k64 = np.repeat(np.asarray(trace.keys(layer), dtype=np.float64), heads.group, axis=0)
        for step in range(meta.n_decode):
            position = meta.n_prefill + step
            q = tensors.step_queries(position)[layer]
            att = tensors.attention(q, layer, position, heads.group)
            assert att.full.shape == (heads.n_q_heads, position + 1)
            q64 = q.astype(np.float64)
            exact, bound = _softmax64(q64, k64[:, : position + 1])
            assert (np.abs(att.full - exact) <= bound * exact).all(), (layer, step)
            audio = att.full[:, trace.audio_positions].reshape(att.audio.shape)
            assert np.array_equal(att.audio, audio)


def test_runs_with_fixed_reads_are_measured_per_block_as_step_by_step(block_trace: Path) -> None:
    """A run whose reads are fixed at prefill is measured a block of steps at a time; the same
    run with its tiers recorded goes step by step. Its top-K hits are sums of 0/1 (exact in
    float32), so the Jaccard differs only in the order of its float64 means; a recall is a ratio of two T_a-term float32 sums
    of the same probabilities, from products of another shape; the output error divides by
    the kept mass."""
    trace = Trace(block_trace)
    specs = [PolicySpec("snapkv", 0.3), PolicySpec("h2o", 0.3), PolicySpec("random", 0.4)]
    # output error on steps inside blocks too (the blocks start at steps 0, 16 here)
    blocked = replay_trace(trace, specs, ReplayConfig(error_stride=3))  # snapkv, random: static
    stepwise = replay_trace(trace, specs, ReplayConfig(error_stride=3, record_tiers=True))
    recall_bound = 2 * (2 * gamma(trace.n_audio) + U32)
    for a, b in zip(blocked, stepwise, strict=True):
        assert a.step_log.equals(b.step_log)
        # the same per-(step, layer, q-head) values; their float64 means may sum in another
        # order (one rounding per term at most)
        terms = trace.meta.n_decode * trace.head_layout.n_layers * trace.head_layout.n_q_heads
        assert a.summary["topk_jaccard"] == pytest.approx(b.summary["topk_jaccard"],
                                                          rel=terms * 2.0**-53, abs=0)
        np.testing.assert_allclose(a.per_head_recall, b.per_head_recall, rtol=recall_bound, atol=0)
        np.testing.assert_allclose(a.step_recall, b.step_recall, rtol=recall_bound, atol=0)
        # o_c = kept output / kept mass: the mass's relative difference moves ‖o_c − o‖/‖o‖
        # by at most ‖o_c‖/‖o‖ ≤ 1 + error times it
        err = b.summary["output_error"]
        assert a.summary["output_error"] == pytest.approx(err, rel=0, abs=(1 + err) * recall_bound)


def test_layer_groups_cover_the_layers_within_the_memory_given() -> None:
    heads = HeadLayout(n_layers=30, n_q_heads=32, n_kv_heads=8, head_dim=128)
    per_layer = 3 * heads.n_q_heads * 1500 * 4
    for budget in (0, per_layer, 7 * per_layer + 1, 29 * per_layer, 100 * per_layer):
        groups = steploop.layer_groups(heads, 1500, budget)
        assert [layer for g in groups for layer in g] == list(range(30))  # in order, once each
        most = max(1, budget // per_layer)
        assert max(map(len, groups)) <= most
        assert len(groups) == -(-30 // most)  # as few as fit
        assert max(map(len, groups)) - min(map(len, groups)) <= 1  # near-equal


def test_layers_measured_together_are_the_bits_of_one_layer_at_a_time(
        block_trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stepwise runs' recall and top-K Jaccard of a group of layers come from one batched
    product and one set of elementwise operations, the step's sums taken over the layers in
    order: every figure the same bits as with one layer per group."""
    trace = Trace(block_trace)
    n_layers = trace.head_layout.n_layers
    assert len(steploop.layer_groups(trace.head_layout, trace.n_audio, 16 * 2**20)) < n_layers
    specs = [PolicySpec(name, 0.3) for name in ("snapkv", "h2o", "voxzip", "quest", "arkvale")]
    cfg = ReplayConfig(error_stride=3)
    grouped = replay_trace(trace, specs, cfg)
    monkeypatch.setattr(steploop, "layer_groups",
                        lambda heads, n_audio, group_bytes: [range(i, i + 1) for i in range(n_layers)])
    alone = replay_trace(trace, specs, cfg)
    for a, b in zip(grouped, alone, strict=True):
        assert a.step_log.equals(b.step_log)
        assert a.step_recall.tobytes() == b.step_recall.tobytes()
        assert a.per_head_recall.tobytes() == b.per_head_recall.tobytes()
        assert a.summary == {**b.summary, "policy_seconds": a.summary["policy_seconds"]}
