"""minivox on real human speech that ships inside packages (no download at run time).

Usage::

    python scripts/human_speech.py [--list] [--paths FILE[=REFERENCE] ...] [--out R.jsonl] [--whisper]

Finds the recordings below in the installed packages (a missing package is reported and
skipped), adds any ``--paths`` (``.wav``/``.flac`` at any rate, ``.raw`` = 16 kHz s16le mono;
``FILE=reference text`` gives a reference), transcribes each with the shipped minivox,
full cache, greedy (``--whisper``: with Whisper tiny.en, minivox's encoder with its own
decoder), and prints per-clip truncated WER (:mod:`kvsim.wer`, WnW §3.5: periods kept) and
the same with periods dropped from both texts (the package references have no punctuation),
then the corpus WER per source.

| source | package | licence | files | reference |
|---|---|---|---|---|
| ``librivox`` | Debian ``pocketsphinx-testdata`` | BSD-2 (CMU); the recordings are LibriVox, public domain | 5 sentences of *Sense and Sensibility* read by a LibriVox volunteer, 3.0-7.1 s | ``librivox/transcription`` |
| ``cards`` | Debian ``pocketsphinx-testdata`` | BSD-2 (CMU) | 5 spoken card names, 1.1-3.5 s | ``cards/cards.transcription`` |
| ``goforward`` | Debian ``pocketsphinx-testdata`` | BSD-2 (CMU) | ``goforward.raw``, 2.8 s | "go forward ten meters" (pocketsphinx's README and tests) |
| ``alsa`` | Debian ``alsa-utils`` | GPL-2 | 8 speaker-test prompts (``Front_Left.wav`` ...), 1.3-1.5 s | the file name |
| ``pyannote`` | PyPI ``pyannote.audio`` wheel | MIT | ``pyannote/audio/sample/sample.wav``, 30 s, two speakers on a telephone line | ``sample.stm`` |

Install them with ``apt-get install pocketsphinx-testdata alsa-utils`` and
``pip install --no-deps pyannote.audio==4.0.7`` (the wheel's files are all this needs).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PS_DATA = Path("/usr/share/pocketsphinx/test/data")
ALSA_SOUNDS = Path("/usr/share/sounds/alsa")


@dataclass
class Clip:
    source: str
    package: str
    path: Path
    reference: str | None


def _debian_version(package: str) -> str | None:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", package],
                             capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _sphinx_transcription(path: Path) -> dict[str, str]:
    """``<s> words </s> (id)`` lines -> {id: words}."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*(?:<s>)?(.*?)(?:</s>)?\s*\(([^)]+)\)\s*$", line)
        if m:
            out[m.group(2)] = " ".join(m.group(1).split())
    return out


def find_clips() -> tuple[list[Clip], list[str]]:
    """The known recordings present on this machine, and a note for each source missing."""
    clips: list[Clip] = []
    missing: list[str] = []
    v = _debian_version("pocketsphinx-testdata")
    if v and PS_DATA.is_dir():
        pkg = f"pocketsphinx-testdata {v}"
        refs = _sphinx_transcription(PS_DATA / "librivox" / "transcription")
        for cid, ref in sorted(refs.items()):
            clips.append(Clip("librivox", pkg, PS_DATA / "librivox" / f"{cid}.wav", ref))
        refs = _sphinx_transcription(PS_DATA / "cards" / "cards.transcription")
        for cid, ref in sorted(refs.items()):
            clips.append(Clip("cards", pkg, PS_DATA / "cards" / f"{cid}.wav", ref))
        clips.append(Clip("goforward", pkg, PS_DATA / "goforward.raw", "go forward ten meters"))
    else:
        missing.append("librivox, cards, goforward: apt-get install pocketsphinx-testdata")
    v = _debian_version("alsa-utils")
    if v and ALSA_SOUNDS.is_dir():
        for f in sorted(ALSA_SOUNDS.glob("*.wav")):
            if f.stem != "Noise":
                clips.append(Clip("alsa", f"alsa-utils {v}", f, f.stem.replace("_", " ")))
    else:
        missing.append("alsa: apt-get install alsa-utils")
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        dist = distribution("pyannote.audio")
        wav = Path(dist.locate_file("pyannote/audio/sample/sample.wav"))
        stm = wav.with_suffix(".stm")
        if not (wav.is_file() and stm.is_file()):
            raise PackageNotFoundError("pyannote.audio (no sample/)")
        # STM: session channel speaker start end words...; the reference is every turn in order
        turns = [ln.split(maxsplit=5) for ln in stm.read_text().splitlines() if ln.strip()]
        ref = " ".join(t[5] for t in sorted(turns, key=lambda t: float(t[3])) if len(t) > 5)
        clips.append(Clip("pyannote", f"pyannote.audio {dist.version}", wav, ref))
    except PackageNotFoundError:
        missing.append("pyannote: pip install --no-deps pyannote.audio==4.0.7")
    return clips, missing


