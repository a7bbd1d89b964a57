"""``kvsim calibrate``: WnW per-head scores (voice score, head sensitivity; WnW Appendix E)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from kvsim.commands._options import MODEL_HELP


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate(
        inputs: list[Path] = typer.Argument(..., help="Calibration audio files or folders."),
        model: str = typer.Option(..., "--model", "-m",
                                  help=MODEL_HELP),
        out: Path = typer.Option(..., "--out", "-o", help="heads.json to write."),
        reference: Path | None = typer.Option(
            None, "--reference", "-r",
            help="Transcript/word alignment for one input, or a folder of <stem>.txt / "
                 "<stem>.words.json|.words.tsv (also looked up next to each audio file)."),
        task: str = typer.Option("transcribe", "--task"),
        language: str | None = typer.Option(None, "--language"),
        max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
        device: str = typer.Option("cpu", "--device"),
        dtype: str = typer.Option("float32", "--dtype"),
        aligner: str = typer.Option("auto", "--aligner",
                                    help="auto (reference file, else Whisper), reference, "
                                         "whisper, none (sensitivity only)."),
        top_k: int | None = typer.Option(None, "--top-k", min=1,
                                         help="Top-K audio positions per head (default: one "
                                              "spoken word, round(0.32 x tokens/s))."),
        min_confidence: float = typer.Option(0.85, "--min-confidence"),
        teacher: str = typer.Option("greedy", "--teacher",
                                    help="Answer tokens for the sensitivity: greedy or "
                                         "reference."),
        max_tokens: int = typer.Option(64, "--max-tokens", min=1,
                                       help="Answer tokens per sample for the sensitivity."),
    ) -> None:
        """Score every KV-head of MODEL on calibration audio and write heads.json."""
        from rich.console import Console

        from kvsim.commands.trace import expand_inputs
        from kvsim.trace.heads import write_heads
        from kvsim.tracer.backbones import BackboneError, LoadOptions, PromptSpec, resolve_model
        from kvsim.tracer.batch import ALIGNERS, BatchConfig
        from kvsim.tracer.calibrate import CalibrationConfig, calibrate_inputs
        from kvsim.tracer.run import TraceOptions

        console = Console(stderr=True)
        if aligner not in ALIGNERS:
            raise typer.BadParameter(f"must be one of {', '.join(ALIGNERS)}",
                                     param_hint="--aligner")
        if teacher not in ("greedy", "reference"):
            raise typer.BadParameter("must be greedy or reference", param_hint="--teacher")
        from kvsim.tracer.backbones.base import check_device_dtype

        try:
            resolve_model(model)
            check_device_dtype(device, dtype)
        except (BackboneError, ValueError) as exc:
            console.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
        files = expand_inputs(inputs)
        if not files:
            console.print("[red]error:[/] no audio inputs found")
            raise typer.Exit(2)
        cfg = BatchConfig(
            model=model, out_dir=out.parent,
            options=TraceOptions(max_new_tokens=max_new_tokens,
                                 prompt=PromptSpec(task=task, language=language)),
            load=LoadOptions(device=device, dtype=dtype), reference=reference, aligner=aligner)
        ccfg = CalibrationConfig(top_k=top_k, min_confidence=min_confidence, teacher=teacher,
                                 max_tokens=max_tokens)
        t0 = time.perf_counter()
        try:
            run = calibrate_inputs(files, cfg, ccfg, console)
        except (BackboneError, ValueError) as exc:
            console.print(f"[red]error:[/] {str(exc).splitlines()[0]}")
            raise typer.Exit(2) from None
        run.provenance["wall_s"] = time.perf_counter() - t0
        write_heads(out, run.scores, model, run.provenance)
        vs, hs = run.scores.voice_score, run.scores.sensitivity
        console.print(
            f"{out}: {vs.shape[0]} layers x {vs.shape[1]} KV-heads from {run.n_ok} inputs "
            f"({run.provenance['n_samples_voice']} with aligned tokens); "
            f"VS mean {vs.mean():.3f}, HS mean {hs.mean():.3g}; "
            f"{time.perf_counter() - t0:.1f} s")
        from rich.table import Table

        table = Table(title="most important KV-heads (VS x HS)")
        for col in ("rank", "layer", "kv-head", "VS", "HS", "VS x HS"):
            table.add_column(col, justify="right")
        for i, (layer, head) in enumerate(run.provenance["ranking_vs_x_hs"][:10]):
            table.add_row(str(i + 1), str(layer), str(head), f"{vs[layer, head]:.3f}",
                          f"{hs[layer, head]:.3g}", f"{vs[layer, head] * hs[layer, head]:.3g}")
        console.print(table)
        for path, reason in run.failures:
            console.print(f"[red]failed[/] {path}: {reason}")
        if run.failures:
            raise typer.Exit(1)
