"""Measure the host cost of eager Hugging Face decode steps (no GPU needed).

The WnW paper's ~27 ms/token on a 3B model is far above the HBM floor: eager decoding is
host-bound (docs/simulator.md). This probe measures the host side directly: it
builds Llama decoders with the target layer layout but tiny widths and a short context (so
arithmetic and memory traffic are negligible), times greedy decode steps on one CPU thread,
and counts the ATen operators a step dispatches. Two depths separate the per-layer cost from
the per-step cost outside the layers; ``model.generate`` vs a bare forward loop gives the
generate loop's own overhead.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from kvsim.hf import cache_keyword

_VIEW_OPS = {
    "view", "_unsafe_view", "transpose", "t", "unsqueeze", "squeeze", "expand", "slice",
    "select", "reshape", "permute", "alias", "as_strided", "detach", "lift_fresh", "split",
    "unbind", "_reshape_alias", "contiguous", "size", "sym_size", "is_same_size",
    "_local_scalar_dense",
}


@dataclass(frozen=True)
class HostProbeResult:
    """Host cost of eager decode (microseconds), measured on this machine's CPU."""

    attn_implementation: str
    device: str
    n_layers: int
    ops_per_layer: float
    kernels_per_layer: float
    step_ops: float
    host_us_per_op: float
    step_fixed_us: float
    step_ms_forward: float
    step_ms_generate: float
    torch_version: str
    transformers_version: str
    cpu: str

    def to_json(self) -> dict:
        return asdict(self)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def _build(n_layers: int, n_q: int, n_kv: int, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=n_q * 8, intermediate_size=64, num_hidden_layers=n_layers,
        num_attention_heads=n_q, num_key_value_heads=n_kv, head_dim=8,
        max_position_embeddings=4096,
    )
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


def _forward_loop(model, ctx: int, steps: int):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import DynamicCache

    ids = torch.randint(0, 256, (1, ctx), device=model.device)
    cache_kw = cache_keyword(model)  # outside the timed steps
    cache = DynamicCache()  # filled in place by every forward below
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **{cache_kw: cache})
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=tok, use_cache=True, **{cache_kw: cache})
            tok = out.logits[:, -1:].argmax(-1)
            _ = int(tok)
            times.append(time.perf_counter() - t0)
        counts: dict[str, int] = {}

        class _Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                counts[name] = counts.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        with _Count():
            out = model(input_ids=tok, use_cache=True, **{cache_kw: cache})
            _ = int(out.logits[:, -1:].argmax(-1))
    times.sort()
    n_ops = sum(counts.values())
    n_kern = sum(v for k, v in counts.items() if k not in _VIEW_OPS)
    return times[len(times) // 2] * 1e6, n_ops, n_kern


def _generate_us(model, ctx: int, steps: int) -> float:
    import torch

    ids = torch.randint(0, 256, (1, ctx), device=model.device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False)
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            t2 = time.perf_counter()
            best = min(best, ((t1 - t0) - (t2 - t1)) / steps)
    return best * 1e6


def probe_hf_eager(
    n_layers: int = 30, n_q_heads: int = 32, n_kv_heads: int = 8, attn: str = "sdpa",
    context_tokens: int = 32, steps: int = 30, device: str = "cpu", repeats: int = 3,
) -> HostProbeResult:
    """Measure eager decode host cost for a layer layout (Voxtral-mini-3b: 30, 32, 8).

    ``host_us_per_op`` = (step time of the deep model - of a 2-layer model) / (ops difference):
    the per-operator Python + dispatcher cost, including a tiny CPU kernel that a GPU run
    replaces by a launch (so it slightly overestimates the GPU host cost per op). With
    ``device='cuda'`` the same number includes the launch: it is the GPU host cost per op.
    """
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    deep = _build(n_layers, n_q_heads, n_kv_heads, attn).to(device)
    shallow = _build(2, n_q_heads, n_kv_heads, attn).to(device)
    # min over repeats of the median step: robust to other processes sharing the CPU
    t_deep, ops_deep, k_deep = min(_forward_loop(deep, context_tokens, steps) for _ in range(repeats))
    t_sh, ops_sh, k_sh = min(_forward_loop(shallow, context_tokens, steps) for _ in range(repeats))
    per_layer_ops = (ops_deep - ops_sh) / (n_layers - 2)
    per_layer_k = (k_deep - k_sh) / (n_layers - 2)
    us_per_op = (t_deep - t_sh) / (ops_deep - ops_sh)
    step_ops = ops_deep - per_layer_ops * n_layers
    gen = _generate_us(deep, context_tokens, steps)
    return HostProbeResult(
        attn_implementation=attn, device=device, n_layers=n_layers, ops_per_layer=per_layer_ops,
        kernels_per_layer=per_layer_k, step_ops=step_ops, host_us_per_op=us_per_op,
        step_fixed_us=max(gen - t_deep, 0.0), step_ms_forward=t_deep / 1e3,
        step_ms_generate=gen / 1e3, torch_version=torch.__version__,
        transformers_version=transformers.__version__, cpu=_cpu_name(),
    )
