"""WnW calibration (Appendix E): (d) head sensitivity equals a finite-difference estimate of the
answer-token loss gradient w.r.t. the audio keys; the voice score matches a direct computation
of Eq. 3; ``kvsim calibrate`` and ``kvsim trace --calibrate`` write the scores."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.trace import Trace
from kvsim.trace.heads import read_heads
from kvsim.tracer.audio import load_audio
from kvsim.tracer.backbones import LoadOptions, PromptSpec, load_backbone
from kvsim.tracer.calibrate import (
    CalibrationConfig,
    answer_losses,
    default_top_k,
    key_gradients,
    sample_sensitivity,
    voice_hits,
    word_span_tokens,
)
from kvsim.tracer.run import TraceOptions, generate_traced
from tests.fixtures.checkpoints import tiny_checkpoint, write_tone

torch.set_num_threads(1)


def _rms_norm_fp64(self, x):
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


@pytest.fixture(scope="module", params=["voxtral", "qwen-omni"])
def fp64(request, tmp_path_factory):
    """A tiny backbone in float64, a prepared clip and 3 greedy answer tokens.

    transformers' RMSNorm computes in float32 whatever the weights' dtype, which puts a ~1e-8
    noise floor on the loss; the loss changes finite differences must resolve are ~1e-10, so
    RMSNorm is lifted to float64 here (same function, full precision)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniRMSNorm

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LlamaRMSNorm, "forward", _rms_norm_fp64)
        mp.setattr(Qwen2_5OmniRMSNorm, "forward", _rms_norm_fp64)
        ckpt = tiny_checkpoint(request.param, tmp_path_factory.getbasetemp())
        wav = write_tone(tmp_path_factory.mktemp("cal") / "c.wav", 2.0)
        bb = load_backbone(str(ckpt), LoadOptions(dtype="float64"))
        prep = bb.prepare(load_audio(wav, bb.sample_rate), PromptSpec())
        gen = generate_traced(bb, prep, TraceOptions(max_new_tokens=3))
        yield bb, prep, gen.tokens


def test_key_gradient_equals_finite_differences(fp64):
    bb, prep, answer = fp64
    grads = dict(key_gradients(bb, prep, answer))
    facts = bb.facts()
    audio = prep.audio_positions
    rng = np.random.default_rng(0)
    eps = 1e-5
    checked = 0
    for _ in range(2):
        layer = int(rng.integers(facts.n_layers))
        head = int(rng.integers(facts.n_kv_heads))
        tau = int(rng.integers(len(audio)))
        fd = np.zeros((len(answer), facts.head_dim))
        for d in range(facts.head_dim):
            def bump(sign, layer=layer, head=head, tau=tau, d=d):
                def hook(lyr, key):
                    if lyr != layer:
                        return key
                    key = key.clone()
                    key[0, head, audio[tau], d] += sign * eps
                    return key
                with torch.no_grad():
                    return answer_losses(bb, prep, answer, hook).numpy()
            fd[:, d] = (bump(+1) - bump(-1)) / (2 * eps)
        for t in range(len(answer)):
            g = grads[t][layer][head, tau].numpy()
            np.testing.assert_allclose(g, fd[t], rtol=1e-5, atol=1e-9)
            # and the quantity HS averages: the l2 norm over the head dimension
            assert np.linalg.norm(g) == pytest.approx(np.linalg.norm(fd[t]), rel=1e-5)
            checked += 1
    assert checked == 2 * len(answer)
    assert max(float(g.abs().max()) for gl in grads.values() for g in gl) > 0


def test_sensitivity_is_mean_norm_of_key_gradients(fp64):
    bb, prep, answer = fp64
    hs = sample_sensitivity(bb, prep, answer)
    facts = bb.facts()
    assert hs.shape == (facts.n_layers, facts.n_kv_heads)
    expect = np.zeros_like(hs)
    for _t, grads in key_gradients(bb, prep, answer):
        for layer, g in enumerate(grads):
            expect[layer] += np.linalg.norm(g.numpy(), axis=-1).mean(axis=-1)
    np.testing.assert_allclose(hs, expect / len(answer), rtol=1e-10)
    assert (hs > 0).all()


