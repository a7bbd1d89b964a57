"""The live WER-vs-r_GPU table (WnW App. A, Table 5) on minivox.

Every method decodes each clip live with its KV policy inside the model (closed loop); the
table gives the truncated WER (WnW §3.5, ratio 1.2) per method and target r_GPU in the
paper's layout, the measured r_GPU / r_GPU+CPU of WnW as its bottom rows, beside the paper's
Voxtral-mini-3b and Qwen2.5-Omni-3B test-clean numbers; a second table gives every method's
measured retention and termination rate.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from kvsim.decoding.cycle_ban import CycleBanConfig
from kvsim.decoding.read_window import ReadWindowConfig
from kvsim.live.decode import LiveConfig
from kvsim.live.run import PlanItem, aggregate, make_plan, wer_chart, with_method
from kvsim.minivox import SHIPPED_HEADS
from kvsim.studies.live_grid import GridSpec
from kvsim.studies.report import StudyReport

#: The paper's target r_GPU columns, in its order.
PAPER_BUDGETS = (0.8, 0.6, 0.4, 0.2)

# WnW App. A, Table 5: truncated WER (%) at r_GPU = 0.8, 0.6, 0.4, 0.2 (Full Cache: one value).
#: Table 5, block "Backbone: Voxtral-mini-3b", test-clean columns.
PAPER_VOXTRAL_TEST_CLEAN = {
    "full": (6.79,), "adakv": (137.46, 175.85, 196.01, 199.24),
    "audiokv": (6.79, 6.31, 62.51, 192.58), "arkvale": (6.81, 6.77, 7.12, 11.74),
    "wnw": (6.72, 6.71, 6.64, 6.23)}
#: Table 5, block "Backbone: Voxtral-mini-3b", test-other columns.
PAPER_VOXTRAL_TEST_OTHER = {
    "full": (8.86,), "adakv": (144.01, 181.15, 192.60, 198.55),
    "audiokv": (8.85, 8.98, 66.42, 195.53), "arkvale": (8.83, 8.85, 9.79, 14.75),
    "wnw": (8.84, 8.84, 8.81, 8.87)}
#: Table 5, block "Backbone: Qwen2.5-Omni-3B", test-clean columns.
PAPER_QWEN_TEST_CLEAN = {
    "full": (13.87,), "adakv": (47.45, 91.12, 109.49, 116.04),
    "audiokv": (14.24, 14.54, 28.31, 131.30), "arkvale": (14.06, 14.13, 14.12, 16.99),
    "wnw": (14.72, 14.90, 14.88, 15.31)}
#: Table 5, block "Backbone: Qwen2.5-Omni-3B", test-other columns.
PAPER_QWEN_TEST_OTHER = {
    "full": (16.80,), "adakv": (52.92, 98.70, 115.53, 119.86),
    "audiokv": (17.62, 17.58, 34.16, 128.27), "arkvale": (16.88, 16.95, 17.11, 21.16),
    "wnw": (17.80, 17.77, 17.84, 18.42)}
#: Table 5, bottom rows "WnW r_GPU (%)" and "WnW r_GPU+CPU (%)" of each block and split.
PAPER_WNW_RETENTION = {
    ("Voxtral-mini-3b", "test-clean"): ((79.79, 59.96, 40.91, 22.25), (79.79, 59.96, 40.91, 41.52)),
    ("Voxtral-mini-3b", "test-other"): ((79.82, 59.98, 40.93, 22.38), (79.82, 59.98, 40.93, 41.64)),
    ("Qwen2.5-Omni-3B", "test-clean"): ((80.26, 60.12, 40.23, 21.78), (80.26, 60.12, 40.23, 41.81)),
    ("Qwen2.5-Omni-3B", "test-other"): ((80.31, 60.17, 40.28, 22.00), (80.31, 60.17, 40.28, 42.03)),
}
PAPER_WER = {("Voxtral-mini-3b", "test-clean"): PAPER_VOXTRAL_TEST_CLEAN,
             ("Voxtral-mini-3b", "test-other"): PAPER_VOXTRAL_TEST_OTHER,
             ("Qwen2.5-Omni-3B", "test-clean"): PAPER_QWEN_TEST_CLEAN,
             ("Qwen2.5-Omni-3B", "test-other"): PAPER_QWEN_TEST_OTHER}
#: kvsim policy name -> the paper's row name.
PAPER_NAMES = {"full": "Full Cache", "adakv": "Ada-KV", "audiokv": "AudioKV", "arkvale": "ArkVale",
               "wnw": "WnW"}

#: The methods of the study (WnW is added per budget, with its λ, by the caller).
DEFAULT_METHODS = ("full", "wnw", "snapkv", "adakv", "audiokv", "arkvale", "voxzip", "streaming",
                   "voxzip1/voxzip", "affpool/full")
DEFAULT_BUDGETS = (0.2, 0.4, 0.6, 0.8)


@dataclass
class Table5Info:
    """What the notes say about how the runs were made."""

    inputs: list[str]
    lambdas: dict[float, float | None] = field(default_factory=dict)  #: budget -> λ (None: per input)
    sources: dict[str, str] = field(default_factory=dict)  #: input -> run folder(s) read
    decoded: list[str] = field(default_factory=list)  #: methods decoded by this study
    split: str = "test_30_60"
    model: str = "minivox"
    max_seconds: float | None = None  #: clips (and references) cropped to this length
    lambda_fit: str = "measured"  #: how ``lambdas`` were fitted (measured | prefill)
    max_new_tokens: int | None = None  #: the token cap of the runs
    decoding_options: dict[str, str] = field(default_factory=dict)  #: those on (LiveConfig.decoding_options)


def run_lambdas(runs: pl.DataFrame) -> dict[float, float | None]:
    """budget -> the λ WnW's runs carry in their labels (``wnw:lam=...``); empty without."""
    if "label" not in runs.columns:
        return {}
    out: dict[float, float | None] = {}
    for label, budget in runs.select("label", "budget").unique().iter_rows():
        m = re.search(r"^wnw\b.*?lam=([0-9.eE+-]+)", label)
        if m:
            out[float(budget)] = float(m.group(1))
    return out


