"""Trace a batch of audio files: one trace per input, bad inputs reported and skipped, complete
traces skipped on a rerun (resume), progress bars and a closing summary."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvsim.trace import TraceError, write_trace
from kvsim.trace.atomic import clean_stale
from kvsim.trace.schema import TRACE_SUFFIX
from kvsim.trace.validate import validate_trace
from kvsim.tracer.alignment import (
    ALIGNMENT_SUFFIXES,
    TRANSCRIPT_SUFFIXES,
    AlignmentError,
    TokenAlignment,
    WhisperAligner,
    align_tokens,
    find_sidecar,
    load_word_times,
)
from kvsim.tracer.audio import AudioError, load_audio
from kvsim.tracer.backbones import Backbone, LoadOptions, load_backbone
from kvsim.tracer.run import TraceOptions, build_trace, generate_traced

if TYPE_CHECKING:
    from kvsim.rundir import RunDir

ALIGNERS = ("auto", "reference", "whisper", "none")


@dataclass
class BatchConfig:
    model: str
    out_dir: Path
    options: TraceOptions = field(default_factory=TraceOptions)
    load: LoadOptions = field(default_factory=LoadOptions)
    reference: Path | None = None  #: transcript/alignment file (one input) or directory
    aligner: str = "auto"
    overwrite: bool = False


@dataclass
class InputResult:
    path: Path
    status: str  #: traced / skipped / failed
    reason: str = ""
    trace: Path | None = None
    audio_s: float = 0.0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0


def trace_name(path: Path, all_paths: list[Path]) -> str:
    """Trace directory name for an input: its stem, prefixed by the parent folder's name when
    two inputs share a stem."""
    same = [p for p in all_paths if p.stem == path.stem]
    stem = path.stem if len(same) <= 1 else f"{path.parent.name}_{path.stem}"
    return stem + TRACE_SUFFIX


def is_complete(trace: Path) -> bool:
    try:
        validate_trace(trace)
    except TraceError:
        return False
    return True


class Tracer:
    """Holds the model (loaded on first need) and the aligner across a batch."""

    def __init__(self, cfg: BatchConfig, console: Console) -> None:
        self.cfg = cfg
        self.console = console
        self._backbone: Backbone | None = None
        self._whisper: WhisperAligner | None = None
        self._whisper_error: str | None = None

    @property
    def backbone(self) -> Backbone:
        if self._backbone is None:
            self._backbone = load_backbone(self.cfg.model, self.cfg.load)
        return self._backbone

    # ------------------------------------------------------------------ references
    def _reference_files(self, audio: Path, single: bool) -> tuple[Path | None, Path | None]:
        ref = self.cfg.reference
        align = transcript = None
        if ref is not None and ref.is_file():
            if not single:
                raise AlignmentError(f"--reference {ref}: a file can serve only one input; "
                                     "pass a directory of <stem>.txt / <stem>.words.json")
            if ref.suffix.lower() in (".json", ".tsv", ".csv"):
                align = ref
            else:
                transcript = ref
        align = align or find_sidecar(audio, ref, ALIGNMENT_SUFFIXES)
        transcript = transcript or find_sidecar(audio, ref, TRANSCRIPT_SUFFIXES)
        return align, transcript

    def references(self, audio: Path, single: bool) -> tuple[Path | None, str | None]:
        """(word alignment file, reference text) for ``audio``; the text falls back to the
        alignment's words."""
        align_file, transcript = self._reference_files(audio, single)
        text = transcript.read_text().strip() if transcript else None
        if text is None and align_file is not None:
            text = " ".join(w.word for w in load_word_times(align_file))
        return align_file, text

    def _whisper_aligner(self) -> WhisperAligner | None:
        if self._whisper is None and self._whisper_error is None:
            try:
                self._whisper = WhisperAligner()
            except (AlignmentError, ImportError, RuntimeError, OSError) as exc:
                self._whisper_error = str(exc).splitlines()[0]
                self.console.print(f"[yellow]no offline aligner: {escape(self._whisper_error)}[/]")
        return self._whisper

    def align(self, clip, tokens: list[int], align_file: Path | None) -> TokenAlignment | None:
        mode = self.cfg.aligner
        if mode == "none":
            return None
        decode = self.backbone.decode
        if align_file is not None and mode in ("auto", "reference"):
            words = load_word_times(align_file)
            return align_tokens(decode, tokens, words, "reference", {"file": str(align_file)})
        if mode == "reference":
            raise AlignmentError(f"{clip.path}: no reference alignment (<stem>.words.json/.tsv)")
        aligner = self._whisper_aligner()
        if aligner is None:
            return None
        return align_tokens(decode, tokens, aligner.words(clip.samples), aligner.source,
                            {"model": str(aligner.model_dir)})

    # ------------------------------------------------------------------ one input
    def trace_one(self, audio: Path, out: Path, single: bool,
                  on_step: Callable[[int], None] | None = None) -> InputResult:
        t0 = time.perf_counter()
        bb = self.backbone
        clip = load_audio(audio, bb.sample_rate)
        bb.check_length(clip, self.cfg.options.max_new_tokens)
        align_file, reference_text = self.references(audio, single)
        prepared = bb.prepare(clip, self.cfg.options.prompt)
        gen = generate_traced(bb, prepared, self.cfg.options, on_step)
        alignment = self.align(clip, gen.tokens, align_file)
        data = build_trace(bb, clip, gen, self.cfg.options, alignment, reference_text)
        path = write_trace(out, data)
        nbytes = sum(f.stat().st_size for f in path.iterdir())
        return InputResult(audio, "traced", trace=path, audio_s=clip.duration_s,
                           tokens=len(gen.tokens), bytes=nbytes,
                           seconds=time.perf_counter() - t0)