def test_sensitivity_of_chosen_tokens_is_their_mean_on_the_whole_answer(fp64):
    """``steps`` picks which answer tokens' gradients are averaged; the whole answer stays the
    teacher-forced context (so the first token's gradient is the same either way)."""
    bb, prep, answer = fp64
    full = dict(key_gradients(bb, prep, answer))
    hs = sample_sensitivity(bb, prep, answer, np.array([0, 2]))
    expect = sum(np.stack([np.linalg.norm(g.numpy(), axis=-1).mean(axis=-1) for g in full[t]])
                 for t in (0, 2)) / 2
    np.testing.assert_allclose(hs, expect, rtol=1e-10)
    assert not np.allclose(hs, sample_sensitivity(bb, prep, answer), rtol=1e-6)


def test_sensitivity_steps_default_is_the_whole_answer():
    """WnW App. E, Eq. 5: E_t over the answer tokens: every one by default; a cap spreads its
    tokens evenly over the whole answer (or takes the first, as an option)."""
    from kvsim.tracer.calibrate import sensitivity_steps

    assert CalibrationConfig().max_tokens is None and CalibrationConfig().token_sample == "even"
    np.testing.assert_array_equal(sensitivity_steps(7, CalibrationConfig()), np.arange(7))
    np.testing.assert_array_equal(sensitivity_steps(9, CalibrationConfig(max_tokens=3)), [0, 4, 8])
    np.testing.assert_array_equal(sensitivity_steps(9, CalibrationConfig(max_tokens=3, token_sample="first")),
                                  [0, 1, 2])
    np.testing.assert_array_equal(sensitivity_steps(2, CalibrationConfig(max_tokens=5)), [0, 1])
    for n in range(1, 60):
        for m in range(1, n + 1):
            got = sensitivity_steps(n, CalibrationConfig(max_tokens=m))
            assert len(got) == m and got[0] == 0 and got[-1] == (n - 1 if m > 1 else 0)
            assert (np.diff(got) > 0).all()
    with pytest.raises(ValueError, match="token_sample"):
        CalibrationConfig(token_sample="random")
    with pytest.raises(ValueError, match="max_tokens"):
        CalibrationConfig(max_tokens=0)


def test_voice_hits_eq3():
    """Heads whose top-K audio keys fall in the word span score 1, elsewhere 0; GQA h -> h//g."""
    n, d = 40, 4
    audio = np.arange(5, 25)
    keys = np.zeros((1, 2, n, d), np.float32)
    keys[0, 0, audio[3:7], 0] = 5.0  # kv-head 0: big keys at audio idx 3..6 along dim 0
    keys[0, 1, audio[10:14], 1] = 5.0  # kv-head 1: audio idx 10..13 along dim 1
    queries = np.zeros((1, 4, 2, d), np.float32)
    queries[0, :, :, 0] = 1.0  # every q-head looks along dim 0
    qpos = np.array([30, 31])
    hits = voice_hits(lambda i: keys[i], lambda i: queries[i], 1, qpos, audio,
                      np.array([30, 31]), [(3, 7), (10, 14)], top_k=4)
    assert hits.shape == (2, 1, 4)
    # token 0 (span 3..6): q-heads 0,1 (kv 0) hit 4/4; q-heads 2,3 (kv 1) see all-zero logits
    np.testing.assert_array_equal(hits[0, 0, :2], [1.0, 1.0])
    np.testing.assert_array_equal(hits[1, 0, :2], [0.0, 0.0])  # token 1's span is elsewhere
    assert word_span_tokens(0.30, 0.31, 12.5, 100) == (3, 4)  # at least one token wide
    assert word_span_tokens(1.0, 2.0, 25.0, 30) == (25, 30)  # clipped to the audio
    assert default_top_k(12.5) == 4 and default_top_k(25.0) == 8


