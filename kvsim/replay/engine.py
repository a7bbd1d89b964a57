"""The replay engine: drive policies over a recorded trace and measure what they keep.

For every decode step and layer the engine computes the full attention once,
``P = softmax(q Kᵀ/√d)``, and derives from it, for every policy and budget replayed in the
same run, the attention the compressed model would compute: softmax restricted to the
non-audio positions plus the GPU-resident audio of each KV-head, which is ``P`` masked and
renormalised (exactly equal, since softmax over a subset is the renormalised restriction).
So several policies cost one ``q·Kᵀ`` per step and layer plus cheap masked reductions.

Replay is open loop: the queries are those recorded under the full cache. Live mode
(closed loop) lives in :mod:`tracer`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from kvsim.replay.attention import as_f32, causal_attention, gqa_logits, softmax_
from kvsim.replay.steplog import STEP_LOG_COLUMNS, RunFacts, retention_per_step
from kvsim.trace.reader import Trace
from policies import registry
from policies.base import (
    ArrayQueryView,
    ArrayStepQueryView,
    BufferStepView,
    HeadScores,
    MissingCalibrationError,
    Policy,
    PolicyContext,
    Tier,
)


class InvariantViolation(AssertionError):
    """A policy broke a rule of the protocol (DESIGN.md §The policy protocol)."""


@dataclass(frozen=True)
class PolicySpec:
    """One policy at one budget with hyperparameters."""

    name: str
    budget: float
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.params:
            return self.name
        inner = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.name}({inner})"

    def make(self) -> Policy:
        return registry.make(self.name, self.budget, **self.params)


@dataclass
class ReplayConfig:
    """How to replay.

    Parameters
    ----------
    topk : int
        K of the top-K Jaccard metric (clipped to T_a).
    error_stride : int
        Compute the attention-output error on every ``error_stride``-th step (needs values).
        It costs one ``P·V`` per policy, as much as the shared ``q·Kᵀ``, so by default it is
        sampled on every 16th step (an unbiased estimate of the per-step mean); 1 = every step.
    check_invariants : bool
        Check the protocol invariants at every step (cheap; on by default).
    record_tiers : bool
        Keep a copy of the tiers after prefill and after every step (small traces only).
    head_scores : HeadScores or None
        Calibration scores overriding those stored in the trace (``--calibration``).
    max_steps : int or None
        Replay only the first ``max_steps`` decode steps.
    seed : int
        Seed handed to policies (random control).
    """

    topk: int = 100
    error_stride: int = 16
    check_invariants: bool = True
    record_tiers: bool = False
    head_scores: HeadScores | None = None
    max_steps: int | None = None
    seed: int = 0


@dataclass
class RunResult:
    """Outcome of one (trace, policy, budget)."""

    trace: str
    spec: PolicySpec
    summary: dict[str, Any]
    step_log: pl.DataFrame
    facts: RunFacts
    per_head_recall: np.ndarray  #: (L, H_q) mean audio-mass recall over steps
    policy: Policy | None = None  #: the policy object after the run (for inspection)
    tiers: list[np.ndarray] | None = None


# ----------------------------------------------------------------------------- views
class WindowPrefillView:
    """The :class:`PrefillView` of replay and live decoding: full-model causal attention of the
    observation-window queries, restricted to the audio, computed once per layer and shared
    by every policy of the run."""

    def __init__(self, queries: Callable[[int], np.ndarray], keys: Sequence[np.ndarray],
                 window: np.ndarray, audio: np.ndarray) -> None:
        self._queries = queries  # layer -> (H_q, W, D) float32
        self._keys = keys  # per layer (H_kv, N, D) float32
        self._window = window
        self._audio = audio
        self._cache: dict[int, np.ndarray] = {}
        #: results shared by every policy prefilled on this view (see ``policies.base.shared``)
        self.memo: dict = {}

    @property
    def n_window(self) -> int:
        return len(self._window)

    def audio_attention(self, layer: int) -> np.ndarray:
        if layer not in self._cache:
            att = causal_attention(self._queries(layer), self._keys[layer], self._window)
            self._cache[layer] = np.ascontiguousarray(att[:, :, self._audio])
        return self._cache[layer]

    def audio_keys(self, layer: int) -> np.ndarray:
        return np.ascontiguousarray(self._keys[layer][:, self._audio])


# ----------------------------------------------------------------------------- run state
class _Run:
    """Mutable state of one policy during a replay."""

    def __init__(self, spec: PolicySpec, policy: Policy, ctx: PolicyContext) -> None:
        self.spec = spec
        self.policy = policy
        L, Hq = ctx.heads.n_layers, ctx.heads.n_q_heads
        self.tiers: np.ndarray | None = None
        self.gpu: np.ndarray | None = None  # (L, H_kv, T_a) bool
        self.buffer = (
            np.zeros((L, Hq, ctx.n_audio), dtype=np.float32) if policy.needs_step_attention else None
        )
        # metrics, filled from the engine's batched accumulators when the replay ends
        self.recall_sum = np.zeros((L, Hq))
        self.step_recall = np.zeros(0)
        self.step_jaccard = np.zeros(0)
        self.err_sum = 0.0
        self.err_n = 0
        # step log: one row per step of the per-run columns (_LOG_SCALARS) and per-layer
        # transfer counts, filled in place; the run-independent columns are added at the end
        self.log_scalars: np.ndarray = np.zeros((0, len(_LOG_SCALARS)), dtype=np.int64)
        self.log_layers: np.ndarray = np.zeros((0, 2, L), dtype=np.int64)
        self.history: list[np.ndarray] | None = None
        self.seconds = 0.0
        self.gpuf: np.ndarray | None = None  # (L, H_kv, T_a) float32, a slot of a shared array
        self.n_res: np.ndarray | None = None  # (L, H_kv) resident audio per KV-head

    def set_tiers(self, tiers: np.ndarray) -> None:
        """Adopt new tiers and refresh the derived GPU masks used in the inner loop."""
        self.tiers = tiers.copy()
        self.gpu = self.tiers == Tier.GPU
        if self.gpuf is None:
            self.gpuf = self.gpu.astype(np.float32)
        else:
            self.gpuf[...] = self.gpu
        if self.n_res is None:
            self.n_res = self.gpu.sum(-1)
        else:
            self.n_res[...] = self.gpu.sum(-1)
        self.n_gpu = int(self.n_res.sum())
        self.n_cpu = int(np.count_nonzero(self.tiers == Tier.CPU))

    def update_tiers(self, changed: np.ndarray, before: np.ndarray, after: np.ndarray) -> None:
        """:meth:`set_tiers` for new tiers that differ from the current ones only at the flat
        indices ``changed`` (``before`` -> ``after``): the derived arrays are patched there."""
        np.put(self.tiers, changed, after)  # in place, whatever the memory layout
        on_gpu = after == Tier.GPU
        np.put(self.gpu, changed, on_gpu)
        np.put(self.gpuf, changed, on_gpu)
        delta = on_gpu.astype(np.int64) - (before == Tier.GPU)
        row = changed // self.tiers.shape[-1]  # (layer, KV-head) of every change
        per_row = np.bincount(row, weights=delta, minlength=self.n_res.size)
        self.n_res += per_row.astype(np.int64).reshape(self.n_res.shape)
        self.n_gpu += int(delta.sum())
        self.n_cpu += int(np.count_nonzero(after == Tier.CPU) - np.count_nonzero(before == Tier.CPU))


#: step-log columns that differ between runs, in the order of ``_Run.log_scalars``
_LOG_SCALARS = ("gpu_audio_tokens", "cpu_audio_tokens", "read_audio_tokens", "h2d_tokens",
                "h2d_bytes", "h2d_transfers", "released_tokens")
_GPU, _CPU, _READ, _H2D, _H2D_BYTES, _TRANSFERS, _RELEASED = range(len(_LOG_SCALARS))


def check_tiers(name: str, tiers: np.ndarray, shape: tuple[int, ...]) -> None:
    """Shape, dtype and value checks on a tier array returned by a policy."""
    if not isinstance(tiers, np.ndarray) or tiers.shape != shape:
        got = getattr(tiers, "shape", type(tiers).__name__)
        raise InvariantViolation(f"{name}: tiers must be an array of shape {shape}, got {got}")
    if tiers.dtype != np.uint8:
        raise InvariantViolation(f"{name}: tiers dtype must be uint8, got {tiers.dtype}")
    if tiers.size and tiers.max() > Tier.GPU:
        raise InvariantViolation(f"{name}: tier values must be GONE/CPU/GPU (0/1/2)")


class Replayer:
    """Replays several policy specs over one trace, sharing the attention computation."""

    def __init__(self, trace: Trace, cfg: ReplayConfig | None = None) -> None:
        self.trace = trace
        self.cfg = cfg or ReplayConfig()
        meta = trace.meta
        self.heads = trace.head_layout
        self.audio = trace.audio_positions
        if len(self.audio) == 0:
            raise ValueError(f"{trace.path}: trace has no audio positions; nothing to compress")
        self.n_audio = len(self.audio)
        self.n_steps = meta.n_decode if self.cfg.max_steps is None else min(meta.n_decode, self.cfg.max_steps)
        self.keys32 = [as_f32(trace.keys(layer)) for layer in range(self.heads.n_layers)]
        self.values32 = (
            [as_f32(trace.values(layer)) for layer in range(self.heads.n_layers)]
            if meta.has_values else None
        )
        lo, hi = int(self.audio[0]), int(self.audio[-1]) + 1
        self.audio_index: slice | np.ndarray = (
            slice(lo, hi) if hi - lo == self.n_audio else self.audio
        )
        non_audio = np.ones(meta.n_positions, dtype=bool)
        non_audio[self.audio] = False
        self.non_audio = non_audio
        scores = self.cfg.head_scores if self.cfg.head_scores is not None else trace.head_scores
        self.ctx = PolicyContext(
            heads=self.heads,
            n_audio=self.n_audio,
            audio_tokens_per_s=meta.model.audio_tokens_per_s,
            n_prefill=meta.n_prefill,
            head_scores=scores,
            seed=self.cfg.seed,
        )
        self.dtype_bytes = np.dtype(meta.model.dtype).itemsize
        self.failures: list[tuple[PolicySpec, str]] = []

    # ------------------------------------------------------------------------- main loop
    def run(self, specs: list[PolicySpec]) -> list[RunResult]:
        cfg, ctx, heads = self.cfg, self.ctx, self.heads
        L, Hq, Hkv = heads.n_layers, heads.n_q_heads, heads.n_kv_heads
        g, Ta = heads.group, self.n_audio
        shape = (L, Hkv, Ta)
        runs = [_Run(s, s.make(), ctx) for s in specs]
        self.failures: list[tuple[PolicySpec, str]] = []

        window = self.trace.window_positions
        rows = np.array([self.trace.query_index(int(p)) for p in window], dtype=np.int64)
        prefill_view = WindowPrefillView(lambda layer: as_f32(self.trace.queries(layer)[:, rows]),
                                         self.keys32, window, self.audio)
        for run in list(runs):
            t0 = time.perf_counter()
            try:
                tiers = run.policy.prefill(ctx, prefill_view)
            except MissingCalibrationError as exc:
                # a policy that cannot run on this trace is reported; the others go on
                self.failures.append((run.spec, str(exc)))
                runs.remove(run)
                continue
            run.seconds += time.perf_counter() - t0
            check_tiers(run.spec.label, tiers, shape)
            run.set_tiers(tiers)
            self._check_capacity(run, -1)
            if cfg.record_tiers:
                run.history = [tiers.copy()]
        prefill_r = {id(r): float(r.gpu.mean()) for r in runs}

        k_top = min(cfg.topk, Ta)
        n_prefill = self.trace.meta.n_prefill
        ai = self.audio_index
        kv_of_q = np.arange(Hq)[:, None] // g  # (H_q, 1): KV-head read by each q-head
        # Every run's GPU mask lives in one array so that the metrics of all runs are computed
        # by a handful of batched numpy calls per layer and step, whatever the number of runs.
        # For a query-aware run the slot of a layer holds, during the step, what its select()
        # read there (written before use); its tiers live in run.tiers / run.gpu.
        R = len(runs)
        # Layer-major, so that what a layer reads of every run is one contiguous block.
        # slot R holds ones: the full audio mass comes out of the same product as every run's
        # kept mass (same kernel, same summation), so the recall of a full mask is exactly 1
        masks = np.zeros((L, R + 1, Hkv, Ta), dtype=np.float32)
        masks[:, R] = 1.0
        resident = np.zeros((L, R, Hkv), dtype=np.int64)
        for r, run in enumerate(runs):
            masks[:, r], resident[:, r] = run.gpuf, run.n_res
            run.gpuf, run.n_res = masks[:, r], resident[:, r]
            run.log_scalars = np.zeros((self.n_steps, len(_LOG_SCALARS)), dtype=np.int64)
            run.log_layers = np.zeros((self.n_steps, 2, L), dtype=np.int64)
        query_aware = [(r, run) for r, run in enumerate(runs) if run.policy.query_aware]
        # open loop: every layer's query of a step is known before the step, so the policies
        # that can select all layers at once do so (select_layers); the others per layer
        all_layers = [(r, run) for r, run in query_aware if run.policy.selects_all_layers]
        per_layer = [(r, run) for r, run in query_aware if not run.policy.selects_all_layers]
        qa_idx = np.array([r for r, _ in per_layer], dtype=np.int64)
        audio_keys = [k[:, self.audio_index] for k in self.keys32]
        # the step-attention buffers of all runs that read them, in one array (batched fill);
        # a layer is filled only for the runs that read it (step_attention_layers), the others
        # hold NaN so that reading one shows
        # (those that read every layer first, so that a layer they alone read is a slice)
        buffered = sorted((r for r, run in enumerate(runs) if run.buffer is not None),
                          key=lambda r: runs[r].policy.step_attention_layers() is not None)
        buffers = np.zeros((len(buffered), L, Hkv, g, Ta), dtype=np.float32)
        readers: list[list[int]] = [[] for _ in range(L)]  # per layer: buffers filled there
        for b, r in enumerate(buffered):
            runs[r].buffer = buffers[b].reshape(L, Hq, Ta)
            layers = runs[r].policy.step_attention_layers()
            for layer in range(L) if layers is None else sorted(set(layers)):
                readers[layer].append(b)
        fill: list[tuple[list[int], list[int] | slice]] = []  # per layer: runs, buffer rows
        for layer in range(L):
            rows = readers[layer]
            buffers[[b for b in range(len(buffered)) if b not in rows], layer] = np.nan
            fill.append(([buffered[b] for b in rows],
                         slice(0, len(rows)) if rows == list(range(len(rows))) else rows))
        # query-aware runs: per step, the layers whose select() returned a mask (checked)
        checked = np.zeros((R, L), dtype=bool)
        read_log = np.zeros((R, self.n_steps), dtype=np.int64)
        # runs whose tiers may change after prefill (or are recorded): _end_step every step
        stepping = [run for run in runs if run.policy.query_aware or run.history is not None
                    or type(run.policy).decode_step is not Policy.decode_step]
        recall_sum = np.zeros((R, L, Hq))
        step_recall = np.zeros((R, self.n_steps))
        step_jaccard = np.zeros((R, self.n_steps))
        err_sum = np.zeros(R)
        err_n = 0
        # left operand of the one product per layer and step that gives every run's kept mass
        # and top-K hits: rows [0, g) of KV-head k hold its q-heads' audio attention, rows
        # [g, 2g) the one-hot of their top-K positions
        lhs = np.zeros((Hkv, 2 * g, Ta), dtype=np.float32)
        lhs_att, lhs_top = lhs[:, :g], lhs[:, g:]
        top_row = (g + np.arange(Hq) % g)[:, None]  # row of each q-head in the one-hot half
        for s in range(self.n_steps):
            p = n_prefill + s
            qrow = self.trace.query_index(p)
            want_err = self.values32 is not None and s % cfg.error_stride == 0
            na = self.non_audio[: p + 1]
            read = np.zeros(R, dtype=np.int64)
            queries = [as_f32(self.trace.queries(layer)[:, qrow]) for layer in range(L)]
            if all_layers:
                self._select_all(all_layers, s, queries, audio_keys, masks, resident, checked)
            for layer in range(L):
                q = queries[layer]
                P = softmax_(gqa_logits(q, self.keys32[layer][:, : p + 1]))  # (H_q, p+1)
                Pa3 = P[:, ai].reshape(Hkv, g, Ta)  # a view when the audio is contiguous
                M1 = masks[layer]  # (R + 1, H_kv, T_a), a contiguous view; M1[R] is all ones
                M = M1[:R]
                n_res = resident[layer]  # (R, H_kv)
                if per_layer:
                    self._select(per_layer, qa_idx, s, layer, q, M, n_res, checked)
                read += n_res.sum(-1)
                # kept audio mass and top-K hits of every run and q-head, and the full audio
                # mass (slot R): one (2g, T_a) x (T_a, R + 1) product per KV-head.
                # The top-K Jaccard: the compressed ranking is the full one restricted to the
                # resident set, so |top_full ∩ top_comp| = resident hits of top_full (sums of
                # 0/1, exact in float32).
                lhs_att[...] = Pa3
                if k_top < Ta:
                    top = np.argpartition(-Pa3.reshape(Hq, Ta), k_top - 1, axis=-1)[:, :k_top]
                    lhs_top.fill(0.0)
                    lhs[kv_of_q, top_row, top] = 1.0
                prod = np.matmul(lhs, M1.transpose(1, 2, 0))  # (H_kv, 2g, R + 1)
                mass = prod[:, :g].reshape(Hq, R + 1).T
                mass_a = mass[R]
                n_res_q = n_res[:, kv_of_q[:, 0]]  # (R, H_q)
                # a run that keeps every audio position of a KV-head computes the full model
                # there: its kept mass IS the full mass and its normaliser is 1, by
                # construction (a matmul's rows may round differently on another CPU)
                whole = n_res_q == Ta
                mass_k = np.where(whole, mass_a, mass[:R])
                with np.errstate(invalid="ignore", divide="ignore"):
                    recall = np.where(mass_a > 0, mass_k / mass_a, 1.0)
                recall_sum[:, layer] += recall
                step_recall[:, s] += recall.mean(-1)
                # (R, H_q) softmax normaliser of the compressed model
                z = np.where(whole, np.float32(1.0), 1.0 - mass_a + mass_k)
                fill_runs, fill_rows = fill[layer]
                if fill_runs:
                    slot = isinstance(fill_rows, slice)  # then computed in place
                    kept = np.multiply(Pa3, M[fill_runs][:, :, None, :],  # (n, H_kv, g, T_a)
                                       out=buffers[fill_rows, layer] if slot else None)
                    kept /= z[fill_runs].reshape(len(fill_runs), Hkv, g, 1)
                    if not slot:
                        buffers[fill_rows, layer] = kept
                hits = prod[:, g:, :R].reshape(Hq, R).T if k_top < Ta else n_res_q
                kc = np.minimum(k_top, n_res_q)
                step_jaccard[:, s] += (hits / np.maximum(k_top + kc - hits, 1)).mean(-1)
                if want_err:
                    V = self.values32[layer]
                    Va = V[:, ai]  # (H_kv, T_a, D)
                    out_na = np.matmul(P[:, na].reshape(Hkv, g, -1), V[:, : p + 1][:, na])
                    # kept attention of every run and of the full mask (slot R), KV-head-major
                    # so that each KV-head's output for all of them is one
                    # ((R + 1)·g, T_a) x (T_a, D) product: a full mask's error is exactly 0
                    kept = Pa3[:, None] * M1.transpose(1, 0, 2)[:, :, None, :]  # (H_kv, R+1, g, T_a)
                    out_k = np.matmul(kept.reshape(Hkv, (R + 1) * g, Ta), Va)
                    out_all = out_na[None] + out_k.reshape(Hkv, R + 1, g, -1).transpose(1, 0, 2, 3)
                    out_full = out_all[R].reshape(Hq, -1)
                    norm_full = np.maximum(np.linalg.norm(out_full, axis=-1), 1e-30)
                    out_c = out_all[:R].reshape(R, Hq, -1) / z[..., None]
                    out_c = np.where(whole[..., None], out_full, out_c)  # exact, as above
                    err_sum += (np.linalg.norm(out_c - out_full, axis=-1) / norm_full).mean(-1)
            if want_err:
                err_n += L
            if query_aware and cfg.check_invariants:
                self._check_reads(query_aware, masks, checked, s)
            read_log[:, s] = read
            for run in stepping:
                self._end_step(run, s)

        for r, run in enumerate(runs):
            run.log_scalars[:, _READ] = read_log[r]
            if run not in stepping:  # tiers never change: the prefill counts at every step
                run.log_scalars[:, _GPU], run.log_scalars[:, _CPU] = run.n_gpu, run.n_cpu
            run.recall_sum = recall_sum[r]
            run.step_recall = step_recall[r]
            run.step_jaccard = step_jaccard[r]
            run.err_sum, run.err_n = float(err_sum[r]), err_n
        return [self._finish(run, prefill_r[id(run)]) for run in runs]

    def _select(self, query_aware: list[tuple[int, _Run]], qa_idx: np.ndarray, s: int,
                layer: int, q: np.ndarray, M: np.ndarray, n_res: np.ndarray,
                checked: np.ndarray) -> None:
        """Call every query-aware run's ``select`` for this layer; write what each reads into
        its slot of ``M`` (R, H_kv, T_a) and ``n_res`` (R, H_kv)."""
        qview = ArrayQueryView(s, layer, q, self.keys32[layer][:, self.audio_index], memo={})
        for r, run in query_aware:
            t0 = time.perf_counter()
            sel = run.policy.select(qview)
            run.seconds += time.perf_counter() - t0
            # None: it reads every GPU-resident position of its tiers before the step
            M[r] = run.gpu[layer] if sel is None else sel
            checked[r, layer] = sel is not None
        n_res[qa_idx] = M[qa_idx].sum(-1)

    def _select_all(self, runs: list[tuple[int, _Run]], s: int, queries: list[np.ndarray],
                    audio_keys: list[np.ndarray], masks: np.ndarray, resident: np.ndarray,
                    checked: np.ndarray) -> None:
        """``select_layers`` of the runs that select every layer of step ``s`` at once: what
        each reads at every layer goes to its slots of ``masks`` and ``resident``."""
        view = ArrayStepQueryView(s, np.stack(queries), audio_keys, memo={})
        for r, run in runs:
            t0 = time.perf_counter()
            reads = run.policy.select_layers(view)
            run.seconds += time.perf_counter() - t0
            masks[:, r] = run.gpu if reads is None else reads
            resident[:, r] = masks[:, r].sum(-1)
            checked[r] = reads is not None

    def _check_reads(self, query_aware: list[tuple[int, _Run]], masks: np.ndarray,
                     checked: np.ndarray, s: int) -> None:
        """Every position a ``select`` read at step ``s`` was on GPU at that layer.

        Checked once per step against the tiers after the step: ``select`` of a layer changes
        only that layer's tiers (protocol), so they are the tiers it left at its layer.
        """
        for r, run in query_aware:
            cur = run.policy.current_tiers()
            if cur is None and run.n_gpu == run.tiers.size:
                continue  # every position on GPU (Quest): nothing can be read off GPU
            tiers = run.tiers if cur is None else cur
            off_gpu = ((masks[:, r] != 0) & (tiers != Tier.GPU)).any(axis=-1).any(axis=-1)
            off_gpu &= checked[r]
            if off_gpu.any():
                raise InvariantViolation(
                    f"{run.spec.label}: select() read audio that is not on GPU "
                    f"(step {s}, layer {int(np.flatnonzero(off_gpu)[0])})")

    # ------------------------------------------------------------------------- per step
    def _end_step(self, run: _Run, s: int) -> None:
        cfg = self.cfg
        prev = run.tiers
        t0 = time.perf_counter()
        if run.policy.query_aware:
            new = run.policy.current_tiers()
        else:
            new = run.policy.decode_step(BufferStepView(s, run.buffer))
        run.seconds += time.perf_counter() - t0
        log = run.log_scalars[s]
        if not (new is None or new is prev and not run.policy.query_aware):
            check_tiers(run.spec.label, new, prev.shape)
            # only the positions that changed tier matter: the rest cannot break an invariant,
            # move, or change a count
            changed = np.flatnonzero(prev != new)
            if changed.size:
                before, after = prev.ravel()[changed], new.ravel()[changed]
                if cfg.check_invariants and ((before == Tier.GONE) & (after != Tier.GONE)).any():
                    raise InvariantViolation(
                        f"{run.spec.label}: a GONE position came back at step {s} "
                        "(GONE is absorbing)")
                self._count_transfers(run, s, changed, before, after)
                run.update_tiers(changed, before, after)
                self._check_capacity(run, s)
        log[_GPU] = run.n_gpu
        log[_CPU] = run.n_cpu
        if run.history is not None:
            run.history.append(run.tiers.copy())

    def _count_transfers(self, run: _Run, s: int, changed: np.ndarray, before: np.ndarray,
                         after: np.ndarray) -> None:
        """Step-log transfer columns from the positions (flat indices, ascending) that changed
        tier: CPU→GPU recalls per layer, their contiguous runs along the audio of each
        (layer, KV-head) row, and the positions leaving GPU."""
        n_audio, L = self.n_audio, self.heads.n_layers
        per_layer = self.heads.n_kv_heads * n_audio
        recalled = changed[(before == Tier.CPU) & (after == Tier.GPU)]
        layer_of = recalled // per_layer
        # a recalled position starts a run at the start of its row or after a gap
        starts = np.ones(recalled.size, dtype=bool)
        starts[1:] = np.diff(recalled) != 1
        starts |= recalled % n_audio == 0
        by_layer = run.log_layers[s]
        by_layer[0] = np.bincount(layer_of, minlength=L)
        by_layer[1] = np.bincount(layer_of[starts], minlength=L)
        log = run.log_scalars[s]
        log[_H2D] = recalled.size
        log[_H2D_BYTES] = recalled.size * 2 * self.heads.head_dim * self.dtype_bytes
        log[_TRANSFERS] = np.count_nonzero(starts)
        log[_RELEASED] = np.count_nonzero((before == Tier.GPU) & (after != Tier.GPU))

    def _check_capacity(self, run: _Run, s: int) -> None:
        cap = run.policy.gpu_capacity()
        if cap is not None and self.cfg.check_invariants:
            n = run.n_gpu
            if n > cap:
                raise InvariantViolation(
                    f"{run.spec.label}: {n} GPU audio tokens exceed its capacity {cap} at step {s}")

    def _finish(self, run: _Run, prefill_r: float) -> RunResult:
        ctx, L, Hq = self.ctx, self.heads.n_layers, self.heads.n_q_heads
        n = max(self.n_steps, 1)
        context = self.trace.meta.n_prefill + np.arange(self.n_steps, dtype=np.int64) + 1
        arrays: dict[str, np.ndarray] = {
            "step": np.arange(self.n_steps, dtype=np.int64),
            "context_tokens": context,
            "non_audio_tokens": context - self.n_audio,
            "h2d_tokens_by_layer": run.log_layers[:, 0],
            "h2d_transfers_by_layer": run.log_layers[:, 1],
        }
        arrays.update({name: run.log_scalars[:, i] for i, name in enumerate(_LOG_SCALARS)})
        columns = []
        for name, dtype in STEP_LOG_COLUMNS.items():
            col = pl.Series(name, np.ascontiguousarray(arrays[name]))
            columns.append(col if col.dtype == dtype else col.cast(dtype))
        log = pl.DataFrame(columns)
        gpu, cpu, read = retention_per_step(log, ctx.audio_kv_total, prefill_r)
        saves = run.policy.saves_capacity
        summary = {
            "trace": self.trace.name,
            "policy": run.spec.name,
            "label": run.spec.label,
            "budget": run.spec.budget,
            "steps": self.n_steps,
            "n_audio": self.n_audio,
            "r_gpu": float(gpu.mean()),
            "r_gpu_max": float(gpu.max()),
            "r_gpu_prefill": prefill_r,
            "r_gpu_cpu": float((gpu + cpu).mean()),
            "read_fraction": float(read.mean()),
            "saves_capacity": saves,
            "attn_recall": float(run.step_recall.sum() / (n * L)),
            "attn_recall_min_step": float((run.step_recall / L).min()) if self.n_steps else 1.0,
            "topk_jaccard": float(run.step_jaccard.sum() / (n * L)),
            "output_error": run.err_sum / run.err_n if run.err_n else float("nan"),
            "h2d_mb_per_step": float(log["h2d_bytes"].mean() / 1e6) if log.height else 0.0,
            "transfers_per_step": float(log["h2d_transfers"].mean()) if log.height else 0.0,
            "policy_seconds": run.seconds,
        }
        facts = RunFacts(
            model=self.trace.meta.model.name, n_layers=L, n_q_heads=Hq,
            n_kv_heads=self.heads.n_kv_heads, head_dim=self.heads.head_dim,
            dtype_bytes=self.dtype_bytes, n_audio=self.n_audio,
            n_prefill=self.trace.meta.n_prefill, n_decode=self.n_steps,
            policy=run.spec.label, budget=run.spec.budget,
            audio_tokens_per_s=self.trace.meta.model.audio_tokens_per_s,
        )
        return RunResult(
            trace=self.trace.name, spec=run.spec, summary=summary, step_log=log, facts=facts,
            per_head_recall=run.recall_sum / n, policy=run.policy, tiers=run.history,
        )


def replay_trace(trace: Trace, specs: list[PolicySpec], cfg: ReplayConfig | None = None) -> list[RunResult]:
    """Replay ``specs`` over ``trace`` in one pass; see :class:`Replayer`."""
    return Replayer(trace, cfg).run(specs)
