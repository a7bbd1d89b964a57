"""Live decoding: policies applied inside a real (tiny, random-weight) HF decoder."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

from kvsim.core.attention import gqa_logits, softmax_
from kvsim.core.steplog import STEP_LOG_COLUMNS
from kvsim.decode_attention import masked_attention_probs, masked_decode_attention
from kvsim.live.decode import LiveConfig, live_generate, plain_generate
from kvsim.live.models import TinyBackbone, TinyConfig
from kvsim.policies import registry
from kvsim.policies.base import HeadScores, Tier
from kvsim.replay.engine import PolicySpec
from tests.float32_bounds import attention_output_bound, logit_bound, softmax_rel_bound

torch.set_num_threads(1)
L, HKV, HQ = 3, 4, 8
N_NEW = 40


@pytest.fixture(scope="module")
def lm():
    return TinyBackbone(TinyConfig(n_layers=L, n_q_heads=HQ, n_kv_heads=HKV, head_dim=16))


@pytest.fixture(scope="module")
def prompt(lm):
    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(16000 * 16)).astype(np.float32)
    audio[: 16000 * 4] *= np.linspace(0, 3, 16000 * 4, dtype=np.float32)  # structure in energy
    return lm.prepare(audio)


@pytest.fixture(scope="module")
def scores():
    rng = np.random.default_rng(1)
    return HeadScores(rng.random((L, HKV)), rng.random((L, HKV)), source="test")


@pytest.fixture(scope="module")
def reference(lm, prompt):
    return plain_generate(lm, prompt, N_NEW)


def _run(lm, prompt, name, budget, scores, physical=False, **params):
    cfg = LiveConfig(max_new_tokens=N_NEW, physical=physical, head_scores=scores)
    return live_generate(lm, prompt, PolicySpec(name, budget, params), cfg)


def test_prompt_layout(lm, prompt):
    assert prompt.n_audio == 200  # 16 s at 12.5 tokens/s
    assert prompt.audio_positions[0] == lm.cfg.prefix_tokens
    assert prompt.n_prompt == lm.cfg.prefix_tokens + 200 + lm.cfg.window_tokens


@pytest.mark.parametrize("physical", [False, True])
def test_full_is_token_identical_to_generate(lm, prompt, reference, scores, physical):
    run = _run(lm, prompt, "full", 1.0, scores, physical=physical)
    assert run.tokens == reference
    assert run.summary["r_gpu"] == 1.0 and run.summary["r_gpu_cpu"] == 1.0


def test_every_policy_at_budget_one_is_token_identical(lm, prompt, reference, scores):
    for name in registry.available():
        run = _run(lm, prompt, name, 1.0, scores)
        assert run.tokens == reference, name


def test_compression_changes_the_output(lm, prompt, reference, scores):
    # guards the identity tests above: the policy really acts on the model
    run = _run(lm, prompt, "streaming", 0.05, scores)
    assert run.tokens != reference
    assert run.summary["r_gpu"] == pytest.approx(0.05, abs=0.01)


@pytest.mark.parametrize(("name", "budget", "params"), [
    ("wnw", 0.2, {}), ("wnw", 0.4, {}), ("arkvale", 0.2, {}), ("arkvale", 0.4, {"page_size": 8}),
])
def test_physical_offload_matches_masking(lm, prompt, reference, scores, name, budget, params):
    mask = _run(lm, prompt, name, budget, scores, physical=False, **params)
    phys = _run(lm, prompt, name, budget, scores, physical=True, **params)
    assert mask.tokens == phys.tokens
    assert mask.step_log.equals(phys.step_log)
    assert phys.summary["r_gpu"] < 0.5
    # device memory really holds less audio than the full cache (fp32 K+V)
    full_bytes = L * HKV * prompt.n_audio * 16 * 2 * 4
    assert phys.summary["device_audio_mb"] * 1e6 < full_bytes


def test_physical_recalls_move_the_logged_bytes(lm, prompt, scores):
    phys = _run(lm, prompt, "arkvale", 0.4, scores, physical=True, page_size=8)
    logged = phys.step_log["h2d_bytes"].sum()
    assert logged > 0, "the test needs a run that recalls"
    steps = phys.summary["steps"]
    assert phys.summary["physical_h2d_mb_per_step"] * steps * 1e6 == pytest.approx(logged, rel=0.05)


def test_step_log_contract(lm, prompt, scores):
    run = _run(lm, prompt, "snapkv", 0.3, scores)
    log = run.step_log
    assert dict(log.schema) == {k: v for k, v in STEP_LOG_COLUMNS.items()}
    assert log.height == len(run.tokens) - 1  # one row per decode forward
    total = L * HKV * prompt.n_audio
    assert (log["gpu_audio_tokens"] == int(0.3 * prompt.n_audio) * L * HKV).all()
    assert log["context_tokens"].to_list() == [prompt.n_prompt + s + 1 for s in range(log.height)]
    assert run.summary["r_gpu"] == pytest.approx(log["gpu_audio_tokens"].mean() / total)
    assert isinstance(log, pl.DataFrame)


def test_prefill_view_matches_eager_attention(lm, prompt, scores):
    """The PrefillView the policy sees = the model's own (eager) attention weights."""
    seen = {}

    class Spy(registry.get("snapkv")):
        def prefill(self, ctx, view):
            seen["att"] = [view.audio_attention(i) for i in range(ctx.heads.n_layers)]
            seen["qk"] = [(view._queries(i), view._keys[i]) for i in range(ctx.heads.n_layers)]
            seen["w"] = view.n_window
            return super().prefill(ctx, view)

    from kvsim.live import decode as dec

    spec = PolicySpec("snapkv", 0.5)
    spec_make = PolicySpec.make
    try:
        PolicySpec.make = lambda self: Spy(budget=self.budget)
        dec.live_generate(lm, prompt, spec, LiveConfig(max_new_tokens=2))
    finally:
        PolicySpec.make = spec_make
    lm.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = lm.model(**prompt.prefill_inputs(), output_attentions=True)
    finally:
        from kvsim.live.attention import LIVE_ATTN
        lm.model.set_attn_implementation(LIVE_ATTN)
    a = prompt.audio_positions
    win = np.arange(prompt.n_prompt - 32, prompt.n_prompt)  # last 32 prompt positions (App. F)
    assert win[0] < a[-1]  # the tiny prompt has 6 text positions after the audio: audio included
    assert seen["w"] == len(win)
    for layer in range(L):
        eager = out.attentions[layer][0][:, win][:, :, a].numpy()
        # numpy's float32 softmax and torch's eager one are each within the worst-case float32
        # error of the float64 softmax of the same queries and keys: 2·e_p apart at most
        exact, e_p = _exact_causal_softmax(*seen["qk"][layer], win)
        tol = 2 * e_p[..., a] * exact[..., a]
        assert (tol <= 1e-3 * exact[..., a]).all()  # tight against a wrong window or mask
        np.testing.assert_array_less(np.abs(seen["att"][layer] - eager), tol + 1e-30)


