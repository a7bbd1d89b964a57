"""``kvsim trace``: record what a real backbone computes on audio inputs (see docs/tracer.md)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kvsim.commands._errors import err, fail, print_error
from kvsim.commands._options import MODEL_HELP, announce_shipped_calibration, calibration_for

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


def check_audio_inputs(inputs: list[Path]) -> list[Path]:
    """The audio files ``inputs`` name, checked before any model loads: every argument must
    exist, a folder must hold audio, a file must be wav/flac/ogg/mp3; fails (exit 2) on the
    first that does not. Files whose header cannot be read are reported; when none can be,
    the command fails (exit 2) without loading a model. Readable ones are returned (with the
    unreadable, which the batch reports as failed inputs, so the run records them)."""
    for p in inputs:
        if not p.exists():
            fail(f"{p}: no such file or directory")
        if p.is_dir() and not expand_inputs([p]):
            fail(f"{p}: folder holds no audio file ({', '.join(AUDIO_EXTS)})")
        if p.is_file() and p.suffix.lower() not in AUDIO_EXTS:
            fail(f"{p}: not an audio file ({', '.join(AUDIO_EXTS)})")
    files = expand_inputs(inputs)
    bad = [(f, reason) for f in files if (reason := _unreadable(f))]
    if len(bad) == len(files):
        if len(files) == 1:
            fail(f"{bad[0][0]}: {bad[0][1]}")
        for f, reason in bad:
            print_error(f"{f}: {reason}")
        fail(f"none of the {len(files)} inputs is readable audio")
    return files


def _unreadable(path: Path) -> str | None:
    """Why ``path`` is not readable audio (its header), or None when it is."""
    import soundfile as sf

    try:
        info = sf.info(str(path))
    except (RuntimeError, OSError) as exc:
        return f"unreadable audio ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    return "empty audio (0 samples)" if info.frames == 0 else None


def trace(
    inputs: Annotated[list[Path], typer.Argument(help="Audio files (wav/flac/ogg/mp3) or folders of them.")],
    model: Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the *.kvtrace traces.")] = Path("traces"),
    reference: Annotated[Path | None, typer.Option("--reference", "-r", help="Reference transcript (.txt) or word alignment (.json/.tsv) for one input, or a folder of <stem>.txt / <stem>.words.json|.words.tsv (also looked up next to each audio file).")] = None,
    task: Annotated[str, typer.Option(help="transcribe or translate.")] = "transcribe",
    language: Annotated[str | None, typer.Option(help="Source language (transcribe) or target (translate), ISO 639-1.")] = None,
    prompt: Annotated[str | None, typer.Option(help="Instruction replacing the task's default text.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Stop after this many tokens (>= 1).")] = 256,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ...")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Weights dtype: float32, bfloat16, float16.")] = "float32",
    store_dtype: Annotated[str, typer.Option(help="Trace tensor dtype: float16 or float32.")] = "float16",
    values: Annotated[bool, typer.Option("--values", help="Also store values (V).")] = False,
    window: Annotated[int, typer.Option(help="Observation window: store the queries of the last N prompt positions (32: AudioKV's, WnW App. F).")] = 32,
    aligner: Annotated[str, typer.Option(help="Word alignment: auto (reference file, else Whisper), reference, whisper, none.")] = "auto",
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Also compute WnW head scores over these inputs and store them in every trace (and OUT/heads.json).")] = False,
    heads: Annotated[Path | None, typer.Option(help="Store this calibration file (from `kvsim calibrate` on a held-out set) in every trace written; default with --model minivox: the shipped adapter's own.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Retrace inputs whose trace is already complete.")] = False,
) -> None:
    """Trace INPUTS with a real backbone: one *.kvtrace per input, written to OUT (default: traces/).

    The options and inputs are checked before the model loads: a missing or unreadable input fails in one line within a second.
    """
    from kvsim.commands._options import OptionError, check_positive_ints
    from kvsim.rundir import OutDirError, check_out_dir

    try:
        check_positive_ints(max_new_tokens=max_new_tokens, window=window)
        check_out_dir(out)
    except (OptionError, OutDirError) as exc:
        fail(exc)
    if reference is not None and not reference.exists():
        fail(f"--reference {reference}: no such file or directory")
    if calibrate and heads is not None:
        fail("use either --calibrate or --heads, not both")
    if store_dtype not in ("float16", "float32"):
        fail(f"--store-dtype {store_dtype}: must be float16 or float32")
    files = check_audio_inputs(inputs)
    if heads is None and not calibrate and (heads := calibration_for(model, None)):
        announce_shipped_calibration(heads, "--heads", ", --calibrate to compute them")
    scores = _read_heads(heads)
    cfg = batch_config(model, out, device=device, dtype=dtype, aligner=aligner, task=task,
                       language=language, prompt=prompt, reference=reference, overwrite=overwrite,
                       max_new_tokens=max_new_tokens, store_values=values,
                       storage_dtype=store_dtype, observation_window=window)
    run = _open_run(out, files, cfg)
    with run:
        _trace_all(files, cfg, run, calibrate, scores)


def _read_heads(heads: Path | None):
    """The head scores of ``--heads`` (None without it); one line and exit 2 when unreadable."""
    if heads is None:
        return None
    from kvsim.trace.heads import read_heads
    from kvsim.trace.schema import TraceError

    try:
        return read_heads(heads)
    except TraceError as exc:
        fail(exc)


def batch_config(model: str, out_dir: Path, *, device: str, dtype: str, aligner: str,
                 task: str = "transcribe", language: str | None = None, prompt: str | None = None,
                 reference: Path | None = None, overwrite: bool = False, **options):
    """The batch's configuration (``options`` are :class:`TraceOptions` fields); checks the
    model name, device, dtype, task, language and aligner (this imports torch, but loads no
    model)."""
    from kvsim.tracer.backbones import BackboneError, LoadOptions, PromptSpec, resolve_model
    from kvsim.tracer.backbones.base import TASKS, check_device_dtype, check_language
    from kvsim.tracer.batch import ALIGNERS, BatchConfig
    from kvsim.tracer.run import TraceOptions

    if task not in TASKS:
        fail(f"--task {task}: must be one of {', '.join(TASKS)}")
    if aligner not in ALIGNERS:
        fail(f"--aligner {aligner}: must be one of {', '.join(ALIGNERS)}")
    try:
        resolve_model(model)
        check_device_dtype(device, dtype)
        check_language(language)
    except (BackboneError, ValueError) as exc:
        fail(exc)
    return BatchConfig(
        model=model, out_dir=out_dir,
        options=TraceOptions(prompt=PromptSpec(task=task, language=language, text=prompt), **options),
        load=LoadOptions(device=device, dtype=dtype), reference=reference,
        aligner=aligner, overwrite=overwrite)


def _open_run(out: Path, files: list[Path], cfg):
    """The run directory of this batch (its manifest records the options)."""
    from kvsim.rundir import OutDirError, RunDir

    opts = cfg.options
    config = {"model": cfg.model, "task": opts.prompt.task, "language": opts.prompt.language,
              "prompt": opts.prompt.text, "max_new_tokens": opts.max_new_tokens,
              "store_dtype": opts.storage_dtype, "values": opts.store_values,
              "aligner": cfg.aligner, "dtype": cfg.load.dtype}
    try:
        return RunDir.open(out, "trace", [str(f) for f in files], config)
    except OutDirError as exc:
        fail(exc)


def _trace_all(files: list[Path], cfg, run, calibrate: bool, scores) -> None:
    """Trace every input into ``run`` (calibrating or storing head scores after); print the
    summary; exit 1 when an input failed, 2 when the whole run did."""
    from kvsim.tracer.backbones import BackboneError
    from kvsim.tracer.batch import run_batch, summary_table

    t0 = time.perf_counter()
    try:
        results = run_batch(files, cfg, err, run)
        if calibrate:
            from kvsim.tracer.calibrate import CalibrationConfig, calibrate_into_traces

            calibrate_into_traces(results, cfg, CalibrationConfig(), err)
        elif scores is not None:
            from kvsim.tracer.calibrate import store_head_scores

            store_head_scores(results, scores, err)
    except (BackboneError, ValueError) as exc:
        run.finish("failed")
        fail(str(exc).splitlines()[0])
    err.print(summary_table(results, time.perf_counter() - t0))
    if run.finish() != "complete":
        raise typer.Exit(1)


COMMANDS = (trace,)