def table5_plan(methods: Sequence[str], budgets: Sequence[float],
                wnw: Sequence[PlanItem] = ()) -> list[PlanItem]:
    """The plan: every method of ``methods`` but plain ``wnw`` through ``make_plan`` (crossing
    budgets), then ``wnw`` (one item per budget, each with its own λ: :mod:`.wnw_lambda`)."""
    others = [m for m in methods if m != "wnw"]
    return [*(make_plan(others, budgets) if others else []), *wnw]


def missing_groups(plan: Sequence[PlanItem], runs: pl.DataFrame | None,
                   inputs: Sequence[str]) -> list[tuple[list[PlanItem], list[str]]]:
    """What ``runs`` lacks: (plan items, the inputs lacking exactly those), inputs grouped by
    what they lack, in input order; empty when ``runs`` holds the whole plan."""
    have = set() if runs is None else {
        (r[0], r[1], r[2], float(r[3])) for r in runs.select("input", "transform", "label", "budget").iter_rows()}
    groups: dict[tuple, tuple[list[PlanItem], list[str]]] = {}
    for i in inputs:
        lack = [p for p in plan if (i, p.transform, p.spec.label, float(p.spec.budget)) not in have]
        if lack:  # keyed by what is lacking (a spec's parameters are a dict: not hashable)
            key = tuple((p.transform, p.spec.label, p.spec.budget) for p in lack)
            groups.setdefault(key, (lack, []))[1].append(i)
    return list(groups.values())


def decode_missing(runs: pl.DataFrame | None, groups, items: Sequence, cfg: Table5Config, scores,
                   out: Path, log: Callable[[str], None]) -> pl.DataFrame:
    """Decode each group of :func:`missing_groups` with :func:`live_grid` (``out/live-table5``,
    or ``out/live-table5-<n>`` for the n-th of several groups: each a run folder a later call
    reuses) and add its runs to ``runs``."""
    from kvsim.studies.live_grid import live_grid, study_live_folder

    live_cfg = cfg.live_config(scores)
    by_id = {i.id: i for i in items}
    for n, (plan, ids) in enumerate(groups, start=1):
        folder = study_live_folder(out, "table5" if len(groups) == 1 else f"table5-{n}")
        fresh = live_grid([by_id[i] for i in ids], plan, live_cfg, folder, cfg.grid, log=log,
                          max_seconds=cfg.max_seconds)
        runs = fresh if runs is None else pl.concat([runs, fresh], how="diagonal_relaxed")
    return runs