def load_audio(path: Path) -> np.ndarray:
    """16 kHz mono float32 (``.raw``: 16 kHz s16le mono)."""
    from math import gcd

    import soundfile as sf
    from scipy.signal import resample_poly

    if path.suffix == ".raw":
        return np.fromfile(path, dtype="<i2").astype(np.float32) / 32768.0
    audio, sr = sf.read(path, dtype="float32", always_2d=True)
    audio = audio.mean(axis=1)
    if sr != 16000:
        g = gcd(sr, 16000)
        audio = resample_poly(audio, 16000 // g, sr // g).astype(np.float32)
    return audio


def without_periods(text: str) -> str:
    return text.replace(".", " ")


def minivox_transcriber(adapter: Path | None):
    """``(audio -> (transcript, generated tokens), tokenizer)`` of minivox: full cache, greedy."""
    import torch

    from kvsim.minivox import load_minivox, minivox_dir

    torch.set_num_threads(1)
    model, proc = load_minivox(minivox_dir(adapter))

    def transcribe(audio: np.ndarray) -> tuple[str, int]:
        inp = proc(audio=audio)
        n_in = inp["input_ids"].shape[1]
        # ~3 words/s of speech at ~1.4 tokens/word, x1.7 headroom (truncation keeps 1.2x)
        max_new = int(audio.size / 16000 * 7) + 20
        with torch.no_grad():
            out = model.generate(**inp, max_new_tokens=max_new, do_sample=False)
        return proc.decode(out[0, n_in:]).strip(), int(out.shape[1] - n_in)

    return transcribe, proc.tokenizer


def whisper_transcriber():
    """The same for Whisper tiny.en (:func:`kvsim.whisper.whisper_transcript`); its
    transcripts are truncated in minivox's tokenizer, as minivox's are."""
    from kvsim.minivox import load_processor, minivox_dir
    from kvsim.whisper import whisper_transcript

    tokenizer = load_processor(minivox_dir()).tokenizer

    def transcribe(audio: np.ndarray) -> tuple[str, int]:
        hyp = whisper_transcript(audio)
        return hyp, len(tokenizer(hyp, add_special_tokens=False)["input_ids"])

    return transcribe, tokenizer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", nargs="*", default=[],
                    help="extra recordings, FILE or FILE=reference text")
    ap.add_argument("--no-packages", action="store_true", help="only --paths")
    ap.add_argument("--list", action="store_true", help="list the clips found and stop")
    ap.add_argument("--adapter", type=Path, default=None, help="default: the shipped adapter")
    ap.add_argument("--whisper", action="store_true",
                    help="transcribe with Whisper tiny.en (minivox's encoder with its own "
                         "decoder) instead of minivox, scored the same way")
    ap.add_argument("--out", type=Path, default=None, help="per-clip JSON lines")
    a = ap.parse_args(argv)

    clips, missing = ([], []) if a.no_packages else find_clips()
    for spec in a.paths:
        path, _, ref = spec.partition("=")
        clips.append(Clip("paths", "-", Path(path), ref.strip() or None))
    for m in missing:
        print(f"missing: {m}")
    if a.list or not clips:
        for c in clips:
            print(f"{c.source}\t{c.package}\t{c.path}\t{c.reference!r}")
        return

    from kvsim.wer import average_wer, truncated_wer

    transcribe, tokenizer = whisper_transcriber() if a.whisper else minivox_transcriber(a.adapter)
    fh = a.out.open("w") if a.out else None
    per_source: dict[str, list] = {}
    for c in clips:
        audio = load_audio(c.path)
        dur = audio.size / 16000
        t0 = time.perf_counter()
        hyp, n_gen = transcribe(audio)
        wall = time.perf_counter() - t0
        rec = {"source": c.source, "package": c.package, "file": str(c.path),
               "duration": round(dur, 2), "reference": c.reference, "hyp": hyp,
               "n_gen": n_gen, "wall_s": round(wall, 1)}
        line = f"{c.source:9s} {c.path.name:48s} {dur:5.1f}s"
        if c.reference:
            s = truncated_wer(hyp, c.reference, tokenizer)
            s2 = truncated_wer(without_periods(hyp), without_periods(c.reference), tokenizer)
            rec.update(wer=s.wer, errors=s.errors, ref_words=s.ref_words,
                       wer_no_periods=s2.wer, errors_no_periods=s2.errors,
                       ref_words_no_periods=s2.ref_words)
            per_source.setdefault(c.source, []).append(rec)
            line += f"  WER {s.wer:.3f} (no periods {s2.wer:.3f})"
        print(f"{line}\n    ref: {c.reference}\n    hyp: {hyp}", flush=True)
        if fh:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
    if fh:
        fh.close()
    rows = [r for rs in per_source.values() for r in rs]
    if rows:
        print("\nsource     clips  audio   corpus WER  (no periods)  mean per clip")
        for name, rs in [*per_source.items(), ("all", rows)]:
            w = average_wer([r["errors"] for r in rs], [r["ref_words"] for r in rs])
            w2 = average_wer([r["errors_no_periods"] for r in rs],
                             [r["ref_words_no_periods"] for r in rs])
            per = np.array([r["wer"] for r in rs])
            se = per.std(ddof=1) / np.sqrt(len(per)) if len(per) > 1 else float("nan")
            audio_s = sum(r["duration"] for r in rs)
            print(f"{name:10s} {len(rs):5d} {audio_s:6.1f}s  {w:10.3f}  {w2:12.3f}  "
                  f"{per.mean():.3f} +- {se:.3f}")


if __name__ == "__main__":
    main()
