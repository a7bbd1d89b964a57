"""Every paper constant that a policy default encodes, pinned to the sentence it comes from.

A test here fails when a default changes; the docstring or comment quotes the source (WnW,
VoxZip, or the paper / reference implementation of the baseline). Mechanisms that the papers
define in words (top-k chunks, δ release and its streak reset, chunk score as a mean, the
per-segment quota, sinks + recent window, temporal decay) are checked on hand-made inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.policies._params import require_int, require_real
from kvsim.policies._wnw_layout import PAPER_VOICE_FRACTION, TIDAL, SegmentLayout, kept_per_segment
from kvsim.policies.base import Tier
from kvsim.policies.registry import available, make
from kvsim.policies.voxzip import decayed_accumulate, generation_scope_keep, sink_recent_topn
from tests._zoo_a_views import FakeStepView, make_ctx, random_prefill

VS4 = np.array([[1.0, 0.8], [0.5, 0.2]])


def _defaults(name: str) -> dict:
    return make(name, 0.2).hyperparameters()


# ----------------------------------------------------------------------------- WnW
def test_wnw_defaults_are_the_papers() -> None:
    d = _defaults("wnw")
    assert d["n_anchor"] == 5  # §2.2 "the top n_anchor=5 are designated anchor heads"
    assert d["chunk_seconds"] == 4.0 and d["stride_seconds"] == 2.0  # §2.3 W_c=4 s, W_s=2 s
    assert d["top_k"] == 3  # §2.3 "the top-k (k=3) chunks are selected"
    assert d["delta"] == 3  # §2.3 "unselected for δ=3 consecutive steps are released"
    assert d["prefill_selection"] == "segment"  # §2.3 "Selection is performed per segment"
    assert d["triage_signal"] == "vs_hs"  # §2.2 "VS×HS that drives all triage decisions"
    assert d["min_per_segment"] == 0  # §2.3 "the top ⌊retention·n_s⌋ positions" (may be 0)
    assert d["budget_mode"] == "paper"  # §3.4 "select λ ... so that the measured r_GPU matches"
    assert d["lam"] is None  # §3.4: λ comes from a calibration set (per-input fit + warning)


def test_wnw_voice_head_table_is_section_3_4() -> None:
    """§3.4: n_voice ∈ {90,50,30,30} of 240 Voxtral heads at r_GPU ∈ {0.2,0.4,0.6,0.8}."""
    assert PAPER_VOICE_FRACTION == ((0.2, 90 / 240), (0.4, 50 / 240), (0.6, 30 / 240),
                                    (0.8, 30 / 240))
    qwen = [round(f * 72) for _, f in PAPER_VOICE_FRACTION]
    assert qwen == [27, 15, 9, 9]  # "{27,15,9,9} on Qwen2.5-Omni (L×H_kv=72)"


@pytest.mark.parametrize(("r_tok", "n_s", "n_c"), [(12.5, 25, 50), (25.0, 50, 100)])
def test_wnw_segment_geometry_is_section_2_3(r_tok: float, n_s: int, n_c: int) -> None:
    """§2.3: "With r_tok=12.5 for Voxtral, n_c=50 and n_s=25; with r_tok=25 ... 100 and 50"."""
    lay = SegmentLayout.from_seconds(1000, r_tok, 4.0, 2.0)
    assert (lay.n_s, lay.n_c) == (n_s, n_c)


def test_wnw_chunk_score_is_a_mean_not_a_sum() -> None:
    """§2.3: "chunk c receives score Ā_c = mean_{τ∈c} A_τ" (a short last chunk is not
    penalised: a uniform score gives every chunk the same value)."""
    lay = SegmentLayout.from_seconds(110, 12.5, 4.0, 2.0)  # last chunk 35 tokens, others 50
    np.testing.assert_allclose(lay.chunk_scores(np.ones(110)), 1.0, rtol=0, atol=1e-12)


def test_wnw_quota_floor_default_is_zero() -> None:
    """§2.3 "the top ⌊retention_{l,k}·n_s⌋ positions are kept": ⌊0.03·25⌋ = 0."""
    pol = make("wnw", 0.2)
    assert kept_per_segment(np.array([0.03]), np.array([25]), pol.min_per_segment)[0, 0] == 0


def _paper_wnw(**kw):
    ctx = make_ctx(2, 4, 2, 400, voice_score=VS4)  # 16 segments of 25, 15 chunks
    kw.setdefault("top_k", 1)
    pol = make("wnw", 0.5, n_voice=3, n_anchor=1, lam=0.5, **kw)
    pol.prefill(ctx, random_prefill(ctx))
    return ctx, pol


def _hot(ctx, step: int, spots: list[tuple[int, int, float]]) -> FakeStepView:
    att = np.zeros((ctx.heads.n_layers, ctx.heads.n_q_heads, ctx.n_audio))
    for lo, hi, w in spots:
        att[..., lo:hi] = w
    return FakeStepView(step, att)


def test_wnw_selects_exactly_the_top_k_chunks() -> None:
    """§2.3: the top-k (k=3) chunks by score are selected and their segments recalled."""
    ctx, pol = _paper_wnw(top_k=3)
    # four hot chunks of decreasing weight; chunks are [25c, 25c+50): c = 0, 4, 8, 12 score
    # 4, 3.5, 3, 1 (the overlapping chunks between them score at most 2)
    spots = [(0, 50, 4.0), (100, 150, 3.5), (200, 250, 3.0), (300, 350, 1.0)]
    pol.decode_step(_hot(ctx, 0, spots))
    resident = np.flatnonzero(pol.resident_segments_).tolist()
    assert resident == [0, 1, 4, 5, 8, 9]  # top 3 chunks' segments; not 12, 13


def test_wnw_release_after_delta_and_streak_reset_on_reselection() -> None:
    """§2.3: a recalled segment "unselected for δ=3 consecutive steps" is released; being
    selected again resets the count (consecutive)."""
    ctx, pol = _paper_wnw()
    a, b = (0, 50, 1.0), (300, 350, 1.0)  # chunk 0 (segments 0, 1) and chunk 12 (12, 13)
    pol.decode_step(_hot(ctx, 0, [a]))
    assert pol.resident_segments_[[0, 1]].all()
    pol.decode_step(_hot(ctx, 1, [b]))  # 0, 1 unselected: 1
    pol.decode_step(_hot(ctx, 2, [b]))  # 2
    pol.decode_step(_hot(ctx, 3, [a]))  # selected again: the count restarts
    for s in range(4, 4 + pol.delta - 1):
        pol.decode_step(_hot(ctx, s, [b]))
        assert pol.resident_segments_[[0, 1]].all()  # δ-1 unselected steps: still resident
    pol.decode_step(_hot(ctx, 10, [b]))  # the δ-th consecutive unselected step
    assert not pol.resident_segments_[[0, 1]].any()


def test_wnw_recall_moves_only_tidal_heads_from_cpu() -> None:
    """§2.3: "For tidal heads, segments ... are recalled from the CPU complement"."""
    ctx, pol = _paper_wnw()
    before = pol._tiers.copy()
    after = pol.decode_step(_hot(ctx, 0, [(0, 50, 1.0)]))
    moved = (before != Tier.GPU) & (after == Tier.GPU)
    assert moved.any() and (pol.roles_[moved.any(axis=-1)] == TIDAL).all()
    assert (before[moved] == Tier.CPU).all()


# ----------------------------------------------------------------------------- VoxZip
def test_voxzip_defaults_are_the_papers() -> None:
    d = _defaults("voxzip")
    assert d["gamma"] == 0.95  # VoxZip, experimental setup: "γ ... is empirically set to 0.95"
    assert d["n_sink"] == 4  # VoxZip stage 2 "we empirically set T=4"
    assert d["recent_fraction"] == 0.2  # VoxZip stage 2 "20% of the total KV cache budget"
    # VoxZip stage 2: "a dynamic KV cache eviction mechanism during the generation stage";
    # WnW §3.3 compares five baselines, VoxZip not among them, so its audio-only scope is not
    # VoxZip's default here
    assert d["scope"] == "generation"


def test_voxzip_generation_scope_recent_window_slides_onto_generated_tokens() -> None:
    """VoxZip stage 2 "the latest M recent tokens" of a cache that grows by one generated token
    per step ("zero-padding concatenation ... for the newly generated token"): with b = 20,
    M = 4, after g = 4 steps no audio token is recent any more and the audio keeps b − g."""
    scores = np.zeros((1, 100))
    scores[0, 40:60] = 1.0
    full = np.ones((1, 100), dtype=bool)
    keep = generation_scope_keep(scores, full, 20, 4, 4, 0.2)[0]
    assert keep[:4].all() and not keep[-4:].any()  # sinks stay, the audio end lost its window
    assert keep.sum() == 16 and keep[40:52].all()


def test_voxzip_decay_is_gamma_times_padded_previous_plus_attention() -> None:
    """VoxZip eq. (A^(t) = γ·[A^(t-1), 0] + softmax(q_t K_t^T/√d)), exact in float64."""
    out = decayed_accumulate(np.array([1.0, 2.0]), np.array([0.5, 0.25, 0.25]), 0.5)
    assert out.tolist() == [1.0, 1.25, 0.25]


def test_voxzip_keeps_sinks_and_recent_window_whatever_their_score() -> None:
    """VoxZip stage 2: "unconditionally preserve the first T attention sink tokens and the latest
    M recent tokens"; M = 20% of the budget, the rest is top-N by score."""
    scores = np.zeros((1, 100))
    scores[0, 40:60] = 1.0  # all the score mass in the middle
    keep = sink_recent_topn(scores, 20, 4, 0.2)[0]
    assert keep[:4].all() and keep[-4:].all()  # T = 4 sinks, M = floor(0.2·20) = 4 recent
    assert keep.sum() == 20 and keep[40:52].all()  # N = 12 top scores