_LAM = re.compile(r"lam=[^,)]*,?")


def method_names(results: pl.DataFrame) -> pl.DataFrame:
    """``results`` with ``label`` rid of WnW's per-budget ``lam=...`` (λ is part of the method's
    calibration, one per budget, not a different method) and the ``method`` column added;
    labels are kept when that would merge two methods."""
    stripped = results.with_columns(
        pl.col("label").str.replace(_LAM.pattern, "").str.replace(r"\(\)$", "").str.replace(r",\)$", ")"))
    if stripped.select("transform", "label", "budget").is_duplicated().any():
        stripped = results
    return with_method(stripped)


def _cell(rows: pl.DataFrame, method: str, budget: float, col: str) -> float | None:
    hit = rows.filter((pl.col("method") == method) & ((pl.col("budget") - budget).abs() < 1e-9))
    return None if hit.height == 0 or hit[col][0] is None else float(hit[col][0])


def _single_budget(results: pl.DataFrame, method: str) -> bool:
    return set(results.filter(pl.col("method") == method)["budget"].to_list()) == {1.0}


def wer_table(results: pl.DataFrame, budgets: Sequence[float], model: str = "minivox") -> pl.DataFrame:
    """Methods × r: kvsim's truncated WER (%) beside the paper's test-clean rows, WnW's
    measured r_GPU and r_GPU+CPU (%) as the bottom rows (the paper's layout); cells are
    percentages to two places as the paper prints them (``table5.parquet`` has every digit)."""
    cols = sorted(budgets, reverse=True)
    methods = results["method"].unique(maintain_order=True).to_list()
    methods += [m for m in PAPER_NAMES if m not in methods]
    rows = []
    for m in methods:
        single = _single_budget(results, m) or m == "full"
        kv = [_cell(results, m, 1.0 if single else b, "wer") for b in cols]
        kv = [None if v is None else 100 * v for v in kv]
        if single:
            kv = [kv[0]] + [None] * (len(cols) - 1)
        rows.append([PAPER_NAMES.get(m, m), *kv, *_paper_row(m, "Voxtral-mini-3b"),
                     *_paper_row(m, "Qwen2.5-Omni-3B")])
    wnw = results.filter(pl.col("method") == "wnw")
    for i, (name, col) in enumerate((("WnW r_GPU (%)", "r_gpu_vs_original"), ("WnW r_GPU+CPU (%)", "r_gpu_cpu"))):
        kv = [_cell(wnw, "wnw", b, col) for b in cols]
        rows.append([name, *[None if v is None else 100 * v for v in kv],
                     *PAPER_WNW_RETENTION[("Voxtral-mini-3b", "test-clean")][i],
                     *PAPER_WNW_RETENTION[("Qwen2.5-Omni-3B", "test-clean")][i]])
    names = (["method"] + [f"{model} r={b:g}" for b in cols]
             + [f"Voxtral-mini-3b r={b:g} (paper)" for b in PAPER_BUDGETS]
             + [f"Qwen2.5-Omni-3B r={b:g} (paper)" for b in PAPER_BUDGETS])
    cells = [[row[0], *(None if v is None else f"{v:.2f}" for v in row[1:])] for row in rows]
    return pl.DataFrame(cells, schema={n: pl.Utf8 for n in names}, orient="row")


def _paper_row(method: str, backbone: str) -> list[float | None]:
    values = PAPER_WER[(backbone, "test-clean")].get(method)
    if values is None:
        return [None] * len(PAPER_BUDGETS)
    return [*values, *[None] * (len(PAPER_BUDGETS) - len(values))]


