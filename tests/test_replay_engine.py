"""The replay engine: exactness against a direct recomputation, metrics, invariants."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kvsim.policies.base import (
    Policy,
    PolicyContext,
    PrefillView,
    QueryView,
    StepView,
    Tier,
    full_tiers,
)
from kvsim.policies.registry import register
from kvsim.replay.engine import InvariantViolation, PolicySpec, ReplayConfig, replay_trace
from kvsim.trace import Trace
from tests.conftest import make_trace
from tests.float32_bounds import gamma, logit_bound, renormalised_rel_bound


@register
@dataclass
class _Recorder(Policy):
    """Test policy: random GPU/CPU tiers, random swaps every step, records what it sees."""

    name = "_test_recorder"
    needs_step_attention = True
    recallable = True
    seed: int = 0
    seen: list = field(default_factory=list, repr=False)

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        self.rng = np.random.default_rng(self.seed)
        self.ctx = ctx
        t = full_tiers(ctx, Tier.CPU)
        t[self.rng.random(t.shape) < self.budget] = Tier.GPU
        self.tiers = t
        self.history = [t.copy()]
        return t

    def decode_step(self, view: StepView) -> np.ndarray:
        self.seen.append(np.stack([view.audio_attention(layer).copy()
                                   for layer in range(self.ctx.heads.n_layers)]))
        t = self.tiers.copy()
        flip = self.rng.random(t.shape) < 0.1
        t[flip] = np.where(t[flip] == Tier.GPU, Tier.CPU, Tier.GPU)
        self.tiers = t
        self.history.append(t.copy())
        return t


@register
@dataclass
class _Zombie(Policy):
    """Test policy that breaks 'GONE is absorbing'."""

    name = "_test_zombie"

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        self.t = full_tiers(ctx, Tier.GONE)
        return self.t

    def decode_step(self, view: StepView) -> np.ndarray:
        t = self.t.copy()
        t[0, 0, 0] = Tier.GPU
        return t


@register
@dataclass
class _Greedy(Policy):
    """Test policy that keeps more than the capacity it declares."""

    name = "_test_greedy"

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        self.cap = ctx.budget_tokens(self.budget)
        return full_tiers(ctx)

    def gpu_capacity(self) -> int:
        return self.cap


@register
@dataclass
class _Peeker(Policy):
    """Test policy: half the audio on CPU; select() reads GPU only, except (``peek``) one CPU
    position at layer 1 of step 2. With ``none_layer`` it returns None at that layer after
    moving that layer's tiers (allowed: None reads the tiers before the step)."""

    name = "_test_peeker"
    query_aware = True
    recallable = True
    peek: bool = True
    none_layer: int = -1

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        self.t = full_tiers(ctx, Tier.CPU)
        self.t[..., ::2] = Tier.GPU
        return self.t.copy()

    def select(self, view: QueryView) -> np.ndarray | None:
        if view.layer == self.none_layer:
            self.t[view.layer] = np.where(self.t[view.layer] == Tier.GPU, Tier.CPU, Tier.GPU)
            return None
        read = self.t[view.layer] == Tier.GPU
        if self.peek and view.step == 2 and view.layer == 1:
            read = read.copy()
            read[0, 1] = True
        return read

    def current_tiers(self) -> np.ndarray:
        return self.t


@register
@dataclass
class _LayerReader(Policy):
    """Test policy: records the step attention of the layers it declares (and all of them)."""

    name = "_test_layer_reader"
    needs_step_attention = True
    layers: tuple = (1,)
    seen: list = field(default_factory=list, repr=False)

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        self.n_layers = ctx.heads.n_layers
        return full_tiers(ctx)

    def step_attention_layers(self) -> list[int]:
        return list(self.layers)

    def decode_step(self, view: StepView) -> None:
        self.seen.append(np.stack([view.audio_attention(la).copy() for la in range(self.n_layers)]))
        return None


