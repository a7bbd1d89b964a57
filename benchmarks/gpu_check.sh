#!/usr/bin/env bash
# GPU check of the tracer (for the `device` tool; < 8 min): tiny Voxtral and Qwen2.5-Omni
# thinker checkpoints, CUDA, bf16 and fp32. Reports
#   1. traced / plain generate time (benchmarks/trace_overhead.py, bf16, 10 s clip, 32 tokens),
#   2. exactness: token identity with/without tracing, and attention recomputed from the trace
#      vs eager attention at prefill and every decode step (fp32: must be < 1e-5; bf16: reported).
#
# Preparation on the CPU machine (the GPU image lacks these packages; see
# the GPU machine's instructions): download py3.12 manylinux wheels into .whl/ for
#   polars polars-runtime-32 soundfile cffi pycparser soxr
#   (and for Voxtral: mistral-common pydantic pydantic-core pydantic-extra-types pycountry
#   jsonschema referencing rpds-py jsonschema-specifications annotated-types typing-inspection)
# with kvsim itself (`pip wheel --no-deps -w .whl .`), and run with carry [".whl"]:
#   bash benchmarks/gpu_check.sh
# DEVICE=cpu runs the same checks on the CPU (dry run of this script).
# Voxtral is skipped (and said so) when mistral-common cannot be imported there.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
. benchmarks/_device_env.sh
device_env python3 "${OUT:-/tmp/gpu_check}" kvsim.tracer || exit 3
# the test fixtures (tiny checkpoints) from the source tree, after the installed kvsim
export PYTHONPATH=${PYTHONPATH:-}:$REPO
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 - <<'PY' 2>&1 | tee "$OUTDIR/gpu_check.log"
import math, os, sys, tempfile, time
from pathlib import Path
import numpy as np, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
import transformers; print("transformers", transformers.__version__)
from tests.fixtures.checkpoints import tiny_checkpoint, write_tone
from kvsim.tracer.audio import load_audio
from kvsim.tracer.backbones import LoadOptions, PromptSpec, load_backbone
from kvsim.tracer.run import TraceOptions, build_trace, generate_traced, greedy_kwargs
from kvsim.trace import write_trace
from kvsim.trace.validate import validate_trace

DEVICE = os.environ.get("DEVICE", "cuda")
tmp = Path(tempfile.mkdtemp())
kinds = ["qwen-omni"]
try:
    import mistral_common  # noqa: F401
    kinds.insert(0, "voxtral")
except ImportError:
    print("SKIP voxtral: mistral-common not importable on this machine")
wav = write_tone(tmp / "clip.wav", 10.0)
ok = True
for kind in kinds:
    ckpt = str(tiny_checkpoint(kind, tmp))
    for dtype in ("float32", "bfloat16"):
        t0 = time.time()
        bb = load_backbone(ckpt, LoadOptions(device=DEVICE, dtype=dtype))
        print(f"[{kind} {dtype}] processor: {bb.processor_note}")
        clip = load_audio(wav, bb.sample_rate)
        prep = bb.prepare(clip, PromptSpec())
        opts = TraceOptions(max_new_tokens=16, storage_dtype="float32")
        gen = generate_traced(bb, prep, opts)
        tr = validate_trace(write_trace(tmp / f"{kind}-{dtype}", build_trace(bb, clip, gen, opts, None, None)))
        ref = load_backbone(ckpt, LoadOptions(device=DEVICE, dtype=dtype, trace_attention=False))
        with torch.no_grad():
            plain = ref.model.generate(**prep.inputs, **greedy_kwargs(16))[0, prep.n_prompt:].tolist()
        ref.model.set_attn_implementation("eager")
        with torch.no_grad():
            out = ref.model.generate(**prep.inputs, **greedy_kwargs(16), output_attentions=True,
                                     return_dict_in_generate=True)
        m = tr.meta.model; g = m.n_q_heads // m.n_kv_heads; n0 = tr.meta.n_prefill
        worst = 0.0
        for layer in range(m.n_layers):
            K = torch.tensor(np.asarray(tr.keys(layer)), dtype=torch.float64)
            Q = torch.tensor(np.asarray(tr.queries(layer)), dtype=torch.float64)
            for row, pos in enumerate(tr.query_positions):
                step = 0 if pos < n0 else pos - n0 + 1
                if step >= len(out.attentions):
                    continue
                e = out.attentions[step][layer][0].double().cpu()[:, pos if step == 0 else 0, : pos + 1]
                s = torch.einsum("hd,hnd->hn", Q[:, row], K[torch.arange(m.n_q_heads) // g, : pos + 1])
                p = torch.softmax(s / math.sqrt(m.head_dim), dim=-1)
                worst = max(worst, float((p - e).abs().max()))
        same = plain == gen.tokens
        eager_same = out.sequences[0, prep.n_prompt:].tolist() == gen.tokens
        verdict = "PASS" if (same and (dtype != "float32" or worst < 1e-5)) else "FAIL"
        ok &= verdict == "PASS"
        print(f"[{kind} {dtype}] tokens identical to plain sdpa: {same}; to eager: {eager_same}; "
              f"max |attention(trace) - eager| = {worst:.2e}; {verdict} ({time.time() - t0:.1f} s)")
# Qwen-Omni: the real Qwen2_5OmniProcessor (torchvision is on the GPU image) against the
# audio-only fallback used where torchvision is missing, on 35 s (no 30 s truncation).
from kvsim.tracer.backbones.qwen_omni import OmniAudioProcessor
ck = str(tiny_checkpoint("qwen-omni", tmp))
bb = load_backbone(ck, LoadOptions(device=DEVICE))
clip35 = load_audio(write_tone(tmp / "long.wav", 35.0), bb.sample_rate)
p_real = bb.prepare(clip35, PromptSpec())
note = bb.processor_note
bb.processor = OmniAudioProcessor(ck)
p_fb = bb.prepare(clip35, PromptSpec())
same = bool(np.array_equal(p_real.input_ids, p_fb.input_ids) and torch.allclose(
    p_real.inputs["input_features"].float().cpu(), p_fb.inputs["input_features"].float().cpu()))
n35 = len(p_real.audio_positions)
print(f"[qwen-omni processor] {note}: {n35} audio tokens for 35 s (expect 875); "
      f"fallback prompt and features identical: {same}")
ok &= abs(n35 - 875) <= 1 and same
print("EXACTNESS", "PASS" if ok else "FAIL")
PY
python3 "$REPO/benchmarks/trace_overhead.py" --device "${DEVICE:-cuda}" --dtype bfloat16 --repeats 5 2>&1 \
  | grep -v -E "Loading|Writing" | tee "$OUTDIR/overhead.log"