def _direct_voice_score(trace: Trace, k: int, min_conf: float) -> np.ndarray:
    """Eq. 3 written out with explicit loops and softmax attention (independent check)."""
    m = trace.meta.model
    g = m.n_q_heads // m.n_kv_heads
    pos = trace.positions
    n0 = trace.meta.n_prefill
    audio = trace.audio_positions
    rate = m.audio_tokens_per_s
    hits = []
    for j in range(trace.meta.n_decode):
        row = pos.row(n0 + j, named=True)
        if row["word_confidence"] is None or row["word_confidence"] < min_conf:
            continue
        a = int(np.floor(row["word_start_s"] * rate))
        b = max(int(np.floor(row["word_end_s"] * rate)), a + 1)
        qrow = trace.query_index(n0 - 1 + j)
        per = np.zeros((m.n_layers, m.n_q_heads))
        for layer in range(m.n_layers):
            K = np.asarray(trace.keys(layer), np.float64)
            Q = np.asarray(trace.queries(layer), np.float64)
            for h in range(m.n_q_heads):
                s = K[h // g, : n0 + j] @ Q[h, qrow]
                p = np.exp(s - s.max())
                p /= p.sum()
                top = np.argsort(-p[audio], kind="stable")[:k]
                per[layer, h] = np.mean((top >= a) & (top < b))
        hits.append(per)
    hit = np.mean(hits, axis=0)
    return hit.reshape(m.n_layers, m.n_kv_heads, g).mean(-1)


def test_trace_calibrate_with_reference_alignment(tmp_path_factory):
    ckpt = tiny_checkpoint("voxtral", tmp_path_factory.getbasetemp())
    d = tmp_path_factory.mktemp("tcal")
    wavs = [write_tone(d / f"s{i}.wav", 3.0 + i, seed=i) for i in range(2)]
    out = d / "traces"
    base = ["trace", *map(str, wavs), "--model", str(ckpt), "--out", str(out),
            "--max-new-tokens", "8", "--store-dtype", "float32"]
    res = CliRunner().invoke(app, [*base, "--aligner", "none"])
    assert res.exit_code == 0, res.output
    # reference alignments that match the (random) hypotheses word for word
    for w in wavs:
        words = Trace(out / f"{w.stem}.kvtrace").meta.generated_text.split()
        assert words
        items = [{"word": x, "start": 0.2 * i, "end": 0.2 * i + 0.3} for i, x in enumerate(words)]
        (d / f"{w.stem}.words.json").write_text(json.dumps(items))
    res = CliRunner().invoke(app, [*base, "--overwrite", "--calibrate"])
    assert res.exit_code == 0, res.output
    heads = read_heads(out / "heads.json")
    direct = []
    for w in wavs:
        tr = Trace(out / f"{w.stem}.kvtrace")
        assert tr.meta.has_head_scores
        assert tr.meta.reference_text == tr.meta.generated_text.strip()  # from the .words.json
        assert tr.meta.provenance["alignment"]["source"] == "reference"
        np.testing.assert_array_equal(tr.head_scores.voice_score, heads.voice_score)  # a copy (JSON, float64)
        gen = tr.positions.slice(tr.meta.n_prefill, tr.meta.n_decode)
        assert (gen["word_confidence"].drop_nulls() == 1.0).all()
        assert gen["word"].drop_nulls().len() > 0
        direct.append(_direct_voice_score(tr, 4, 0.85))
    np.testing.assert_allclose(heads.voice_score, np.mean(direct, axis=0), atol=1e-12)
    assert (heads.sensitivity > 0).all()


def test_calibrate_command_matches_library(tmp_path_factory):
    ckpt = tiny_checkpoint("qwen-omni", tmp_path_factory.getbasetemp())
    d = tmp_path_factory.mktemp("ccal")
    wav = write_tone(d / "a.wav", 2.0)
    res = CliRunner().invoke(app, ["calibrate", str(wav), "--model", str(ckpt), "--out",
                                   str(d / "heads.json"), "--max-new-tokens", "4",
                                   "--aligner", "none"])
    assert res.exit_code == 0, res.output
    heads = read_heads(d / "heads.json")
    raw = json.loads((d / "heads.json").read_text())
    assert raw["provenance"]["top_k"] == 8 and raw["provenance"]["teacher"] == "greedy"
    bb = load_backbone(str(ckpt))
    prep = bb.prepare(load_audio(wav, bb.sample_rate), PromptSpec())
    gen = generate_traced(bb, prep, TraceOptions(max_new_tokens=4))
    expect = sample_sensitivity(bb, prep, gen.tokens)  # the whole answer (App. E)
    # exact: the command runs this very computation on the same model, clip and tokens (the
    # mean over one input is the input), and JSON keeps float64 exactly
    np.testing.assert_array_equal(heads.sensitivity, expect)


def test_calibrate_teacher_reference_and_ranking(tmp_path_factory):
    ckpt = tiny_checkpoint("voxtral", tmp_path_factory.getbasetemp())
    d = tmp_path_factory.mktemp("ref")
    wav = write_tone(d / "r.wav", 2.0)
    (d / "r.txt").write_text("then the other one\n")
    res = CliRunner().invoke(app, ["calibrate", str(wav), "--model", str(ckpt), "--out",
                                   str(d / "h.json"), "--max-new-tokens", "3", "--aligner",
                                   "none", "--teacher", "reference"])
    assert res.exit_code == 0, res.output
    assert "VS x HS" in res.output
    raw = json.loads((d / "h.json").read_text())
    assert raw["provenance"]["teacher"] == "reference"
    bb = load_backbone(str(ckpt))
    prep = bb.prepare(load_audio(wav, bb.sample_rate), PromptSpec())
    ref = bb.tokenizer.encode("then the other one", add_special_tokens=False) + [2]
    # exact, as in test_calibrate_command_matches_library
    np.testing.assert_array_equal(read_heads(d / "h.json").sensitivity, sample_sensitivity(bb, prep, ref))
    heads = read_heads(d / "h.json")
    rank = raw["provenance"]["ranking_vs_x_hs"]
    assert sorted(map(tuple, rank)) == [(i, j) for i in range(2) for j in range(2)]
    imp = [heads.importance[i, j] for i, j in rank]
    assert imp == sorted(imp, reverse=True)


def test_trace_stores_held_out_calibration_file(tmp_path_factory):
    """`kvsim trace --heads FILE` embeds scores computed elsewhere (a held-out calibration
    set, as WnW §3.2 does) instead of calibrating on the traced inputs."""
    from kvsim.policies.base import HeadScores
    from kvsim.trace.heads import write_heads

    ckpt = tiny_checkpoint("voxtral", tmp_path_factory.getbasetemp())
    d = tmp_path_factory.mktemp("theads")
    wav = write_tone(d / "a.wav", 2.0)
    bb = load_backbone(str(ckpt))
    L, H = bb.facts().n_layers, bb.facts().n_kv_heads
    rng = np.random.default_rng(0)
    scores = HeadScores(rng.random((L, H)), rng.random((L, H)), source="held-out test set")
    write_heads(d / "heads.json", scores, "tiny")
    base = ["trace", str(wav), "--model", str(ckpt), "--out", str(d / "out"), "--max-new-tokens", "3",
            "--aligner", "none"]
    res = CliRunner().invoke(app, [*base, "--heads", str(d / "heads.json")])
    assert res.exit_code == 0, res.output
    tr = Trace(d / "out" / "a.kvtrace")
    np.testing.assert_array_equal(tr.head_scores.voice_score, scores.voice_score)  # a copy (JSON, float64)
    assert tr.head_scores.source == "held-out test set"
    # a calibration file of the wrong shape is refused with one line
    write_heads(d / "bad.json", HeadScores(np.ones((L + 1, H)), np.ones((L + 1, H))), "tiny")
    res = CliRunner().invoke(app, [*base, "--overwrite", "--heads", str(d / "bad.json")])
    assert res.exit_code == 2 and "shape" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("case", ["a folder", "under a file"])
def test_calibrate_unwritable_out_is_refused_before_the_model(tmp_path, monkeypatch, case):
    import kvsim.tracer.calibrate

    def refuse(*a, **k):
        raise AssertionError("calibration ran")

    monkeypatch.setattr(kvsim.tracer.calibrate, "calibrate_inputs", refuse)
    wav = write_tone(tmp_path / "a.wav", 1.0)
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "outdir" if case == "a folder" else tmp_path / "afile" / "h.json"
    if case == "a folder":
        out.mkdir()
    res = CliRunner().invoke(app, ["calibrate", str(wav), "--model", "minivox", "-o", str(out)])
    assert res.exit_code == 2, res.output
    (line,) = res.output.strip().splitlines()
    assert line.startswith(f"error: --out {out}: "), res.output
    assert (tmp_path / "afile").read_text() == "x" and not list(tmp_path.rglob("*.json"))


def test_store_head_scores_says_how_many_traces_got_them(tmp_path, monkeypatch):
    """With no trace written (every input failed: silent audio), nothing claims scores were stored."""
    from kvsim.policies.base import HeadScores
    from kvsim.tracer import calibrate
    from kvsim.tracer.batch import InputResult
    from kvsim.tracer.calibrate import store_head_scores

    monkeypatch.setattr(calibrate, "store_in_trace", lambda trace, scores: None)
    said: list[str] = []

    class Console:
        def print(self, text, **_):
            said.append(str(text))

    scores = HeadScores(np.ones((2, 1)), np.ones((2, 1)), source="held-out")
    store_head_scores([InputResult(tmp_path / "silent.wav", "failed", "silent audio")], scores, Console())
    assert not any("stored head scores" in s for s in said), said
    store_head_scores([InputResult(tmp_path / "a.wav", "failed", "silent audio"),
                       InputResult(tmp_path / "b.wav", "skipped", trace=tmp_path / "b.kvtrace")],
                      scores, Console())
    assert said == ["stored head scores (held-out) in 1 trace"]