def retention_table(results: pl.DataFrame, budgets: Sequence[float]) -> pl.DataFrame:
    """Methods × r: measured r_GPU / r_GPU+CPU (against the untransformed audio) and the
    termination rate, as ``0.20 / 0.40, 100%``."""
    cols = sorted(budgets, reverse=True)
    rows = []
    for m in results["method"].unique(maintain_order=True).to_list():
        single = _single_budget(results, m)
        cells = []
        for b in cols:
            hit = results.filter((pl.col("method") == m) & ((pl.col("budget") - (1.0 if single else b)).abs() < 1e-9))
            cells.append(None if hit.height == 0 or (single and b != cols[0]) else
                         f"{hit['r_gpu_vs_original'][0]:.2f} / {hit['r_gpu_cpu'][0]:.2f}, "
                         f"{hit['termination_rate'][0]:.0%}")
        rows.append([PAPER_NAMES.get(m, m), *cells])
    return pl.DataFrame(rows, schema=["method", *[f"r={b:g}" for b in cols]], orient="row")


def paper_frame() -> pl.DataFrame:
    """The paper's Table 5 in long form (backbone, split, row, budget, value %)."""
    rows = []
    for (backbone, split), table in PAPER_WER.items():
        for method, values in table.items():
            rows += [(backbone, split, PAPER_NAMES[method], b, v) for b, v in zip(PAPER_BUDGETS, values, strict=False)]
        for name, values in zip(("WnW r_GPU", "WnW r_GPU+CPU"), PAPER_WNW_RETENTION[(backbone, split)], strict=True):
            rows += [(backbone, split, name, b, v) for b, v in zip(PAPER_BUDGETS, values, strict=False)]
    return pl.DataFrame(rows, schema=["backbone", "split", "row", "budget", "percent"], orient="row")


def table5_report(runs: pl.DataFrame, budgets: Sequence[float], info: Table5Info) -> StudyReport:
    """The report of the runs ``runs`` (one row per input × method)."""
    results = method_names(aggregate(runs))
    chart = wer_chart(results, "minivox live: truncated WER vs measured r_GPU (WnW Table 5 analogue)")
    return StudyReport(
        name="table5", title=f"Live WER vs r_GPU on minivox {info.split} (WnW App. A, Table 5)",
        tables=[("Truncated WER (%, ratio 1.2): kvsim on minivox beside the paper's test-clean "
                 "rows; the bottom rows are WnW's measured r_GPU and r_GPU+CPU (%).",
                 wer_table(results, budgets, info.model)),
                ("Measured r_GPU / r_GPU+CPU (audio KV against the untransformed audio) and "
                 "termination rate, every method (kvsim on minivox).", retention_table(results, budgets))],
        data=results, chart=chart, notes=table5_notes(runs, info),
        extra_data={"runs": runs, "paper": paper_frame()})


def table5_notes(runs: pl.DataFrame, info: Table5Info) -> list[str]:
    """What was run, how WnW's λ was set, where the runs came from, how to read the tables."""
    fitted = bool(info.lambdas) and all(v is not None for v in info.lambdas.values())
    lam = info.lambdas if fitted else (run_lambdas(runs) or info.lambdas)
    if lam and all(v is not None for v in lam.values()):
        how = {"measured": "WnW §3.4: the largest λ whose mean measured r_GPU, recalls included, "
                           "is at most the target",
               "prefill": "the prefill fit: the largest λ whose mean prefill r_GPU is at most "
                          "the target"}
        source = (f"fitted per target on the calibration traces ({how[info.lambda_fit]})"
                  if fitted else "as recorded in the WnW runs' policy labels")
        lam_note = (f"WnW's λ per target, {source}: "
                    + ", ".join(f"r = {b:g}: λ = {v:.6g}" for b, v in sorted(lam.items())) + ".")
    else:
        lam_note = ("WnW's λ was fitted on each input itself (no calibration traces were given): "
                    "a per-input λ, not the paper's calibration-set λ, which keeps every clip's "
                    "prefill r_GPU at the target.")
    crop = f", each cropped to its first {info.max_seconds:g} s" if info.max_seconds else ""
    notes = [f"{runs.height} live runs over {len(info.inputs)} {info.model} {info.split} clips "
             f"({', '.join(info.inputs)}{crop}): greedy decoding with each policy inside the model; "
             "WER is the truncated WER of the set (errors over reference words, WnW §3.5), "
             "in percent as the paper prints it. The paper's columns are LibriSpeech-Long "
             "test-clean on 3B backbones; minivox is a 135M-parameter decoder on synthetic "
             "speech, so compare the shape (which methods hold their WER as r_GPU falls, which "
             "fail to terminate), not the levels. Full Cache has one value (first column).",
             lam_note,
             "Reading the tables: WER above 100% means the hypothesis ran past the reference "
             "(a method that fails to terminate); WnW's r_GPU+CPU above its r_GPU is the CPU "
             "complement its tidal heads can recall (the paper's 41.5% at a 0.2 target)."]
    if info.decoding_options:
        notes.append(decoding_options_note(info.decoding_options))
    cut = cap_note(runs, info.max_new_tokens)
    if cut:
        notes.append(cut)
    if info.sources:
        folders = sorted({f for v in info.sources.values() for f in v.split(", ")})
        notes.append("Runs read from existing `kvsim live` folders: " + ", ".join(f"`{f}`" for f in folders)
                     + (f"; decoded by this study: {', '.join(info.decoded)}." if info.decoded else "."))
    return notes


