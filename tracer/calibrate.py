"""WnW head calibration (WnW §2.2, Appendix E): voice score VS and head sensitivity HS per KV-head.

* **Voice score** (Eq. 3): for each answer token t with a word-aligned span [a_t, b_t) seconds
  (alignment confidence >= 0.85), converted to audio-token indices
  [floor(a_t r), floor(b_t r)) at the model's rate r, the hit ratio of q-head (l, h) is the
  fraction of its top-K attended audio positions inside the span; K covers about one spoken word
  (K = round(0.32 r): 4 at 12.5 tok/s, 8 at 25 tok/s). The attention of token t is that of the
  query that produced it (position of t minus one). Hits are averaged over tokens, then samples,
  then over the q-heads of each GQA group: VS_{l,k} = mean_j hit_{l, k g + j}.
* **Head sensitivity** (Eqs. 4-5): HS_{l,k} = E_D[ E_t[ mean_tau || dL_t / dK_{l,k,tau} || ] ]
  where L_t is the cross-entropy of answer token t (teacher-forced on the greedy output or the
  reference), tau runs over audio positions and K are post-RoPE keys. Gradients are taken with
  respect to a zero perturbation added to the audio keys inside the attention function, which
  equals the gradient with respect to the keys themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsim.core.shapes import HeadScores
from kvsim.tracer.backbones.base import Backbone, Prepared
from kvsim.tracer.capture import Recorder, recording


@dataclass
class CalibrationConfig:
    """Appendix E settings."""

    top_k: int | None = None  #: None: round(0.32 * audio tokens per second)
    min_confidence: float = 0.85
    teacher: str = "greedy"  #: greedy (the model's own output) or reference
    #: answer tokens per sample whose loss gradient enters the sensitivity, one backward each;
    #: None: every token of the whole answer (App. E, Eq. 5: E_t over the answer tokens)
    max_tokens: int | None = None
    #: which tokens when ``max_tokens`` is below the answer's length: ``even`` (evenly spaced
    #: over the whole answer: an estimate of the whole answer's mean) or ``first`` (the
    #: answer's first tokens: what kvsim did before it followed App. E)
    token_sample: str = "even"

    def __post_init__(self) -> None:
        if self.token_sample not in TOKEN_SAMPLES:
            raise ValueError(f"token_sample: expected one of {', '.join(TOKEN_SAMPLES)}, "
                             f"got {self.token_sample!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")


#: :attr:`CalibrationConfig.token_sample` values
TOKEN_SAMPLES = ("even", "first")


def sensitivity_steps(n_answer: int, cfg: CalibrationConfig) -> np.ndarray:
    """Indices of the answer tokens whose loss gradient is taken (ascending, distinct): all of
    them by default (App. E), else ``max_tokens`` of them, evenly spaced or the first."""
    m = n_answer if cfg.max_tokens is None else min(cfg.max_tokens, n_answer)
    if cfg.token_sample == "first" or m == n_answer:
        return np.arange(m)
    return np.unique(np.round(np.linspace(0, n_answer - 1, m)).astype(np.int64))


def default_top_k(tokens_per_s: float) -> int:
    """About one spoken word (~0.32 s): 4 at 12.5 tok/s (Voxtral), 8 at 25 tok/s (Qwen-Omni)."""
    return max(1, round(0.32 * tokens_per_s))


# ------------------------------------------------------------------------------- voice score
def word_span_tokens(start_s: float, end_s: float, rate: float, n_audio: int) -> tuple[int, int]:
    """[floor(a r), floor(b r)) clipped to the audio, at least one token wide."""
    a = min(max(int(math.floor(start_s * rate)), 0), n_audio - 1)
    b = min(max(int(math.floor(end_s * rate)), a + 1), n_audio)
    return a, b


def voice_hits(
    keys: Callable[[int], np.ndarray],
    queries: Callable[[int], np.ndarray],
    n_layers: int,
    query_positions: np.ndarray,
    audio_positions: np.ndarray,
    token_query_positions: np.ndarray,
    spans: list[tuple[int, int]],
    top_k: int,
) -> np.ndarray:
    """Hit ratios (T, L, H_q) of Eq. 3 for answer tokens whose producing query sits at
    ``token_query_positions`` and whose word covers audio indices ``spans``.

    ``keys(l)`` gives (H_kv, N, D) and ``queries(l)`` (H_q, N_q, D) of layer ``l``."""
    rows = np.searchsorted(query_positions, token_query_positions)
    if not np.array_equal(query_positions[rows], token_query_positions):
        raise ValueError("a query needed for the voice score is not stored")
    n_audio = len(audio_positions)
    k = min(top_k, n_audio)
    inside = np.zeros((len(spans), n_audio), dtype=bool)
    for t, (a, b) in enumerate(spans):
        inside[t, a:b] = True
    out = []
    inside_t = torch.from_numpy(inside)
    for layer in range(n_layers):
        kk = torch.from_numpy(np.asarray(keys(layer)[:, audio_positions], dtype=np.float32))
        qq = torch.from_numpy(np.asarray(queries(layer)[:, rows], dtype=np.float32))
        g = qq.shape[0] // kk.shape[0]
        kk = kk.repeat_interleave(g, dim=0)  # q-head h uses kv-head h // g
        logits = qq @ kk.transpose(1, 2)  # (H_q, T, A); softmax is monotonic: same top-K
        top = logits.topk(k, dim=-1).indices  # (H_q, T, k)
        hit = inside_t[torch.arange(len(spans))[None, :, None], top].float().mean(-1)  # (H_q, T)
        out.append(hit.T.numpy())
    return np.stack(out, axis=1)  # (T, L, H_q)


def sample_voice_score(
    keys: Callable[[int], np.ndarray],
    queries: Callable[[int], np.ndarray],
    n_layers: int,
    query_positions: np.ndarray,
    audio_positions: np.ndarray,
    n_prefill: int,
    word_start_s: np.ndarray,
    word_end_s: np.ndarray,
    confidence: np.ndarray,
    rate: float,
    cfg: CalibrationConfig,
) -> np.ndarray | None:
    """Mean hit ratio (L, H_q) over the confidently aligned answer tokens of one sample, or None
    when no token qualifies. Arrays are per generated token j (at position n_prefill + j)."""
    conf = np.nan_to_num(np.asarray(confidence, dtype=float), nan=-1.0)
    ok = (conf >= cfg.min_confidence) & np.isfinite(word_start_s) & np.isfinite(word_end_s)
    js = np.flatnonzero(ok)
    if len(js) == 0 or len(audio_positions) == 0:
        return None
    spans = [word_span_tokens(word_start_s[j], word_end_s[j], rate, len(audio_positions))
             for j in js]
    hits = voice_hits(keys, queries, n_layers, query_positions, audio_positions,
                      n_prefill - 1 + js, spans, cfg.top_k or default_top_k(rate))
    return hits.mean(axis=0)


def trace_voice_score(trace: Any, cfg: CalibrationConfig) -> np.ndarray | None:
    """:func:`sample_voice_score` of a recorded trace (:class:`kvsim.trace.Trace`)."""
    pos = trace.positions
    n0 = trace.meta.n_prefill
    gen = pos.slice(n0, trace.meta.n_decode)
    conf = (gen["word_confidence"].to_numpy() if "word_confidence" in gen.columns
            else np.where(gen["word_start_s"].is_null().to_numpy(), np.nan, 1.0))
    return sample_voice_score(
        trace.keys, trace.queries, trace.meta.model.n_layers, trace.query_positions,
        trace.audio_positions, n0,
        gen["word_start_s"].to_numpy().astype(float), gen["word_end_s"].to_numpy().astype(float),
        np.asarray(conf, dtype=float), trace.meta.model.audio_tokens_per_s, cfg)


# ------------------------------------------------------------------------------- sensitivity
def answer_losses(backbone: Backbone, prepared: Prepared, answer: list[int],
                  key_hook: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                  ) -> torch.Tensor:
    """Teacher-forced cross-entropy of each answer token (T,) with an optional key hook."""
    dev = backbone.device
    ids = torch.tensor(np.concatenate([prepared.input_ids, np.asarray(answer, dtype=np.int64)]),
                       device=dev)[None]
    inputs = dict(prepared.inputs)
    inputs["input_ids"] = ids
    inputs["attention_mask"] = torch.ones_like(ids)
    rec = Recorder(backbone.facts().n_layers, 0, store_keys=False, key_hook=key_hook)
    with recording(rec):
        out = backbone.model(**inputs, use_cache=False)
    n0 = prepared.n_prompt
    logits = out.logits[0, n0 - 1: n0 - 1 + len(answer)]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.nn.functional.cross_entropy(logits, ids[0, n0:], reduction="none")


def key_gradients(backbone: Backbone, prepared: Prepared, answer: list[int],
                  steps: np.ndarray | None = None) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """Per answer token t (every one, or those in ``steps``): dL_t/dK for the audio keys of
    every layer, (H_kv, A, D) each. The whole answer is teacher-forced either way."""
    facts = backbone.facts()
    dev = backbone.device
    audio = torch.as_tensor(prepared.audio_positions, device=dev)
    dtype = next(backbone.model.parameters()).dtype
    deltas = [torch.zeros(1, facts.n_kv_heads, len(audio), facts.head_dim, device=dev,
                          dtype=dtype, requires_grad=True) for _ in range(facts.n_layers)]

    def hook(layer: int, key: torch.Tensor) -> torch.Tensor:
        return key.index_add(2, audio, deltas[layer].to(key.dtype))

    was = [p.requires_grad for p in backbone.model.parameters()]
    backbone.model.requires_grad_(False)
    try:
        with torch.enable_grad():
            losses = answer_losses(backbone, prepared, answer, hook)
            todo = [int(t) for t in (range(len(answer)) if steps is None else steps)]
            for i, t in enumerate(todo):
                grads = torch.autograd.grad(losses[t], deltas, retain_graph=i < len(todo) - 1)
                yield t, [g[0] if g.dtype == torch.float64 else g[0].float() for g in grads]
    finally:
        for p, w in zip(backbone.model.parameters(), was, strict=True):
            p.requires_grad_(w)


def token_sensitivity(grads: list[torch.Tensor]) -> np.ndarray:
    """mean_tau || dL_t / dK_{l,k,tau} || of one answer token from its per-layer key gradients
    (H_kv, A, D): (L, H_kv)."""
    return torch.stack([g.norm(dim=-1).mean(dim=-1) for g in grads]).cpu().numpy()


def sample_sensitivity(backbone: Backbone, prepared: Prepared, answer: list[int],
                       steps: np.ndarray | None = None) -> np.ndarray:
    """E_t[ mean_tau || dL_t / dK_{l,k,tau} || ] of one sample: (L, H_kv), over every answer
    token or those in ``steps`` (:func:`sensitivity_steps`)."""
    total = None
    n = 0
    for _, grads in key_gradients(backbone, prepared, answer, steps):
        per = token_sensitivity(grads)
        total = per if total is None else total + per
        n += 1
    if total is None:
        raise ValueError("no answer tokens to compute the sensitivity on")
    return total / n


# ------------------------------------------------------------------------------- aggregation
@dataclass
class ScoreAccumulator:
    """Averages per-sample scores over samples and folds q-heads into their GQA groups."""

    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    voice: list[np.ndarray] = field(default_factory=list)  #: (L, H_q) per sample
    sens: list[np.ndarray] = field(default_factory=list)  #: (L, H_kv) per sample

    def result(self, source: str) -> HeadScores:
        if not self.sens:
            raise ValueError("no calibration sample succeeded")
        g = self.n_q_heads // self.n_kv_heads
        if self.voice:
            hit = np.mean(self.voice, axis=0)
            vs = hit.reshape(self.n_layers, self.n_kv_heads, g).mean(-1)
        else:
            vs = np.zeros((self.n_layers, self.n_kv_heads))
        return HeadScores(vs, np.mean(self.sens, axis=0), source=source)

    def provenance(self, cfg: CalibrationConfig, rate: float) -> dict[str, Any]:
        scores = self.result("")
        return {"method": "WnW Appendix E", "top_k": cfg.top_k or default_top_k(rate),
                "min_confidence": cfg.min_confidence, "teacher": cfg.teacher,
                "max_tokens": cfg.max_tokens, "token_sample": cfg.token_sample,
                "n_samples_voice": len(self.voice),
                "n_samples_sensitivity": len(self.sens),
                "ranking_vs_x_hs": ranking(scores)}


def ranking(scores: HeadScores) -> list[list[int]]:
    """KV-heads as [layer, head], most important first by VS x HS (ties: by HS)."""
    imp = scores.importance.ravel()
    hs = scores.sensitivity.ravel()
    order = np.lexsort((-hs, -imp))
    n_kv = scores.voice_score.shape[1]
    return [[int(i // n_kv), int(i % n_kv)] for i in order]


def teacher_tokens(backbone: Backbone, generated: list[int], reference: str | None,
                   cfg: CalibrationConfig) -> list[int]:
    if cfg.teacher == "reference":
        if not reference:
            raise ValueError("--teacher reference needs a reference transcript")
        tok = backbone.tokenizer
        ids = tok.encode(reference, add_special_tokens=False)
        eos = sorted(backbone.eos_ids)
        tokens = list(ids) + eos[:1]
    else:
        tokens = list(generated)
    return tokens


def calibrate_into_traces(results: list, batch_cfg: Any, cfg: CalibrationConfig,
                          console: Any) -> HeadScores | None:
    """``kvsim trace --calibrate``: score heads over the batch's traces (VS from the recorded
    q/k, HS from a teacher-forced pass over each input), store the scores in every trace and in
    ``OUT/heads.json``."""
    from kvsim.trace import Trace, write_trace
    from kvsim.trace.heads import write_heads
    from kvsim.tracer.audio import load_audio
    from kvsim.tracer.traceio import load_trace_data

    good = [r for r in results if r.status != "failed" and r.trace is not None]
    if not good:
        return None
    tracer = None
    acc: ScoreAccumulator | None = None
    from kvsim.tracer.batch import Tracer

    tracer = Tracer(batch_cfg, console)
    bb = tracer.backbone
    used = []
    for r in good:
        trace = Trace(r.trace)
        m = trace.meta.model
        acc = acc or ScoreAccumulator(m.n_layers, m.n_q_heads, m.n_kv_heads)
        try:
            clip = load_audio(r.path, bb.sample_rate)
            prepared = bb.prepare(clip, batch_cfg.options.prompt)
            gen_tokens = trace.meta.provenance.get("generation", {}).get("token_ids") or []
            answer = teacher_tokens(bb, gen_tokens, trace.meta.reference_text, cfg)
            hs = sample_sensitivity(bb, prepared, answer, sensitivity_steps(len(answer), cfg))
        except (ValueError, OSError) as exc:
            console.print(f"[yellow]calibration skipped[/] {r.path}: {exc}")
            continue
        vs = trace_voice_score(trace, cfg)
        if vs is not None:
            acc.voice.append(vs)
        acc.sens.append(hs)
        used.append(r)
    if acc is None or not acc.sens:
        console.print("[yellow]no input could be used for calibration[/]")
        return None
    good = used
    scores = acc.result(f"kvsim trace --calibrate ({len(good)} inputs)")
    prov = acc.provenance(cfg, bb.audio_tokens_per_s)
    write_heads(Path(batch_cfg.out_dir) / "heads.json", scores, bb.name, prov)
    for r in good:
        data = load_trace_data(r.trace)
        data.head_scores = scores
        write_trace(r.trace, data)
    console.print(f"head scores over {len(good)} inputs -> {Path(batch_cfg.out_dir) / 'heads.json'}"
                  f" ({len(acc.voice)} with aligned tokens)")
    return scores


def store_head_scores(results: list, scores: HeadScores, console: Any) -> None:
    """``kvsim trace --heads FILE``: store held-out calibration scores in every trace written
    (checked against each trace's shape); says in how many, nothing when no trace was written."""
    stored = [r.trace for r in results if r.status != "failed" and r.trace is not None]
    for trace in stored:
        store_in_trace(trace, scores)
    if stored:
        console.print(f"stored head scores ({scores.source}) in {len(stored)} "
                      f"trace{'s' * (len(stored) != 1)}", markup=False)


def store_in_trace(trace: Path, scores: HeadScores) -> None:
    """Rewrite ``trace`` atomically with ``scores`` as its calibration (the tensors unchanged);
    ValueError (one line) when the shapes differ."""
    from kvsim.trace import Trace, write_trace
    from kvsim.tracer.traceio import load_trace_data

    m = Trace(trace).meta.model
    if scores.voice_score.shape != (m.n_layers, m.n_kv_heads):
        raise ValueError(f"calibration scores have shape {scores.voice_score.shape}, "
                         f"{trace} has (L, H_kv) = {(m.n_layers, m.n_kv_heads)}")
    data = load_trace_data(trace)
    data.head_scores = scores
    write_trace(trace, data)


@dataclass
class CalibrationRun:
    scores: HeadScores
    provenance: dict[str, Any]
    failures: list[tuple[Path, str]]
    n_ok: int


def calibrate_inputs(inputs: list[Path], batch_cfg: Any, cfg: CalibrationConfig,
                     console: Any) -> CalibrationRun:
    """``kvsim calibrate``: greedy decode each input with the recording attention, align the
    answer's words, accumulate VS (from the recorded q/k) and HS (teacher-forced gradients)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from kvsim.tracer.alignment import AlignmentError
    from kvsim.tracer.audio import AudioError, load_audio
    from kvsim.tracer.batch import Tracer
    from kvsim.tracer.run import generate_traced

    tracer = Tracer(batch_cfg, console)
    bb = tracer.backbone
    facts = bb.facts()
    rate = bb.audio_tokens_per_s
    acc = ScoreAccumulator(facts.n_layers, facts.n_q_heads, facts.n_kv_heads)
    failures: list[tuple[Path, str]] = []
    n_tokens = n_grad = 0
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=console) as progress:
        task = progress.add_task("calibrating", total=len(inputs))
        for audio in inputs:
            try:
                clip = load_audio(audio, bb.sample_rate)
                bb.check_length(clip, batch_cfg.options.max_new_tokens)
                align_file, reference = tracer.references(audio, len(inputs) == 1)
                prepared = bb.prepare(clip, batch_cfg.options.prompt)
                gen = generate_traced(bb, prepared, batch_cfg.options)
                alignment = tracer.align(clip, gen.tokens, align_file)
                if alignment is not None:
                    t = gen.tensors
                    vs = sample_voice_score(
                        lambda i, t=t: t["keys"][i].numpy(),
                        lambda i, t=t: t["queries"][i].numpy(),
                        facts.n_layers, gen.query_positions, prepared.audio_positions,
                        prepared.n_prompt, alignment.start_s, alignment.end_s,
                        alignment.confidence, rate, cfg)
                    if vs is not None:
                        acc.voice.append(vs)
                answer = teacher_tokens(bb, gen.tokens, reference, cfg)
                steps = sensitivity_steps(len(answer), cfg)
                acc.sens.append(sample_sensitivity(bb, prepared, answer, steps))
                n_tokens += len(answer)
                n_grad += len(steps)
            except (AudioError, AlignmentError, ValueError) as exc:
                failures.append((audio, str(exc)))
                console.print(f"[red]failed[/] {audio}: {exc}")
            progress.advance(task)
    scores = acc.result(f"kvsim calibrate ({len(acc.sens)} inputs)")
    prov = acc.provenance(cfg, rate)
    prov.update({"model_path": bb.path, "inputs": [str(p) for p in inputs],
                 "answer_tokens": n_tokens, "sensitivity_tokens": n_grad,
                 "aligner": batch_cfg.aligner})
    return CalibrationRun(scores, prov, failures, len(acc.sens))


# ------------------------------------------------------------------------------- merging
def merge_calibrations(files: list[Path]) -> tuple[HeadScores, dict[str, Any], str]:
    """One calibration from several ``kvsim calibrate`` outputs over disjoint inputs (shards
    run in parallel): VS and HS are means over samples, so each file's scores enter weighted
    by its sample counts (``n_samples_voice``, ``n_samples_sensitivity``), which gives the
    scores one run over all the inputs would give, up to float rounding.

    Returns ``(scores, provenance, model)``; ValueError (one line, naming the file) when the
    files disagree on the model, shape or settings, or lack the sample counts.
    """
    import json

    from kvsim.trace.heads import heads_from_json

    if not files:
        raise ValueError("no calibration files to merge")
    parts = []
    for f in files:
        raw = json.loads(Path(f).read_text())
        prov = raw.get("provenance") or {}
        for key in ("n_samples_voice", "n_samples_sensitivity"):
            if not isinstance(prov.get(key), int):
                raise ValueError(f"{f}: provenance.{key} missing: not a kvsim calibrate output")
        parts.append((Path(f), raw, prov, heads_from_json(raw, str(f))))
    first_raw, first_prov = parts[0][1], parts[0][2]
    settings = ("method", "top_k", "min_confidence", "teacher", "max_tokens", "token_sample")
    for f, raw, prov, _ in parts[1:]:
        if raw.get("model") != first_raw.get("model"):
            raise ValueError(f"{f}: model {raw.get('model')!r}, not {first_raw.get('model')!r}")
        for key in settings:
            if prov.get(key) != first_prov.get(key):
                raise ValueError(f"{f}: {key}={prov.get(key)!r}, not {first_prov.get(key)!r}")
    n_v = np.array([p[2]["n_samples_voice"] for p in parts], dtype=np.float64)
    n_s = np.array([p[2]["n_samples_sensitivity"] for p in parts], dtype=np.float64)
    vs = sum(w * p[3].voice_score for w, p in zip(n_v, parts, strict=True)) / max(n_v.sum(), 1.0)
    hs = sum(w * p[3].sensitivity for w, p in zip(n_s, parts, strict=True)) / n_s.sum()
    scores = HeadScores(np.asarray(vs), np.asarray(hs),
                        source=f"kvsim calibrate ({int(n_s.sum())} inputs, {len(parts)} shards)")
    prov = {key: first_prov.get(key) for key in settings}
    prov.update(n_samples_voice=int(n_v.sum()), n_samples_sensitivity=int(n_s.sum()),
                ranking_vs_x_hs=ranking(scores), merged_from=[str(p[0]) for p in parts])
    for key in ("inputs",):
        prov[key] = [x for p in parts for x in p[2].get(key, [])]
    for key in ("answer_tokens", "sensitivity_tokens", "wall_s"):
        if all(isinstance(p[2].get(key), int | float) for p in parts):
            prov[key] = sum(p[2][key] for p in parts)
    for key in ("model_path", "aligner"):
        prov[key] = first_prov.get(key)
    return scores, prov, str(first_raw.get("model"))