def run_batch(inputs: list[Path], cfg: BatchConfig, console: Console | None = None,
              run: RunDir | None = None) -> list[InputResult]:
    """Trace every input; never stops on a bad input (its reason is in the result). With
    ``run``, each input is recorded in its manifest as soon as it is done or has failed."""
    console = console or Console(stderr=True)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    tracer = Tracer(cfg, console)
    results: list[InputResult] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task_in = progress.add_task("inputs", total=len(inputs))
        task_tok = progress.add_task("tokens", total=cfg.options.max_new_tokens, visible=False)
        for audio in inputs:
            name = trace_name(audio, inputs)
            out = cfg.out_dir / name
            progress.update(task_in, description=f"inputs ({escape(audio.name)})")
            clean_stale(cfg.out_dir, name)
            if out.exists() and not cfg.overwrite and is_complete(out):
                results.append(_skipped(audio, out))
                _record(run, results[-1])
                progress.advance(task_in)
                continue
            progress.reset(task_tok, total=cfg.options.max_new_tokens, visible=True)
            try:
                res = tracer.trace_one(
                    audio, out, single=len(inputs) == 1,
                    on_step=lambda i: progress.update(task_tok, completed=i + 1))
            except (AudioError, AlignmentError) as exc:
                res = InputResult(audio, "failed", str(exc))
            except Exception as exc:  # one bad input must not stop the batch
                if _fatal(exc):
                    raise
                msg = str(exc).splitlines()[0] if str(exc) else ""
                res = InputResult(audio, "failed", f"{type(exc).__name__}: {msg}")
            results.append(res)
            _record(run, res)
            if res.status == "failed":
                console.print(f"[red]failed[/] {escape(str(audio))}: {escape(res.reason)}")
            progress.update(task_tok, visible=False)
            progress.advance(task_in)
    return results


def _record(run: RunDir | None, res: InputResult) -> None:
    """Note one finished input in the run manifest (traces themselves are written atomically)."""
    if run is None:
        return
    if res.status == "failed":
        run.failed(str(res.path), f"{res.path}: {res.reason}")
    else:
        run.done(str(res.path), None, status=res.status,
                 trace=res.trace.name if res.trace else None, tokens=res.tokens)


def _fatal(exc: Exception) -> bool:
    """Errors that concern the whole run (the model cannot load), not one input."""
    from kvsim.tracer.backbones import BackboneError

    return isinstance(exc, BackboneError)


def _skipped(audio: Path, out: Path) -> InputResult:
    from kvsim.trace import Trace

    t = Trace(out)
    return InputResult(audio, "skipped", "complete trace exists", trace=out,
                       audio_s=float(t.meta.audio.get("duration_s", 0.0)),
                       tokens=t.meta.n_decode + 1, bytes=t.disk_bytes())


def summary_table(results: list[InputResult], wall_s: float) -> Table:
    """The closing summary: inputs, audio minutes, tokens, trace MB, wall time, failures."""
    done = [r for r in results if r.status != "failed"]
    failed = [r for r in results if r.status == "failed"]
    t = Table(title="kvsim trace: summary", show_header=False)
    t.add_row("inputs", f"{len(results)} ({sum(r.status == 'traced' for r in results)} traced, "
                        f"{sum(r.status == 'skipped' for r in results)} already complete, "
                        f"{len(failed)} failed)")
    t.add_row("audio", f"{sum(r.audio_s for r in done) / 60:.2f} min")
    t.add_row("generated tokens", str(sum(r.tokens for r in done)))
    t.add_row("trace size", f"{sum(r.bytes for r in done) / 1e6:.2f} MB")
    t.add_row("wall time", f"{wall_s:.1f} s")
    for r in failed:
        t.add_row("[red]failed[/]", escape(f"{r.path}: {r.reason}"))
    return t
