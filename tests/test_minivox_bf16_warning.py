"""The trainer's bf16 warning follows the CPU's AMX units, not oneDNN's bf16 support (an
AVX512-BF16 CPU without AMX supports bf16 and runs it slower than float32)."""

from __future__ import annotations

import pytest
import torch

from kvsim.minivox import train


@pytest.mark.parametrize(("amx", "asked", "warned"), [
    (False, True, True), (True, True, False), (False, False, False), (True, False, False)])
def test_bf16_warning_fires_only_when_asked_for_bf16_without_amx(
        monkeypatch, capsys, amx, asked, warned):
    monkeypatch.setattr(torch.cpu, "get_capabilities",
                        lambda: {"amx_bf16": amx, "avx512_bf16": True}, raising=False)
    # oneDNN supports bf16 on both kinds of CPU: the warning must not follow it
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert train.bf16_beats_fp32() is amx
    train.warn_if_bf16_slow(asked)
    out = capsys.readouterr().out
    assert ("no AMX bf16 units" in out and "--no-bf16" in out) is warned
    assert (out == "") is not warned