def test_voxzip_layer_scoring_shares_one_vector_per_layer() -> None:
    """VoxZip stage 2 "operating independently per layer, the ... score vector A ∈ R^{1×t}"."""
    ctx = make_ctx(2, 4, 2, 60)
    view = random_prefill(ctx)
    layer = make("voxzip", 0.3, scoring="layer")
    tiers = layer.prefill(ctx, view)
    assert (tiers[:, 0] == tiers[:, 1]).all()  # every KV-head of a layer keeps the same
    head = make("voxzip", 0.3).prefill(ctx, view)
    assert not (head[:, 0] == head[:, 1]).all()  # the per-KV-head default differs


# ----------------------------------------------------------------------------- AffPool
def test_affpool_layers_defaults_are_wnw_appendix_f() -> None:
    """WnW App. F: "Deep pooling with window size 3 is applied to the first 27 layers of
    Voxtral-mini-3b, and input pooling with window size 1 is applied to the last 3 layers"."""
    import inspect

    from kvsim.tracer.transforms.affpool import affpool
    from kvsim.tracer.transforms.affpool_layers import UNPOOLED_LAST_LAYERS, LayerPoolConfig

    cfg = LayerPoolConfig(threshold=0.9)
    assert cfg.window == 3 and UNPOOLED_LAST_LAYERS == 3
    assert cfg.pool_layers(30) == 27  # Voxtral-mini-3b's 30 decoder layers
    assert inspect.signature(affpool).parameters["window"].default == 3  # input variant too


