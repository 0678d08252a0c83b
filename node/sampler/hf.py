"""Sampler on Hugging Face transformers: batched, left-padded, KV-cached decoding.

Each step runs the base model (its output is the final-norm hidden state), applies the LM
head to the last position only, and picks every row's token with seeded Gumbel-max
(`seeded.py`), so tokens, logprobs and hidden states come out of one pass with no extra
forward. Rows that finish keep decoding a pad token (masked) until the batch is done.
A chunk holds whole groups (a prompt's n rows) where they fit; each distinct prompt in it is
prefilled once and its KV cache repeated for its rows.
"""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path
from typing import Any

import torch

from ...protocol.messages import SamplingParams
from ..errors import NodeError
from ..runtime import BatchLimit
from .base import Prompt, Sample, Sampler, check_seeds, default_seeds
from .seeded import choose_tokens, gumbel_rows

# Small vocabularies: the noise of every step is computed up front in one pass (a few int64
# tensor ops over [steps, batch, vocab]) when it holds at most this many values; per-op
# overhead would otherwise dominate. Large vocabularies compute it per step, pruned.
NOISE_BLOCK_MAX = 1 << 21
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import DynamicCache

from .stops import context_limit, model_eos_ids


class HFSampler(Sampler):
    def __init__(self, model, tokenizer, *, peer_id: str = "", max_context: int | None = None,
                 capture_hidden: bool = True, max_batch: int | BatchLimit = 64,
                 version: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.peer_id = peer_id
        self.version = version
        self.capture_hidden = capture_hidden
        # sequences decoded at once; an out-of-memory retry halves it (roles/base.py)
        self.batch = max_batch if isinstance(max_batch, BatchLimit) \
            else BatchLimit("sampler.max_batch", max_batch)
        # shared with the verifier (stops.py): same EOS set, same context limit
        self.max_context = context_limit(model.config, max_context)
        self.eos_ids = set(model_eos_ids(model, tokenizer))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else tokenizer.eos_token_id
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head = model.get_output_embeddings()
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # cumulative seconds: whole generate calls, token choice (noise included), the noise
        # computed up front (small vocabularies), hidden-state capture
        self.timings = {"generate_s": 0.0, "pick_s": 0.0, "noise_s": 0.0, "capture_s": 0.0}

    @property
    def max_batch(self) -> int:
        return self.batch.value

    def time_spent(self) -> dict[str, float]:
        """`generate` (whole calls), `pick` (token choice, noise included), `noise` (computed
        up front), `capture` (hidden states), in seconds."""
        return {k.removesuffix("_s"): v for k, v in self.timings.items()}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # generation ---------------------------------------------------------------------------

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams,
                 seeds: list[list[int]] | None = None) -> list[list[Sample]]:
        if n < 1:
            raise NodeError("n must be >= 1")
        seeds = seeds if seeds is not None else default_seeds(self, prompts, n)
        check_seeds(prompts, n, seeds)
        for ref, ids in prompts:
            if len(ids) == 0:
                raise NodeError(f"prompt of task {ref.dataset}#{ref.index} is empty")
            if len(ids) >= self.max_context:
                raise NodeError(f"prompt of task {ref.dataset}#{ref.index} has {len(ids)} tokens;"
                                f" the context holds {self.max_context}")
        started = time.perf_counter()
        out: list[list[Sample | None]] = [[None] * n for _ in prompts]
        size = self.batch.value  # read once: a retry after OOM halves it between calls
        for chunk in group_chunks([len(ids) for _, ids in prompts], n, size):
            samples = self._generate_rows([prompts[i] for i, _ in chunk],
                                          [seeds[i][j] for i, j in chunk], params)
            for (i, j), s in zip(chunk, samples):
                out[i][j] = s
        self.timings["generate_s"] += time.perf_counter() - started
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def _generate_rows(self, prompts: list[Prompt], seeds: list[int],
                       params: SamplingParams) -> list[Sample]:
        """Decode one row per (prompt, seed). Rows with the same prompt ids share one
        prefill: each distinct prompt is prefilled once (left-padded to the longest), then
        its KV cache, attention mask, positions and first-step hidden state and logits are
        repeated for each of its rows; every row still picks its tokens with its own seed."""
        device = self.device
        b = len(prompts)
        first: dict[tuple[int, ...], int] = {}  # prompt ids -> index among distinct prompts
        row_of = [first.setdefault(tuple(ids), len(first)) for _, ids in prompts]
        distinct = list(first)
        u = len(distinct)
        width = max(len(ids) for ids in distinct)
        max_new = min(params.max_new_tokens, self.max_context - width)
        input_ids = torch.full((u, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((u, width), dtype=torch.long)
        for r, ids in enumerate(distinct):
            input_ids[r, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            mask[r, width - len(ids):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        step_pos = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.model.config)
        out = self.decoder(input_ids=input_ids, attention_mask=mask, position_ids=step_pos,
                           use_cache=True, **{self._cache_kw: cache})
        last = out.last_hidden_state[:, -1, :]
        logits = self.lm_head(last)
        del out  # the prefill's [U, P, H] output
        if row_of != list(range(b)):  # some prompt has several rows: repeat its state
            index = torch.tensor(row_of, dtype=torch.long, device=device)
            cache.reorder_cache(index)
            mask, step_pos = mask.index_select(0, index), step_pos.index_select(0, index)
            last, logits = last.index_select(0, index), logits.index_select(0, index)
        tokens = [[] for _ in range(b)]
        logps = [[] for _ in range(b)]
        hiddens = [[] for _ in range(b)]
        finish = ["length"] * b
        done = [False] * b
        noise_block = self._noise_block(seeds, max_new, params)
        seeds_t = torch.tensor(seeds, dtype=torch.long, device=device)
        for t in range(max_new):
            t0 = time.perf_counter()
            chosen, chosen_lp = choose_tokens(
                logits, seeds_t, torch.full_like(seeds_t, t), params,
                noise_rows=noise_block[t] if noise_block is not None else None)
            chosen_cpu, lp_cpu = chosen.cpu(), chosen_lp.cpu()
            t1 = time.perf_counter()
            # a copy, so no row view keeps a step's whole output alive
            hid_cpu = last.to("cpu", torch.float32, copy=True) if self.capture_hidden else None
            self.timings["pick_s"] += t1 - t0
            self.timings["capture_s"] += time.perf_counter() - t1
            for r in range(b):
                if done[r]:
                    continue
                tok = int(chosen_cpu[r])
                tokens[r].append(tok)
                logps[r].append(float(lp_cpu[r]))
                if hid_cpu is not None:
                    hiddens[r].append(hid_cpu[r])
                if tok in self.eos_ids:
                    done[r], finish[r] = True, "eos"
            if all(done) or t == max_new - 1:
                break
            feed = torch.tensor([self.pad_id if done[r] else tokens[r][-1] for r in range(b)],
                                dtype=torch.long, device=device)
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=device)], dim=1)
            out = self.decoder(input_ids=feed.unsqueeze(1), attention_mask=mask,
                               position_ids=step_pos, use_cache=True,
                               **{self._cache_kw: cache})
            last = out.last_hidden_state[:, -1, :]
            logits = self.lm_head(last)
        t0 = time.perf_counter()
        stacked = [(torch.stack(h) if h else torch.zeros((0, last.shape[-1])))
                   if self.capture_hidden else None for h in hiddens]
        self.timings["capture_s"] += time.perf_counter() - t0
        samples = []
        for r, (ref, ids) in enumerate(prompts):
            hidden = stacked[r]
            samples.append(Sample(
                task=ref, prompt_ids=list(ids), completion_ids=tokens[r],
                logprobs=torch.tensor(logps[r], dtype=torch.float32), finish_reason=finish[r],
                seed=seeds[r], text=self.tokenizer.decode(tokens[r], skip_special_tokens=True),
                hidden=hidden, policy_version=self.version))
        return samples

    def _noise_block(self, seeds: list[int], steps: int,
                     params: SamplingParams) -> torch.Tensor | None:
        """Noise [steps, B, V] for every step at once, when it is small enough."""
        vocab = self.lm_head.weight.shape[0]
        if params.temperature == 0 or steps * len(seeds) * vocab > NOISE_BLOCK_MAX:
            return None
        t0 = time.perf_counter()
        rows = gumbel_rows([s for _ in range(steps) for s in seeds],
                           [t for t in range(steps) for _ in seeds], vocab, self.device)
        self.timings["noise_s"] += time.perf_counter() - t0
        return rows.view(steps, len(seeds), vocab)

    # weights ------------------------------------------------------------------------------

    def load_weights(self, path_or_state: str | os.PathLike | dict[str, Any],
                     version: int | None = None) -> None:
        state = path_or_state if isinstance(path_or_state, dict) else \
            read_state_dict(path_or_state)
        apply_state_dict(self.model, state)
        self.version = self.version + 1 if version is None else int(version)


