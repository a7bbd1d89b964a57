"""``kvsim live``: greedy decoding with KV-cache policies inside the model (closed loop)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvsim.commands._errors import err, fail, print_error
from kvsim.commands._options import (
    BanCyclesOption,
    HoldEndOption,
    ReadWindowOption,
    announce_shipped_calibration,
    calibration_for,
    parse_decoding_options,
)
from kvsim.commands._table import Column, FormatOption, TableFormat, WideOption, print_frame

if TYPE_CHECKING:
    from kvsim.live.decode import LiveConfig

#: The live summary: the compact set fits 80 columns with whole policy names.
LIVE_COLUMNS = [
    Column("transform", "transform", text=True),
    Column("label", "policy", text=True),
    Column("budget", "r", "{:.2f}"),
    Column("r_gpu", "r_GPU", "{:.3f}"),
    Column("r_gpu_vs_original", "r_GPU (orig.)", "{:.3f}", compact=False),
    Column("r_gpu_cpu", "r_GPU+CPU", "{:.3f}", compact=False),
    Column("wer", "WER", "{:.3f}"),
    Column("bleu", "BLEU", "{:.1f}", compact=False),
    Column("length_ratio", "hyp/ref", "{:.2f}", compact=False),
    Column("termination_rate", "ended", "{:.2f}"),
    Column("h2d_mb_per_step", "MB/step", "{:.3f}"),
    Column("ms_per_token", "ms/tok", "{:.1f}"),
]


def live(
    inputs: Annotated[list[Path] | None, typer.Argument(help="Audio files or folders (*.wav/*.flac + same-stem .txt)")] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="tiny | tiny:<seed> | minivox | voxtral-mini | qwen-omni | checkpoint dir")] = "minivox",
    policy: Annotated[list[str], typer.Option("--policy", "-p", help="Policies, comma-separated; name:key=value for hyperparameters; TRANSFORM/name for a transform+policy method (voxzip1/voxzip, affpool/full)")] = ["full"],  # noqa: B006
    budget: Annotated[str, typer.Option("--budget", "-b", help="Target r_GPU values, comma-separated")] = "1.0",
    reference: Annotated[list[str] | None, typer.Option("--reference", "-r", help="Reference per audio file, in order: the text, or a file when the value ends in .txt or is one word with a '/' (it must exist)")] = None,
    dataset: Annotated[str | None, typer.Option(help="Dataset layout: dir | librispeech-long | primock57 | longspeech | manifest")] = None,
    split: Annotated[str | None, typer.Option(help="Manifest split (manifest datasets); LibriSpeech-Long test-clean etc.; LongSpeech TASK[:LANGUAGE], e.g. ASR:fr")] = None,
    limit: Annotated[int | None, typer.Option(help="Use only the first N inputs")] = None,
    ids: Annotated[str | None, typer.Option(help="Use only these inputs, comma-separated ids (file stems; manifest ids)")] = None,
    max_seconds: Annotated[float | None, typer.Option(help="Crop audio (and reference) to this length")] = None,
    transform: Annotated[str, typer.Option(help="Input transforms, comma-separated: none, voxzip1, affpool[:retention], affpool_layers:TAU, nopad (the encoder padding taken out of the input)")] = "none",
    task: Annotated[str | None, typer.Option(help="transcribe | translate (scored with sacreBLEU); default: the dataset's (LongSpeech translation rows), else transcribe")] = None,
    language: Annotated[str | None, typer.Option(help="Target language of --task translate (e.g. fr), source language otherwise")] = None,
    instruction: Annotated[str | None, typer.Option(help="Instruction text after the audio (overrides the task's)")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Stop after this many tokens")] = 400,
    physical: Annotated[bool, typer.Option("--physical", help="Physical offload instead of masking emulation")] = False,
    read_window: ReadWindowOption = None,
    ban_cycles: BanCyclesOption = None,
    hold_end: HoldEndOption = None,
    calibration: Annotated[Path | None, typer.Option(help="heads.json calibration file (WnW, AudioKV); default with --model minivox: the shipped adapter's own")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ... (checked before the model loads)")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Weights dtype")] = "float32",
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory")] = Path("runs/live"),
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Write the WER-vs-r_GPU chart")] = True,
    resume: Annotated[bool, typer.Option("--resume", help="Keep the inputs an interrupted run with the same options completed in --out; decode only the rest")] = False,
    ray: Annotated[str | None, typer.Option("--ray", help="Decode each input as a Ray task on a cluster: its address ('auto' for the one `ray start` made, 'local' for a local Ray)")] = None,
    wide: WideOption = False,
    fmt: FormatOption = TableFormat.table,
) -> None:
    """Decode inputs with KV-cache policies applied inside the model's attention; report truncated WER / BLEU, termination, measured r_GPU and r_GPU+CPU, H2D traffic, ms/token.

    An input that cannot be read (empty, NaN/inf, silent, unreadable) or decoded is reported in one line and skipped, never scored; the others run (exit code 1).
    """
    import torch

    from kvsim.commands._options import check_positive_ints, check_range
    from kvsim.live.decode import LiveConfig
    from kvsim.live.run import make_plan
    from kvsim.rundir import RunDir, check_out_dir
    from kvsim.specs import parse_budgets
    from kvsim.trace.heads import read_heads
    from kvsim.trace.schema import TraceError
    from kvsim.tracer.backbones.base import check_language

    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "1")))
    try:
        check_positive_ints(limit=limit, max_new_tokens=max_new_tokens)
        check_range("--max-seconds", max_seconds, 0, low_open=True)
        check_language(language)
        plan = make_plan(policy, parse_budgets(budget), transform)
        items = _select_inputs(inputs, reference, dataset, split, limit, ids, task)
        if calibration is None and (calibration := calibration_for(model, None)):
            announce_shipped_calibration(calibration, "--calibration")
        scores = read_heads(calibration) if calibration else None
        cfg = LiveConfig(max_new_tokens=max_new_tokens, physical=physical, head_scores=scores,
                         **parse_decoding_options(read_window, ban_cycles, hold_end))
        config = {"model": model, "plan": [f"{p.transform}/{p.spec.label}@{p.spec.budget:g}" for p in plan],
                  "max_new_tokens": max_new_tokens, "max_seconds": max_seconds, "task": task,
                  "language": language, "instruction": instruction, "physical": physical,
                  "calibration": str(calibration) if calibration else None, "dtype": dtype,
                  **cfg.decoding_options()}
        check_out_dir(out)
        decode = _decoder(model, device, dtype, ray, cfg)
        run = RunDir.open(out, "live", [i.id for i in items], config, resume=resume)
    except (ValueError, KeyError, FileNotFoundError, TraceError) as exc:
        fail(exc)
    with run:
        _decode_all(run, items, plan, decode, cfg,
                    dict(max_seconds=max_seconds, instruction=instruction, language=language), plot,
                    (fmt, wide))
    if run.manifest["status"] != "complete":
        raise typer.Exit(1)


def _decoder(model: str, device: str, dtype: str, ray: str | None,
             cfg: LiveConfig) -> Callable[..., Any]:
    """``(job, run, log) -> runs frame``: the model loaded here and :func:`run_live`, or with
    ``--ray`` the model checked here (loaded by the workers) and the Ray tasks. ValueError
    (one line) on a device or dtype this machine cannot use, before the model loads (the
    check of ``kvsim trace``; with ``--ray`` the workers' devices are theirs to check), and
    on a read window whose aligning layers the loaded model lacks (``cfg``: the LiveConfig)."""
    from functools import partial

    from kvsim.live.run import run_live

    if ray is None:
        from kvsim.live.models import load_backbone
        from kvsim.tracer.backbones.base import check_device_dtype

        check_device_dtype(device, dtype)
        lm = load_backbone(model, device=device, dtype=dtype)
        if cfg.read_window is not None:
            cfg.read_window.check_layers(lm.layout.n_layers, lm.name)
        return partial(run_live, lm)
    from kvsim.cluster import connect
    from kvsim.live.remote import ModelSpec, check_model, run_live_on_ray

    check_model(model)
    connect(ray)
    return partial(run_live_on_ray, ray, ModelSpec(model, device, dtype))


def _select_inputs(inputs: list[Path] | None, reference: list[str] | None, dataset: str | None,
                   split: str | None, limit: int | None, ids: str | None, task: str | None) -> list:
    """The inputs to decode, from files/folders or a dataset, narrowed by --limit / --ids,
    with --task applied; DataError (one line) on a bad selection."""
    from kvsim.live.data import DataError, from_paths, load_dataset, select_ids
    from kvsim.specs import option_items

    if ids is not None and limit:
        raise DataError("--ids and --limit both select inputs: give one of them")
    if dataset:
        if reference:
            raise DataError("--reference applies to audio files given as arguments; "
                            f"--dataset {dataset} reads its own references")
        if not inputs or len(inputs) != 1:
            raise DataError("--dataset takes exactly one root folder (or manifest) argument")
        items = load_dataset(dataset, inputs[0], split=split, limit=limit)
    else:
        if not inputs:
            raise DataError("no inputs: give audio files/folders or --dataset KIND ROOT")
        items = from_paths(inputs, reference)[:limit] if limit else from_paths(inputs, reference)
    if ids is not None:
        items = select_ids(items, option_items(ids, "--ids", "input id"))
    if task is not None:
        if task not in ("transcribe", "translate"):
            raise DataError(f"--task {task!r}: transcribe or translate")
        for it in items:
            it.task = task
    _check_unique_ids(items)
    return items


def _check_unique_ids(items: list) -> None:
    """Each input's results are kept under its id: two inputs may not share one."""
    seen: dict[str, object] = {}
    for it in items:
        if it.id in seen:
            raise ValueError(f"{it.audio_path}: id {it.id!r} is also the id of {seen[it.id]}; "
                             "rename one of them")
        seen[it.id] = it.audio_path


def _decode_all(run, items: list, plan: list, decode: Callable[..., Any], cfg, job_args: dict,
                plot: bool, shown: tuple[TableFormat, bool]) -> None:
    """Decode every input into ``run`` with ``decode`` (:func:`_decoder`); print the table
    (``shown``: format and --wide) and chart."""
    import polars as pl

    from kvsim.live.run import LiveJob, wer_chart

    t0 = time.perf_counter()
    try:
        frame = decode(LiveJob(items, plan, cfg, **job_args), run,
                       log=lambda m: err.print(m, markup=False, highlight=False))
    except ValueError as exc:  # nothing completed
        print_error(str(exc))
        run.finish("failed")
        return
    wall = time.perf_counter() - t0
    results = pl.read_parquet(run.path / "results.parquet", glob=False)
    print_frame(results, LIVE_COLUMNS, fmt=shown[0], wide=shown[1], title=f"kvsim live ({frame['model'][0]})")
    if plot and "wer" in results.columns:
        from kvsim.plots import save_chart

        for p in save_chart(wer_chart(results), run.path / "wer_vs_rgpu"):
            err.print(f"wrote {p}", markup=False)
    err.print(f"{frame.height} live runs over {len(items)} inputs in {wall:.1f}s "
              f"-> {run.path}/results.parquet", markup=False)
    run.finish()


COMMANDS = (live,)