def _direct(trace: Trace, layer: int, step: int,
            gpu_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """softmax(q Kᵀ/√d) in float64 over non-audio + resident audio, audio columns, (H_q, T_a);
    the worst-case error of the engine's float32 computation of it, element by element; and
    each q-head's renormaliser z (the full softmax's mass on the positions read), (H_q,)."""
    m = trace.meta
    g = m.model.n_q_heads // m.model.n_kv_heads
    p = m.n_prefill + step
    q = trace.queries(layer)[:, trace.query_index(p)].astype(np.float64)
    k = trace.keys(layer)[:, : p + 1].astype(np.float64)
    audio = trace.audio_positions
    out = np.zeros((m.model.n_q_heads, len(audio)))
    bound = np.zeros_like(out)
    zs = np.zeros(m.model.n_q_heads)
    for h in range(m.model.n_q_heads):
        logits = k[h // g] @ q[h] / np.sqrt(m.model.head_dim)
        allowed = np.ones(p + 1, dtype=bool)
        allowed[audio] = gpu_mask[h // g]
        e = np.exp(logits[allowed] - logits[allowed].max())
        full = np.zeros(p + 1)
        full[allowed] = e / e.sum()
        out[h] = full[audio]
        # the engine renormalises its float32 softmax P over all p + 1 keys by
        # z = 1 - audio mass + kept audio mass (float32 sums over T_a terms)
        e_all = np.exp(logits - logits.max())
        z = zs[h] = (e_all / e_all.sum())[allowed].sum()
        err = logit_bound(q[h], k[h // g])
        bound[h] = out[h] * renormalised_rel_bound(err, allowed, z, len(audio))
    return out, bound, zs


def test_replayed_attention_equals_direct_recomputation(small_trace: Trace) -> None:
    """The attention a policy sees equals a float64 recomputation under its mask, within the
    worst-case float32 error of the engine's computation (derived, not tuned)."""
    (run,) = replay_trace(small_trace, [PolicySpec("_test_recorder", 0.4, {"seed": 5})],
                          ReplayConfig(record_tiers=True))
    seen, tiers = run.policy.seen, run.tiers
    assert len(seen) == small_trace.meta.n_decode
    rng = np.random.default_rng(0)
    m = small_trace.meta
    for _ in range(12):
        s = int(rng.integers(0, m.n_decode))
        layer = int(rng.integers(0, m.model.n_layers))
        gpu = tiers[s][layer] == Tier.GPU  # tiers in force during step s
        ref, bound, z = _direct(small_trace, layer, s, gpu)
        np.testing.assert_array_less(np.abs(seen[s][layer] - ref), bound + 1e-30)
        # the bound is far below what a wrong mask or a missing renormaliser would move
        missing_renormaliser = np.abs(ref * (1.0 - z[:, None])).max()
        assert (bound <= 1e-3 * ref).all() and bound.max() < 0.01 * missing_renormaliser
        h = int(rng.integers(0, m.model.n_q_heads))
        g = m.model.n_q_heads // m.model.n_kv_heads
        assert (seen[s][layer][h][~gpu[h // g]] == 0).all()


def test_full_policy_recall_one_error_zero(small_trace: Trace) -> None:
    (r,) = replay_trace(small_trace, [PolicySpec("full", 1.0)])
    # exact by construction: a run that keeps a KV-head's whole audio takes the full mass,
    # normaliser 1 and the full output themselves, and top-K hits are sums of 0/1
    assert r.summary["attn_recall"] == 1.0
    assert r.summary["output_error"] == 0.0
    assert r.summary["topk_jaccard"] == 1.0
    assert r.summary["r_gpu"] == 1.0


@pytest.mark.parametrize("name", ["streaming", "snapkv"])
def test_static_policies_hit_target_r_gpu(small_trace: Trace, name: str) -> None:
    (r,) = replay_trace(small_trace, [PolicySpec(name, 0.2)])
    assert abs(r.summary["r_gpu"] - 0.2) <= 0.01
    assert r.summary["r_gpu_max"] <= 0.2 + 1e-9
    assert r.summary["r_gpu_cpu"] == pytest.approx(r.summary["r_gpu"])
    assert 0 < r.summary["attn_recall"] < 1
    assert r.summary["h2d_mb_per_step"] == 0


def test_snapkv_beats_random_choice_on_window_attention(small_trace: Trace) -> None:
    """SnapKV keeps what the observation window attends to: its prefill recall must beat
    streaming's sink+recent choice on the prefill-heavy start of the audio."""
    snap, stream = replay_trace(small_trace, [PolicySpec("snapkv", 0.2, {"window": 12}),
                                              PolicySpec("streaming", 0.2)], ReplayConfig(max_steps=3))
    assert snap.summary["attn_recall"] > stream.summary["attn_recall"]


def test_sharing_logits_gives_same_results_as_separate_runs(small_trace: Trace) -> None:
    """A run's metrics do not depend on the runs replayed with it, up to float32 rounding:
    the kept mass and output of all runs are one matrix product per KV-head, whose summation
    order may depend on its width and on the CPU's BLAS kernel. Decisions, counts, r_GPU and
    top-K hits (sums of 0/1) are identical; a full mask is exact by construction."""
    specs = [PolicySpec("snapkv", 0.3), PolicySpec("streaming", 0.5), PolicySpec("full", 1.0)]
    together = replay_trace(small_trace, specs)
    n_audio = len(small_trace.audio_positions)
    # recall = kept / full mass, each a sum of n_audio non-negative float32 terms (γ_n
    # relative each), computed once alone and once together: 4·γ_n apart at most
    recall_tol = 4 * gamma(n_audio)
    err_tol = _output_error_tolerance(small_trace)
    for spec, joint in zip(specs, together, strict=True):
        (alone,) = replay_trace(small_trace, [spec])
        assert alone.summary["attn_recall"] == pytest.approx(joint.summary["attn_recall"],
                                                             rel=recall_tol)
        assert alone.summary["output_error"] == pytest.approx(joint.summary["output_error"],
                                                              abs=err_tol)
        # per-head Jaccards are identical ratios of exact 0/1 sums; their float32 mean over
        # the q-heads may be reduced in another order
        assert alone.summary["topk_jaccard"] == pytest.approx(
            joint.summary["topk_jaccard"], rel=2 * gamma(small_trace.head_layout.n_q_heads))
        assert alone.summary["r_gpu"] == joint.summary["r_gpu"]
        assert alone.step_log.equals(joint.step_log)
    full = together[-1].summary
    assert full["attn_recall"] == 1.0 and full["output_error"] == 0.0 and full["topk_jaccard"] == 1.0


def _output_error_tolerance(trace: Trace) -> float:
    """Bound on how far the replayed output error of one run can move with the summation order
    of its ``P·V`` products: each output's error is at most ``γ_N·max|v|·√D`` in norm (weights
    sum to at most 1 after renormalisation), for the compressed and the full output, relative
    to the smallest full-attention output norm of the trace (computed here in float64)."""
    heads, meta = trace.head_layout, trace.meta
    g, d = heads.group, heads.head_dim
    n = meta.n_positions
    v_max, out_min = 0.0, np.inf
    for layer in range(heads.n_layers):
        keys = np.asarray(trace.keys(layer), dtype=np.float64)[np.arange(heads.n_q_heads) // g]
        vals = np.asarray(trace.values(layer), dtype=np.float64)[np.arange(heads.n_q_heads) // g]
        v_max = max(v_max, float(np.abs(vals).max()))
        for s in range(meta.n_decode):
            p = meta.n_prefill + s
            q = np.asarray(trace.queries(layer)[:, trace.query_index(p)], dtype=np.float64)
            logit = np.einsum("hd,hnd->hn", q, keys[:, : p + 1]) / np.sqrt(d)
            w = np.exp(logit - logit.max(axis=-1, keepdims=True))
            out = np.einsum("hn,hnd->hd", w / w.sum(-1, keepdims=True), vals[:, : p + 1])
            out_min = min(out_min, float(np.linalg.norm(out, axis=-1).min()))
    # two outputs (compressed, full) per error, each off by at most the bound, plus the
    # error's own relative perturbation (error <= 2): (2 + 2)·bound / |out|
    return float(4 * gamma(n) * v_max * np.sqrt(d) / out_min)


def test_transfers_and_step_log(small_trace: Trace) -> None:
    (r,) = replay_trace(small_trace, [PolicySpec("_test_recorder", 0.5)], ReplayConfig(record_tiers=True))
    log = r.step_log
    assert log.height == small_trace.meta.n_decode
    # recompute h2d from the recorded tiers
    for s in range(3):
        prev, new = r.tiers[s], r.tiers[s + 1]
        recalled = (prev == Tier.CPU) & (new == Tier.GPU)
        assert log["h2d_tokens"][s] == recalled.sum()
        d = small_trace.meta.model.head_dim
        assert log["h2d_bytes"][s] == recalled.sum() * 2 * d * 2
        runs = sum(int(np.diff(np.concatenate([[0], row.astype(int)])).clip(0).sum())
                   for row in recalled.reshape(-1, recalled.shape[-1]))
        assert log["h2d_transfers"][s] == runs
        assert sum(log["h2d_tokens_by_layer"][s]) == log["h2d_tokens"][s]
    assert r.summary["r_gpu"] <= r.summary["r_gpu_cpu"] <= 1.0


def test_invariant_violations_are_caught(tmp_path: Path) -> None:
    t = Trace(make_trace(tmp_path / "t.kvtrace"))
    with pytest.raises(InvariantViolation, match="GONE"):
        replay_trace(t, [PolicySpec("_test_zombie", 0.5)])
    with pytest.raises(InvariantViolation, match="capacity"):
        replay_trace(t, [PolicySpec("_test_greedy", 0.5)])


def test_select_reading_cpu_audio_is_caught(tmp_path: Path) -> None:
    t = Trace(make_trace(tmp_path / "t.kvtrace"))
    with pytest.raises(InvariantViolation, match=r"not on GPU \(step 2, layer 1\)"):
        replay_trace(t, [PolicySpec("_test_peeker", 0.5), PolicySpec("full", 1.0)])
    # honest reads pass, and a None select() may move that layer's tiers
    (run,) = replay_trace(t, [PolicySpec("_test_peeker", 0.5, {"peek": False, "none_layer": 0})])
    assert run.summary["read_fraction"] == pytest.approx(0.5)


def test_step_attention_is_filled_for_declared_layers(small_trace: Trace) -> None:
    specs = [PolicySpec("_test_layer_reader", 1.0, {"layers": (1,)}),
             PolicySpec("_test_layer_reader", 1.0, {"layers": tuple(range(small_trace.meta.model.n_layers))}),
             PolicySpec("h2o", 0.5)]
    one, every, _ = replay_trace(small_trace, specs, ReplayConfig(max_steps=3))
    for a, b in zip(one.policy.seen, every.policy.seen, strict=True):
        assert np.array_equal(a[1], b[1])  # the declared layer: the same attention
        assert np.isnan(a[0]).all() and not np.isnan(b[0]).any()  # undeclared: NaN, not stale