def group_chunks(lens: list[int], n: int, size: int) -> list[list[tuple[int, int]]]:
    """Rows (prompt i, completion j) in chunks of at most `size`. Where a group (a prompt's
    n rows) fits in a chunk, chunks hold whole groups, so a prompt is prefilled once;
    otherwise rows fill chunks in turn. Prompts go in order of length, so a chunk pads
    little."""
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    rows = [(i, j) for i in order for j in range(n)]
    if n > size:
        return [rows[k:k + size] for k in range(0, len(rows), size)]
    per = size // n  # whole groups per chunk
    return [rows[k:k + per * n] for k in range(0, len(rows), per * n)]


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, or of every *.safetensors file in a directory."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not files[0].exists():
        raise NodeError(f"checkpoint {path} has no .safetensors file")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:  # a truncated or corrupt file
            raise NodeError(f"checkpoint file {f} is corrupt or unreadable: {e}") from None
    return state


def apply_state_dict(model, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into `model` in place; names and shapes must match (tied weights may be
    absent)."""
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise NodeError(f"checkpoint has tensors the model lacks: {unknown[:5]}")
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(own) - set(state) - tied)
    if missing:
        raise NodeError(f"checkpoint lacks tensors of the model: {missing[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise NodeError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                            f"the model needs {tuple(own[name].shape)}")
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor.to(own[name].dtype))