# ----------------------------------------------------------------------------- baselines
def test_adakv_defaults_are_wnw_appendix_f() -> None:
    d = _defaults("adakv")
    assert d["floor_alpha"] == 0.8  # App. F "floor_alpha=0.8"
    assert d["kernel"] == 7  # App. F "kernel size 7"
    assert d["pooling"] == "max"  # App. F "pooling max"
    assert d["window"] == 32  # SnapKV / Ada-KV reference window_size 32


def test_audiokv_defaults_are_wnw_appendix_f() -> None:
    d = _defaults("audiokv")
    # App. F "α=0.5, ρ=0.7, observation window 32, baseline ratio 0.5"
    assert (d["alpha"], d["rho"], d["window"], d["baseline_ratio"]) == (0.5, 0.7, 32, 0.5)


def test_page_sizes() -> None:
    assert _defaults("arkvale")["page_size"] == 32  # App. F "Page size 32"
    assert _defaults("quest")["page_size"] == 16  # Quest: 16-token pages


def test_other_baseline_defaults() -> None:
    assert _defaults("snapkv") == {"window": 32, "kernel": 7, "pooling": "avg"}  # SnapKV ref. window 32, kernel 7 = App. F
    assert _defaults("streaming")["n_sink"] == 4  # StreamingLLM: 4 initial tokens as sinks
    assert _defaults("h2o")["recent_fraction"] == 0.5  # H2O: heavy ratio = recent ratio
    assert _defaults("chunkkv")["chunk_size"] == 10  # ChunkKV: chunk size 10
    assert _defaults("pyramidkv")["beta"] == 20.0  # PyramidKV reference beta = 20
    assert _defaults("arkvale")["topk_fraction"] == 0.5  # ArkVale reference: half the budget


