"""Minimal LoRA (Hu et al., 2021) for training; merged into plain ``nn.Linear`` for inference.

Merging keeps the decoder a stock ``LlamaModel`` at inference (the tracer's attention hooks
see the unmodified transformers modules).
"""

from __future__ import annotations

import math

import torch
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(x))`` with ``base`` frozen and ``B`` initialised to zero."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.rank = rank
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale


def add_lora(decoder: nn.Module, rank: int, alpha: float,
             targets: tuple[str, ...] = DEFAULT_TARGETS) -> list[str]:
    """Wrap every ``nn.Linear`` named in ``targets`` inside ``decoder``; returns their names."""
    names = []
    for name, module in list(decoder.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                setattr(module, child_name, LoRALinear(child, rank, alpha))
                names.append(f"{name}.{child_name}" if name else child_name)
    return names


def lora_state(decoder: nn.Module) -> dict[str, torch.Tensor]:
    """``{"<module>.lora_A": A, "<module>.lora_B": B * scale}`` for every LoRA module."""
    out = {}
    for name, m in decoder.named_modules():
        if isinstance(m, LoRALinear):
            out[f"{name}.lora_A"] = m.lora_A.detach().clone()
            out[f"{name}.lora_B"] = (m.lora_B.detach() * m.scale).clone()
    return out


def load_lora_state(decoder: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load factors saved by :func:`lora_state` into a decoder already wrapped by add_lora."""
    mods = dict(decoder.named_modules())
    for key, val in state.items():
        name, which = key.rsplit(".", 1)
        m = mods.get(name)
        if not isinstance(m, LoRALinear):
            raise KeyError(f"adapter tensor {key}: no LoRA module {name}")
        with torch.no_grad():
            if which == "lora_A":
                m.lora_A.copy_(val)
            else:
                m.lora_B.copy_(val / m.scale)


def merge_lora(decoder: nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Add ``B @ A`` (scale folded into B) to the plain ``nn.Linear`` weights; returns count."""
    mods = dict(decoder.named_modules())
    n = 0
    for key in state:
        if not key.endswith(".lora_A"):
            continue
        name = key[: -len(".lora_A")]
        lin = mods.get(name)
        if not isinstance(lin, nn.Linear):
            raise KeyError(f"adapter tensor {key}: decoder has no linear layer {name}")
        a = state[key].to(torch.float32)
        b = state[f"{name}.lora_B"].to(torch.float32)
        with torch.no_grad():
            lin.weight += (b @ a).to(lin.weight.dtype)
        n += 1
    return n


def unwrap_lora(decoder: nn.Module) -> None:
    """Replace every LoRALinear by its merged plain ``nn.Linear`` (in place)."""
    for _name, module in list(decoder.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                with torch.no_grad():
                    child.base.weight += (child.lora_B @ child.lora_A) * child.scale
                setattr(module, child_name, child.base)
