"""Time minivox on one clip: prefill seconds and decode ms/token (one CPU thread).

Usage::

    python -m kvsim.minivox.bench --audio data/minivox/audio/test_long/test_long-00000.flac \\
        --seconds 120 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import soundfile as sf
import torch

from . import load_minivox, minivox_dir


def bench(audio_path: Path, seconds: float, new_tokens: int, threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    model, proc = load_minivox(minivox_dir())
    audio, sr = sf.read(audio_path, dtype="float32")
    if sr != 16000:
        raise ValueError(f"{audio_path}: sample rate {sr}, expected 16000")
    audio = audio[: int(seconds * 16000)]
    inp = proc(audio=audio)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(**inp, use_cache=True)
        t1 = time.perf_counter()
        cache = out.cache
        nxt = out.logits[:, -1:].argmax(-1)
        mask = inp["attention_mask"]
        times = []
        for _ in range(new_tokens):
            mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
            s = time.perf_counter()
            o = model(input_ids=nxt, attention_mask=mask, cache=cache, use_cache=True)
            times.append(time.perf_counter() - s)
            cache = o.cache
            nxt = o.logits[:, -1:].argmax(-1)
    times.sort()
    res = {
        "audio_s": round(audio.size / 16000, 2),
        "prompt_tokens": int(inp["input_ids"].shape[1]),
        "audio_tokens": int((inp["input_ids"] == model.config.audio_token_id).sum()),
        "prefill_s": round(t1 - t0, 3),
        "decode_ms_per_token_median": round(1000 * times[len(times) // 2], 2),
        "decode_ms_per_token_mean": round(1000 * sum(times) / len(times), 2),
        "kv_bytes_per_token_fp32": 30 * 3 * 64 * 2 * 4,
        "threads": threads,
    }
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="minivox prefill and decode timing")
    ap.add_argument("--audio", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    print(json.dumps(bench(a.audio, a.seconds, a.new_tokens, a.threads)))


if __name__ == "__main__":
    main()