def _exact_causal_softmax(q: np.ndarray, k: np.ndarray,
                          window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float64 causal softmax of the float32 window queries ``q`` (H_q, W, D) over the keys
    ``k`` (H_kv, N, D), (H_q, W, N), and the relative error bound of a float32 computation of
    each probability (:func:`softmax_rel_bound`)."""
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    g = q.shape[0] // k.shape[0]
    exact = np.zeros((q.shape[0], len(window), k.shape[1]))
    e_p = np.zeros_like(exact)
    for h in range(q.shape[0]):
        for i, pos in enumerate(window):
            keys = k64[h // g, : pos + 1]
            logits = keys @ q64[h, i] / np.sqrt(q.shape[-1])
            w = np.exp(logits - logits.max())
            exact[h, i, : pos + 1] = w / w.sum()
            e_p[h, i] = softmax_rel_bound(logit_bound(q64[h, i], keys), pos + 1)
    return exact, e_p


def test_masked_attention_is_attention_over_the_kept_subset():
    rng = np.random.default_rng(3)
    hq, hkv, n, d = 6, 2, 30, 8
    q = torch.tensor(rng.standard_normal((1, hq, 1, d)), dtype=torch.float32)
    k = torch.tensor(rng.standard_normal((1, hkv, n, d)), dtype=torch.float32)
    v = torch.tensor(rng.standard_normal((1, hkv, n, d)), dtype=torch.float32)
    keep = torch.tensor(rng.random((hkv, n)) < 0.5)
    keep[:, 0] = True
    out = masked_decode_attention(q, k, v, keep, d**-0.5)[0, 0].numpy()  # (H_q, D)
    probs = masked_attention_probs(q, k, keep, d**-0.5).numpy()
    g = hq // hkv
    q64, k64, v64 = (t[0].double().numpy() for t in (q, k, v))  # the exact operands
    for h in range(hq):
        kv = h // g
        idx = np.flatnonzero(keep[kv].numpy())
        p = softmax_(gqa_logits(q[0, h : h + 1, 0].numpy(), k[0, kv : kv + 1, idx].numpy()))[0]
        # torch (SDPA, softmax) and numpy each within the worst-case float32 error of the
        # float64 softmax over the kept keys: they differ by at most twice that
        logits = k64[kv, idx] @ q64[h, 0] / np.sqrt(d)
        exact = np.exp(logits - logits.max())
        exact /= exact.sum()
        e_p = softmax_rel_bound(logit_bound(q64[h, 0], k64[kv, idx]), len(idx))
        out_tol = 2 * attention_output_bound(exact, v64[kv, idx], e_p)
        assert out_tol.max() < 1e-4  # far below the O(0.1) a wrong mask or head would move
        np.testing.assert_array_less(np.abs(out[h] - p @ v[0, kv, idx].numpy()), out_tol)
        np.testing.assert_array_less(np.abs(probs[h, idx] - p), 2 * e_p * exact)
        assert (probs[h, ~keep[kv].numpy()] == 0).all()


def test_step_attention_is_zero_off_the_gpu_tier(lm, prompt, scores):
    """What WnW's anchors and voxzip-style scorers read: zero mass outside the resident set."""
    seen = []

    class Spy(registry.get("wnw")):
        def step_attention_layers(self):
            return None  # the spy reads every layer's step attention

        def decode_step(self, view):
            tiers = self._live_tiers
            att = np.stack([view.audio_attention(i) for i in range(L)])  # (L, H_q, T_a)
            gpu = np.repeat(tiers == Tier.GPU, HQ // HKV, axis=1)
            seen.append((att, gpu))
            new = super().decode_step(view)
            if new is not None:
                self._live_tiers = new
            return new

        def prefill(self, ctx, view):
            self._live_tiers = super().prefill(ctx, view)
            return self._live_tiers

    spec_make = PolicySpec.make
    try:
        PolicySpec.make = lambda self: Spy(budget=self.budget)
        live_generate(lm, prompt, PolicySpec("wnw", 0.3), LiveConfig(max_new_tokens=8, head_scores=scores))
    finally:
        PolicySpec.make = spec_make
    assert seen
    for att, gpu in seen:
        assert (att[~gpu] == 0).all()
        assert (att.sum(-1) <= 1 + 1e-5).all()
        assert att[gpu].sum() > 0


def test_query_aware_select_limits_what_attention_reads(lm, prompt, scores):
    run = _run(lm, prompt, "quest", 0.25, scores)
    log = run.step_log
    total = L * HKV * prompt.n_audio
    assert run.summary["r_gpu"] == 1.0  # Quest keeps everything resident ...
    assert (log["read_audio_tokens"] < total).all()  # ... and reads a subset


def test_live_rejects_a_model_without_live_attention(prompt):
    other = TinyBackbone(TinyConfig(n_layers=1, n_q_heads=2, n_kv_heads=1))
    other.model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="kvsim_live"):
        live_generate(other, prompt, PolicySpec("full", 1.0), LiveConfig(max_new_tokens=2))


@pytest.mark.parametrize("physical", [False, True])
def test_shared_prefill_gives_the_same_run(lm, prompt, scores, physical):
    from kvsim.live.decode import prefill_once

    shared = prefill_once(lm, prompt)
    for name in ("wnw", "arkvale"):
        cfg = LiveConfig(max_new_tokens=N_NEW, physical=physical, head_scores=scores)
        a = live_generate(lm, prompt, PolicySpec(name, 0.3), cfg)
        b = live_generate(lm, prompt, PolicySpec(name, 0.3), cfg, prefilled=shared)
        assert a.tokens == b.tokens
        assert a.step_log.equals(b.step_log)
        np.testing.assert_array_equal(a.tiers_after_prefill, b.tiers_after_prefill)


@pytest.mark.parametrize(("budget", "params"), [
    (0.6, {}), (0.3, {"page_size": 8}), (0.3, {"page_size": 8, "sparse_read": True})])
def test_arkvale_selecting_on_the_device_decodes_as_on_the_host(lm, prompt, scores, budget, params):
    """ArkVale's selection on the model's device (the default on the masking path) reads and
    moves the pages its NumPy ``select`` does: same tokens, same step log."""
    def run(device_select):
        cfg = LiveConfig(max_new_tokens=N_NEW, head_scores=scores, device_select=device_select)
        return live_generate(lm, prompt, PolicySpec("arkvale", budget, params), cfg)

    on_device, on_host = run(True), run(False)
    assert on_device.tokens == on_host.tokens
    assert on_device.step_log.equals(on_host.step_log)
    assert on_host.step_log["h2d_tokens"].sum() > 0  # pages were recalled: selection acted
