"""``kvsim live``: greedy decoding with KV-cache policies inside the model (closed loop)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console(stderr=True, soft_wrap=True)

SCREEN = [
    ("transform", "input", "{}"), ("label", "policy", "{}"), ("budget", "target r", "{:.2f}"),
    ("r_gpu", "r_GPU", "{:.3f}"), ("r_gpu_vs_original", "r_GPU (orig.)", "{:.3f}"), ("r_gpu_cpu", "r_GPU+CPU", "{:.3f}"), ("wer", "WER", "{:.3f}"),
    ("bleu", "BLEU", "{:.1f}"), ("length_ratio", "hyp/ref", "{:.2f}"),
    ("termination_rate", "terminated", "{:.2f}"), ("h2d_mb_per_step", "H2D MB/step", "{:.3f}"),
    ("ms_per_token", "ms/token", "{:.1f}"),
]


def live(
    inputs: Annotated[list[Path] | None, typer.Argument(help="Audio files or folders (*.wav/*.flac + same-stem .txt)")] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="tiny | tiny:<seed> | minivox | voxtral-mini | qwen-omni | checkpoint dir")] = "minivox",
    policy: Annotated[list[str], typer.Option("--policy", "-p", help="Policies, comma-separated; name:key=value for hyperparameters; TRANSFORM/name for a transform+policy method (voxzip1/voxzip, affpool/full)")] = ["full"],  # noqa: B006
    budget: Annotated[str, typer.Option("--budget", "-b", help="Target r_GPU values, comma-separated")] = "1.0",
    reference: Annotated[list[str] | None, typer.Option("--reference", "-r", help="Reference text (or .txt file) per input, in order")] = None,
    dataset: Annotated[str | None, typer.Option(help="Dataset layout: dir | librispeech-long | primock57 | longspeech | manifest")] = None,
    split: Annotated[str | None, typer.Option(help="Manifest split (manifest datasets); LibriSpeech-Long test-clean etc.; LongSpeech TASK[:LANGUAGE], e.g. ASR:fr")] = None,
    limit: Annotated[int | None, typer.Option(help="Use only the first N inputs")] = None,
    ids: Annotated[str | None, typer.Option(help="Use only these inputs, comma-separated ids (file stems; manifest ids)")] = None,
    max_seconds: Annotated[float | None, typer.Option(help="Crop audio (and reference) to this length")] = None,
    transform: Annotated[str, typer.Option(help="Input transforms, comma-separated: none, voxzip1, affpool[:retention]")] = "none",
    task: Annotated[str | None, typer.Option(help="transcribe | translate (scored with sacreBLEU); default: the dataset's (LongSpeech translation rows), else transcribe")] = None,
    language: Annotated[str | None, typer.Option(help="Target language of --task translate (e.g. fr), source language otherwise")] = None,
    instruction: Annotated[str | None, typer.Option(help="Instruction text after the audio (overrides the task's)")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Stop after this many tokens")] = 400,
    physical: Annotated[bool, typer.Option("--physical", help="Physical offload instead of masking emulation")] = False,
    calibration: Annotated[Path | None, typer.Option(help="heads.json calibration file (WnW, AudioKV)")] = None,
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Weights dtype")] = "float32",
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory")] = Path("runs/live"),
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Write the WER-vs-r_GPU chart")] = True,
) -> None:
    """Decode inputs with KV-cache policies applied inside the model's attention; report
    truncated WER / BLEU, termination, measured r_GPU and r_GPU+CPU, H2D traffic, ms/token."""
    import torch

    from kvsim.specs import parse_budgets
    from kvsim.trace.heads import read_heads
    from tracer.live.data import DataError, from_paths, load_dataset, select_ids
    from tracer.live.decode import LiveConfig
    from tracer.live.models import load_backbone
    from tracer.live.run import LiveJob, make_plan, run_live, wer_chart

    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "1")))
    try:
        plan = make_plan(policy, parse_budgets(budget), transform)
        if ids and limit:
            raise DataError("--ids and --limit both select inputs: give one of them")
        if dataset:
            if not inputs or len(inputs) != 1:
                raise DataError("--dataset takes exactly one root folder (or manifest) argument")
            items = load_dataset(dataset, inputs[0], split=split, limit=limit)
        else:
            if not inputs:
                raise DataError("no inputs: give audio files/folders or --dataset KIND ROOT")
            items = from_paths(inputs, reference)[:limit] if limit else from_paths(inputs, reference)
        if ids:
            items = select_ids(items, [i.strip() for i in ids.split(",") if i.strip()])
        if task is not None:
            if task not in ("transcribe", "translate"):
                raise DataError(f"--task {task!r}: transcribe or translate")
            for it in items:
                it.task = task
        scores = read_heads(calibration) if calibration else None
        lm = load_backbone(model, device=device, dtype=dtype)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    cfg = LiveConfig(max_new_tokens=max_new_tokens, physical=physical, head_scores=scores)
    job = LiveJob(items, plan, cfg, max_seconds=max_seconds, instruction=instruction,
                  language=language)
    t0 = time.perf_counter()
    try:
        frame = run_live(lm, job, out, log=lambda m: console.print(m))
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    wall = time.perf_counter() - t0
    import polars as pl

    results = pl.read_parquet(out / "results.parquet")
    _print_table(results, f"kvsim live ({lm.name})")
    if plot and "wer" in results.columns:
        from kvsim.plots import save_chart

        for p in save_chart(wer_chart(results), out / "wer_vs_rgpu"):
            console.print(f"wrote {p}")
    console.print(f"{frame.height} live runs over {len(items)} inputs in {wall:.1f}s -> {out}/results.parquet")


def _print_table(frame, title: str) -> None:
    from kvsim.results import print_table

    print_table(frame, Console(width=max(Console().width, 150)), title, SCREEN)


def register(app: typer.Typer) -> None:
    app.command()(live)