# ----------------------------------------------------------------------------- range checks
@pytest.mark.parametrize(
    ("name", "params", "msg"),
    [
        ("snapkv", {"window": 0}, "snapkv: window must be >= 1, got 0"),
        ("snapkv", {"kernel": 0}, "snapkv: kernel must be >= 1, got 0"),
        ("snapkv", {"pooling": "min"}, "snapkv: pooling must be one of"),
        ("adakv", {"floor_alpha": 1.5}, r"adakv: floor_alpha must be in \[0, 1\], got 1.5"),
        ("pyramidkv", {"beta": 0.5}, "pyramidkv: beta must be >= 1, got 0.5"),
        ("audiokv", {"rho": 0.0}, r"audiokv: rho must be in \(0, 1\], got 0.0"),
        ("audiokv", {"window": -3}, "audiokv: window must be >= 1, got -3"),
        ("chunkkv", {"window": 0}, "chunkkv: window must be >= 1, got 0"),
        ("streaming", {"n_sink": -1}, "streaming: n_sink must be >= 0, got -1"),
        ("h2o", {"window": -1}, "h2o: window must be >= 0, got -1"),
        ("quest", {"dense_layers": -1}, "quest: dense_layers must be >= 0, got -1"),
        ("arkvale", {"n_window_pages": -1}, "arkvale: n_window_pages must be >= 0, got -1"),
        ("arkvale", {"sparse_read": 1}, "arkvale: sparse_read must be True or False, got 1"),
        ("voxzip", {"gamma": 0.0}, r"voxzip: gamma must be in \(0, 1\], got 0.0"),
        ("voxzip", {"scoring": "q"}, "voxzip: scoring must be one of"),
        ("voxzip", {"scope": "all"}, "voxzip: scope must be one of"),
        ("voxzip", {"n_sink": -1}, "voxzip: n_sink must be >= 0, got -1"),
        ("voxzip", {"recent_fraction": 1.5}, r"voxzip: recent_fraction must be in \[0, 1\], got 1.5"),
        ("voxzip", {"recent_fraction": -0.1}, r"voxzip: recent_fraction must be in \[0, 1\], got -0.1"),
        ("random", {"salt": 0.5}, "random: salt must be an integer, got 0.5"),
        ("wnw", {"n_voice": "30"}, "wnw: n_voice must be an integer or None, got '30'"),
    ],
)
def test_bad_hyperparameters_are_one_line_errors(name: str, params: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        make(name, 0.2, **params)


def test_every_policy_accepts_its_own_defaults() -> None:
    for name in available():
        make(name, 0.2)  # the checks never refuse a default


def test_voxzip_accepts_the_edges_of_its_ranges() -> None:
    """No sinks, no recent window, or a window of the whole budget are valid settings."""
    for params in ({"n_sink": 0}, {"recent_fraction": 0.0}, {"recent_fraction": 1.0}):
        make("voxzip", 0.2, **params)


def test_range_helpers_reject_nan_inf_and_bool() -> None:
    with pytest.raises(ValueError, match="x: a must be a number, got nan"):
        require_real("x", "a", float("nan"))
    with pytest.raises(ValueError, match="x: a must be finite"):
        require_real("x", "a", float("inf"))
    with pytest.raises(ValueError, match="x: a must be an integer, got True"):
        require_int("x", "a", True)
    require_int("x", "a", np.int64(3), lo=1, hi=3)  # NumPy integers are integers
    with pytest.raises(ValueError, match=r"x: a must be in \[1, 3\], got 4"):
        require_int("x", "a", 4, lo=1, hi=3)
    with pytest.raises(ValueError, match=r"x: a must be < 1, got 1.0"):
        require_real("x", "a", 1.0, hi=1, hi_open=True)