def decoding_options_note(options: dict[str, str]) -> str:
    """What the decoding options of the runs were (not the papers' plain greedy decoding)."""
    said = {"read_window": "a read window on the aligning layers (`--read-window {}`)",
            "ban_cycles": "a ban on short loops (`--ban-cycles {}`)",
            "hold_end": "the end of answer held until the read position is within {0} s of the "
                        "end of the speech (`--hold-end {0}`)"}
    return ("Decoding options, the same for every method, Full Cache included, and not the "
            "papers' protocol (plain greedy decoding): "
            + _and_list([said[key].format(value) for key, value in options.items()])
            + "; see docs/live.md, \"Decoding options\".")


def _and_list(parts: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(parts) if len(parts) < 3 else ", ".join(parts[:-1]) + " and " + parts[-1]


def cap_note(runs: pl.DataFrame, max_new_tokens: int | None) -> str | None:
    """A warning naming the clips whose complete transcript needs more tokens than the cap:
    their reference words times the tokens per word of the runs that ended by themselves (a
    run cut by the cap scores deletions the cap made, not the method's errors). None when the
    cap covers every clip, or no run ended by itself to measure tokens per word on."""
    need = {"terminated", "tokens", "length_ratio", "ref_words", "input"}
    if max_new_tokens is None or not need <= set(runs.columns):
        return None
    ended = runs.filter(pl.col("terminated"))
    words = (ended["length_ratio"] * ended["ref_words"]).sum()  # normalised hypothesis words
    if ended.height == 0 or not words:
        return None
    per_word = float(ended["tokens"].sum()) / float(words)
    clips = runs.group_by("input", maintain_order=True).agg(pl.col("ref_words").first())
    short = clips.filter(pl.col("ref_words") * per_word > max_new_tokens)
    if short.height == 0:
        return None
    worst = int(short["ref_words"].max() * per_word)
    return (f"Warning: the token cap (--max-new-tokens {max_new_tokens}) is below what a complete "
            f"transcript needs on {short.height} of {clips.height} clips ({', '.join(short['input'])}; "
            f"up to ~{worst} tokens at the {per_word:.2f} tokens per word of the runs that ended "
            "by themselves): there WER counts the words the cap cut, not the method's errors. "
            "Raise the cap (minivox's evaluation gives a clip 1.7 tokens per reference word + 10).")


@dataclass
class Table5Config:
    """Options of ``kvsim study table5`` (defaults: the committed run)."""

    dataset_root: Path = Path("data/minivox")
    split: str = "test_30_60"
    limit: int | None = 8
    ids: list[str] | None = None
    methods: tuple[str, ...] = DEFAULT_METHODS
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    max_new_tokens: int = 300
    max_seconds: float | None = None  #: crop each clip (and its reference) to this length
    heads: Path | None = SHIPPED_HEADS
    calibration_traces: tuple[Path, ...] = ()
    lambda_fit: str = "measured"  #: λ fit on calibration_traces: measured (WnW §3.4) | prefill
    live_runs: tuple[Path, ...] = ()
    runs_only: bool = False
    grid: GridSpec = field(default_factory=GridSpec)
    #: decoding options, not the papers' protocol (None: off; kvsim.decoding.read_window, .cycle_ban)
    read_window: ReadWindowConfig | None = None
    ban_cycles: CycleBanConfig | None = None
    hold_end: float | None = None  #: kvsim.decoding.hold_end, with the read window

    def live_config(self, scores) -> LiveConfig:
        """How every run of the study decodes."""
        return LiveConfig(max_new_tokens=self.max_new_tokens, head_scores=scores,
                          read_window=self.read_window, ban_cycles=self.ban_cycles,
                          hold_end=self.hold_end)


#: --quick: the first 10 s of one clip, three methods at r = 0.2, at most 60 tokens.
QUICK = dict(limit=1, methods=("full", "wnw", "snapkv"), budgets=(0.2,), max_seconds=10.0, max_new_tokens=60)


def select_inputs(cfg: Table5Config) -> list:
    """The clips of ``cfg.split`` under ``cfg.dataset_root`` (a manifest), first ``limit`` or
    ``ids``."""
    from kvsim.live.data import load_dataset, select_ids

    items = load_dataset("manifest", cfg.dataset_root, split=cfg.split,
                         limit=None if cfg.ids else cfg.limit)
    return select_ids(items, cfg.ids) if cfg.ids else items


def build_plan(cfg: Table5Config, scores) -> list[PlanItem]:
    """The study's plan, WnW at the λ fitted per budget on ``cfg.calibration_traces`` (if any)."""
    from kvsim.studies.wnw_lambda import calibration_contexts, wnw_items

    wnw: list[PlanItem] = []
    if "wnw" in cfg.methods:
        ctxs = (calibration_contexts(cfg.calibration_traces, scores, cfg.lambda_fit)
                if cfg.calibration_traces else None)
        wnw = wnw_items(cfg.budgets, ctxs, cfg.grid.ray)
    return table5_plan(cfg.methods, cfg.budgets, wnw)


def run_table5(cfg: Table5Config, out: Path, log: Callable[[str], None] = print) -> StudyReport:
    """Decode (or read from ``cfg.live_runs``) the grid and build the report; decoded runs go
    to ``out / "live-table5"`` (a ``kvsim live`` run folder, reused by a later call)."""
    from kvsim.decoding import OPTION_KEYS
    from kvsim.studies.live_runs import combine
    from kvsim.studies.wnw_lambda import lambda_of
    from kvsim.trace.heads import read_heads

    scores = read_heads(cfg.heads) if cfg.heads else None
    plan = build_plan(cfg, scores)
    runs, sources = None, {}
    options = cfg.live_config(scores).decoding_options()
    if cfg.live_runs:
        expected = {"model": cfg.grid.model, "max_new_tokens": cfg.max_new_tokens, "max_seconds": cfg.max_seconds,
                    **{key: options.get(key) for key in OPTION_KEYS}}
        runs, sources = combine(cfg.live_runs, expected)
    if cfg.runs_only:
        if runs is None:
            raise ValueError("--runs-only needs --live-runs folders with finished runs"
                             + (f" ({', '.join(map(str, cfg.live_runs))} have none yet)" if cfg.live_runs else ""))
        inputs, groups = runs["input"].unique(maintain_order=True).to_list(), []
    else:
        items = select_inputs(cfg)
        inputs = [i.id for i in items]
        if runs is not None:
            runs = runs.filter(pl.col("input").is_in(inputs))
        groups = missing_groups(plan, runs, inputs)
        runs = decode_missing(runs, groups, items, cfg, scores, out, log)
    info = Table5Info(inputs=inputs, split=cfg.split, sources=sources, model=cfg.grid.model,
                      max_seconds=cfg.max_seconds, lambda_fit=cfg.lambda_fit,
                      max_new_tokens=cfg.max_new_tokens, decoding_options=options,
                      lambdas={p.spec.budget: lambda_of(p) for p in plan if p.spec.name == "wnw"},
                      decoded=sorted({f"{p.spec.label}@{p.spec.budget:g}" for g, _ in groups for p in g}))
    report = table5_report(runs, cfg.budgets, info)
    for note in report.notes:
        if note.startswith("Warning:"):  # cap_note's, computed once with the notes
            log(note)
    return report
