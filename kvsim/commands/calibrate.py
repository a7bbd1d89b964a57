"""``kvsim calibrate``: WnW per-head scores (voice score, head sensitivity; WnW Appendix E)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kvsim.commands._errors import err, fail
from kvsim.commands._options import MODEL_HELP


def calibrate(
    inputs: Annotated[list[Path], typer.Argument(help="Calibration audio files or folders.")],
    model: Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)],
    out: Annotated[Path, typer.Option("--out", "-o", help="heads.json to write.")],
    reference: Annotated[Path | None, typer.Option("--reference", "-r", help="Transcript/word alignment for one input, or a folder of <stem>.txt / <stem>.words.json|.words.tsv (also looked up next to each audio file).")] = None,
    task: Annotated[str, typer.Option(help="transcribe or translate.")] = "transcribe",
    language: Annotated[str | None, typer.Option(help="Source language (transcribe) or target (translate), ISO 639-1.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Stop after this many tokens (>= 1): the whole answer is the generation up to here.")] = 256,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ...")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Weights dtype: float32, bfloat16, float16.")] = "float32",
    aligner: Annotated[str, typer.Option(help="auto (reference file, else Whisper), reference, whisper, none (sensitivity only).")] = "auto",
    top_k: Annotated[int | None, typer.Option(help="Top-K audio positions per head (default: one spoken word, round(0.32 x tokens/s)).")] = None,
    min_confidence: Annotated[float, typer.Option(help="Aligned tokens below this word confidence are not counted.")] = 0.85,
    teacher: Annotated[str, typer.Option(help="Answer tokens for the sensitivity: greedy or reference.")] = "greedy",
    max_tokens: Annotated[int | None, typer.Option(help="Answer tokens per sample whose loss gradient enters the sensitivity, one backward pass each (>= 1; default: every token of the whole answer, as WnW App. E).")] = None,
    token_sample: Annotated[str, typer.Option(help="Which tokens when --max-tokens is below the answer's length: even (spread over the whole answer) or first.")] = "even",
) -> None:
    """Score every KV-head of MODEL on calibration audio and write heads.json.

    The options, --out (a file that can be written) and the inputs are checked before the model loads.
    """
    from kvsim.commands._options import OptionError, check_positive_ints, check_range
    from kvsim.commands.trace import batch_config, check_audio_inputs
    from kvsim.rundir import OutDirError, check_out_file
    from kvsim.tracer.calibrate import TOKEN_SAMPLES, CalibrationConfig

    try:
        check_positive_ints(max_new_tokens=max_new_tokens, top_k=top_k, max_tokens=max_tokens)
        check_range("--min-confidence", min_confidence, 0, 1)
        check_out_file(out)
    except (OptionError, OutDirError) as exc:
        fail(exc)
    if teacher not in ("greedy", "reference"):
        fail(f"--teacher {teacher}: must be greedy or reference")
    if token_sample not in TOKEN_SAMPLES:
        fail(f"--token-sample {token_sample}: must be one of {', '.join(TOKEN_SAMPLES)}")
    files = check_audio_inputs(inputs)
    cfg = batch_config(model, out.parent, device=device, dtype=dtype, aligner=aligner, task=task,
                       language=language, reference=reference, max_new_tokens=max_new_tokens)
    ccfg = CalibrationConfig(top_k=top_k, min_confidence=min_confidence, teacher=teacher,
                             max_tokens=max_tokens, token_sample=token_sample)
    _calibrate_and_write(files, cfg, ccfg, out, model)


def _calibrate_and_write(files: list[Path], cfg, ccfg, out: Path, model: str) -> None:
    """Run the calibration, write ``out`` and print the summary and the top heads; exit 1
    when an input failed."""
    from kvsim.commands._table import new_table, print_whole
    from kvsim.trace.heads import write_heads
    from kvsim.tracer.backbones import BackboneError
    from kvsim.tracer.calibrate import calibrate_inputs

    t0 = time.perf_counter()
    try:
        run = calibrate_inputs(files, cfg, ccfg, err)
    except (BackboneError, ValueError) as exc:
        fail(str(exc).splitlines()[0])
    run.provenance["wall_s"] = time.perf_counter() - t0
    try:
        write_heads(out, run.scores, model, run.provenance)  # atomic: the old file or the new
    except OSError as exc:  # --out was checked before the model loaded; changed since
        fail(f"--out {out}: cannot write ({exc.strerror or exc})", code=1)
    vs, hs = run.scores.voice_score, run.scores.sensitivity
    err.print(f"{out}: {vs.shape[0]} layers x {vs.shape[1]} KV-heads from {run.n_ok} inputs "
              f"({run.provenance['n_samples_voice']} with aligned tokens); "
              f"VS mean {vs.mean():.3f}, HS mean {hs.mean():.3g}; "
              f"{time.perf_counter() - t0:.1f} s", markup=False)
    table = new_table("most important KV-heads (VS x HS)")
    for col in ("rank", "layer", "kv-head", "VS", "HS", "VS x HS"):
        table.add_column(col, justify="right")
    for i, (layer, head) in enumerate(run.provenance["ranking_vs_x_hs"][:10]):
        table.add_row(str(i + 1), str(layer), str(head), f"{vs[layer, head]:.3f}",
                      f"{hs[layer, head]:.3g}", f"{vs[layer, head] * hs[layer, head]:.3g}")
    print_whole(table, err)
    for path, reason in run.failures:
        err.print(f"failed {path}: {reason}", markup=False)
    if run.failures:
        raise typer.Exit(1)


COMMANDS = (calibrate,)
