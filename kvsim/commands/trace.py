"""``kvsim trace``: record what a real backbone computes on audio inputs (see docs/tracer.md)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from kvsim.commands._options import MODEL_HELP
from kvsim.tracer.audio import AudioError  # noqa: F401  (import check: tracer is importable)

AUDIO_EXTS = (".wav", ".flac", ".ogg", ".mp3")


def expand_inputs(inputs: list[Path]) -> list[Path]:
    """Files as given; directories searched (recursively) for wav/flac/ogg/mp3 files."""
    out: list[Path] = []
    for p in inputs:
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.suffix.lower() in AUDIO_EXTS))
        else:
            out.append(p)
    return out


def register(app: typer.Typer) -> None:
    @app.command("trace")
    def trace(
        inputs: list[Path] = typer.Argument(..., help="Audio files (wav/flac/ogg/mp3) or folders."),
        model: str = typer.Option(..., "--model", "-m",
                                  help=MODEL_HELP),
        out: Path = typer.Option(..., "--out", "-o", help="Folder for the *.kvtrace traces."),
        reference: Path | None = typer.Option(
            None, "--reference", "-r",
            help="Reference transcript (.txt) or word alignment (.json/.tsv) for one input, or a "
                 "folder of <stem>.txt / <stem>.words.json|.words.tsv (also looked up next to "
                 "each audio file)."),
        task: str = typer.Option("transcribe", "--task", help="transcribe or translate."),
        language: str | None = typer.Option(
            None, "--language", help="Source language (transcribe) or target (translate), "
                                     "ISO 639-1."),
        prompt: str | None = typer.Option(None, "--prompt", help="Instruction replacing the "
                                                                 "task's default text."),
        max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Stop after this many "
                                                                           "tokens (>= 1)."),
        device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:1, ..."),
        dtype: str = typer.Option("float32", "--dtype", help="Weights dtype: float32, bfloat16, "
                                                             "float16."),
        store_dtype: str = typer.Option("float16", "--store-dtype",
                                        help="Trace tensor dtype: float16 or float32."),
        values: bool = typer.Option(False, "--values", help="Also store values (V)."),
        window: int = typer.Option(32, "--window", min=1,
                                   help="Observation window: store the queries of the last N "
                                        "prompt positions (32: AudioKV's, WnW App. F)."),
        aligner: str = typer.Option("auto", "--aligner",
                                    help="Word alignment: auto (reference file, else Whisper), "
                                         "reference, whisper, none."),
        calibrate: bool = typer.Option(False, "--calibrate",
                                       help="Also compute WnW head scores over these inputs and "
                                            "store them in every trace (and OUT/heads.json)."),
        heads: Path | None = typer.Option(
            None, "--heads", help="Store this calibration file (from `kvsim calibrate` on a "
                                  "held-out set) in every trace written."),
        overwrite: bool = typer.Option(False, "--overwrite",
                                       help="Retrace inputs whose trace is already complete."),
    ) -> None:
        """Trace INPUTS with a real backbone: one *.kvtrace per input."""
        from rich.console import Console
        from rich.markup import escape

        from kvsim.commands._options import check_positive_ints
        from kvsim.rundir import OutDirError, RunDir, check_out_dir
        from kvsim.tracer.backbones import BackboneError, LoadOptions, PromptSpec, resolve_model
        from kvsim.tracer.backbones.base import TASKS
        from kvsim.tracer.batch import ALIGNERS, BatchConfig
        from kvsim.tracer.run import TraceOptions

        console = Console(stderr=True, soft_wrap=True)
        try:
            check_positive_ints(max_new_tokens=max_new_tokens)
            check_out_dir(out)
        except ValueError as exc:
            console.print(f"[red]error:[/] {escape(str(exc))}")
            raise typer.Exit(2) from None
        if task not in TASKS:
            raise typer.BadParameter(f"must be one of {', '.join(TASKS)}", param_hint="--task")
        if aligner not in ALIGNERS:
            raise typer.BadParameter(f"must be one of {', '.join(ALIGNERS)}",
                                     param_hint="--aligner")
        if store_dtype not in ("float16", "float32"):
            raise typer.BadParameter("must be float16 or float32", param_hint="--store-dtype")
        if calibrate and heads is not None:
            raise typer.BadParameter("use either --calibrate or --heads", param_hint="--heads")
        scores = None
        if heads is not None:
            from kvsim.trace.heads import read_heads
            from kvsim.trace.schema import TraceError

            try:
                scores = read_heads(heads)
            except TraceError as exc:
                console.print(f"[red]error:[/] {escape(str(exc))}")
                raise typer.Exit(2) from None
        if reference is not None and not reference.exists():
            raise typer.BadParameter(f"{reference}: not found", param_hint="--reference")
        from kvsim.tracer.backbones.base import check_device_dtype

        try:
            resolve_model(model)
            check_device_dtype(device, dtype)
        except (BackboneError, ValueError) as exc:
            console.print(f"[red]error:[/] {escape(str(exc))}")
            raise typer.Exit(2) from None
        files = expand_inputs(inputs)
        if not files:
            console.print("[red]error:[/] no audio inputs found")
            raise typer.Exit(2)
        config = {"model": model, "task": task, "language": language, "prompt": prompt,
                  "max_new_tokens": max_new_tokens, "store_dtype": store_dtype, "values": values,
                  "aligner": aligner, "dtype": dtype}
        try:
            run = RunDir.open(out, "trace", [str(f) for f in files], config)
        except OutDirError as exc:
            console.print(f"[red]error:[/] {escape(str(exc))}")
            raise typer.Exit(2) from None
        cfg = BatchConfig(
            model=model, out_dir=out,
            options=TraceOptions(max_new_tokens=max_new_tokens, store_values=values,
                                 storage_dtype=store_dtype, observation_window=window,
                                 prompt=PromptSpec(task=task, language=language, text=prompt)),
            load=LoadOptions(device=device, dtype=dtype), reference=reference,
            aligner=aligner, overwrite=overwrite,
        )
        with run:
            _trace_all(files, cfg, run, console, calibrate, scores)


def _trace_all(files: list[Path], cfg, run, console, calibrate: bool, scores) -> None:
    """Trace every input into ``run`` (calibrating or storing head scores after); print the
    summary; exit 1 when an input failed, 2 when the whole run did."""
    from rich.markup import escape

    from kvsim.tracer.backbones import BackboneError
    from kvsim.tracer.batch import run_batch, summary_table

    t0 = time.perf_counter()
    try:
        results = run_batch(files, cfg, console, run)
        if calibrate:
            from kvsim.tracer.calibrate import CalibrationConfig, calibrate_into_traces

            calibrate_into_traces(results, cfg, CalibrationConfig(), console)
        elif scores is not None:
            from kvsim.tracer.calibrate import store_head_scores

            store_head_scores(results, scores, console)
    except BackboneError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        run.finish("failed")
        raise typer.Exit(2) from None
    except ValueError as exc:
        console.print(f"[red]error:[/] {escape(str(exc).splitlines()[0])}")
        run.finish("failed")
        raise typer.Exit(2) from None
    console.print(summary_table(results, time.perf_counter() - t0))
    if run.finish() != "complete":
        raise typer.Exit(1)
