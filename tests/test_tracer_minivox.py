"""The minivox adapter through the CLI (runs once ``minivox/`` is in the checkout)."""

from __future__ import annotations

import math
import shutil
import subprocess

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.trace.validate import validate_trace
from kvsim.tracer.audio import load_audio
from kvsim.tracer.backbones import LoadOptions, PromptSpec, load_backbone
from kvsim.tracer.run import greedy_kwargs

pytest.importorskip("kvsim.minivox", reason="minivox is not in this checkout")
pytestmark = [pytest.mark.slow, pytest.mark.speech]
torch.set_num_threads(1)


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")
def test_minivox_trace_exact(tmp_path):
    wav = tmp_path / "s.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "the cat sat on the mat"], check=True)
    res = CliRunner().invoke(app, ["trace", str(wav), "--model", "minivox", "--out",
                                   str(tmp_path / "t"), "--max-new-tokens", "5",
                                   "--store-dtype", "float32", "--aligner", "none"])
    assert res.exit_code == 0, res.output
    tr = validate_trace(tmp_path / "t" / "s.kvtrace")
    m = tr.meta.model
    assert (m.n_layers, m.n_q_heads, m.n_kv_heads, m.head_dim) == (30, 9, 3, 64)
    assert tr.n_audio == 375 and m.audio_tokens_per_s == 12.5
    bb = load_backbone("minivox", LoadOptions(trace_attention=False))
    prep = bb.prepare(load_audio(wav, 16000), PromptSpec())
    assert np.array_equal(tr.audio_positions, np.flatnonzero(prep.input_ids == bb.audio_token_id))
    bb.model.set_attn_implementation("eager")
    with torch.no_grad():
        out = bb.model.generate(**prep.inputs, **greedy_kwargs(5), output_attentions=True,
                                return_dict_in_generate=True)
    assert out.sequences[0, prep.n_prompt:].tolist() == \
        tr.meta.provenance["generation"]["token_ids"]
    g = m.n_q_heads // m.n_kv_heads
    n0 = tr.meta.n_prefill
    worst = 0.0
    for layer in (0, m.n_layers // 2, m.n_layers - 1):
        K = np.asarray(tr.keys(layer), np.float64)
        Q = np.asarray(tr.queries(layer), np.float64)
        for row, pos in enumerate(tr.query_positions):
            step = 0 if pos < n0 else pos - n0 + 1
            eager = out.attentions[step][layer][0].double().numpy()[:, pos if step == 0 else 0,
                                                                    : pos + 1]
            for h in range(m.n_q_heads):
                s = K[h // g, : pos + 1] @ Q[h, row] / math.sqrt(m.head_dim)
                p = np.exp(s - s.max())
                worst = max(worst, float(np.abs(p / p.sum() - eager[h]).max()))
    assert worst < 1e-5
