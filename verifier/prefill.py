"""The verifier's forward passes: hidden states at the positions that chose a completion's
tokens, with the prompt computed once per task group and, through `PromptCache`, its
shared prefix (a task family's system prompt) computed once per model version.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from collections import OrderedDict

import torch


@torch.inference_mode()
def prefill(model, pairs, pad_id: int = 0, with_logits: bool = True):
    """One right-padded forward over prompt + completion for each (prompt_ids,
    completion_ids) pair; returns per pair (hidden [T, H], logits [T, V] or None), fp32 on the
    CPU, at the positions P-1 .. P+T-2 whose outputs chose the completion's tokens."""
    device = next(model.parameters()).device
    seqs = [torch.cat([torch.as_tensor(list(p), dtype=torch.long),
                       torch.as_tensor(list(c), dtype=torch.long)]) for p, c in pairs]
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, x in enumerate(seqs):
        ids[r, :len(x)] = x
        mask[r, :len(x)] = 1
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    head = model.get_output_embeddings()
    out = decoder(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    results = []
    for r, (p, c) in enumerate(pairs):
        h = out.last_hidden_state[r, len(p) - 1:len(p) + len(c) - 1]
        results.append((h.float().cpu(), head(h).float().cpu() if with_logits else None))
    return results


@torch.inference_mode()
def prefill_group(model, prompt, completions, pad_id: int = 0, token_budget: int = 8192,
                  prompt_cache: PromptCache | None = None,
                  version: int = 0) -> list[torch.Tensor]:
    """The same hidden rows as `prefill` (fp32 [T, H] per completion: positions P-1 ..
    P+T-2) for completions sharing one prompt: the prompt runs once (with `prompt_cache`,
    only its part after the longest prefix cached for this model and `version`), and the
    completions' tokens 0..T-2 (the last token is never an input) run after it packed into
    one sequence, without padding: each token attends to the prompt and to its own
    completion's earlier tokens only (a block-diagonal causal mask, positions counted from
    the prompt's end for every completion), in packs of about `token_budget` tokens
    (memory). `pad_id` is unused (kept for callers; nothing is padded)."""
    del pad_id
    device = next(model.parameters()).device
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    cache_kw = _cache_kw(decoder)
    prompt = [int(x) for x in prompt]
    p = torch.as_tensor(prompt, dtype=torch.long)[None].to(device)
    if prompt_cache is not None:
        cache, last = prompt_cache.run(model, version, decoder, prompt, device)
    else:
        out = decoder(input_ids=p, use_cache=True)
        cache, last = out.past_key_values, out.last_hidden_state[0, -1:]
    seqs = [[int(x) for x in c] for c in completions]
    results: list[torch.Tensor | None] = [None] * len(seqs)
    for pack in _packs(seqs, p.shape[1], token_budget):
        fed = [seqs[i][:-1] for i in pack]
        hidden = None
        if any(fed):
            ids, positions, mask = _packed_inputs(fed, p.shape[1], model, device)
            hidden = decoder(input_ids=ids, position_ids=positions, attention_mask=mask,
                             use_cache=True,
                             **{cache_kw: copy.deepcopy(cache)}).last_hidden_state[0]
        start = 0
        for i, tokens in zip(pack, fed):
            rows = [last] + ([hidden[start:start + len(tokens)]] if tokens else [])
            results[i] = torch.cat(rows).float().cpu()
            start += len(tokens)
    return results


def _packed_inputs(fed: list[list[int]], prompt_len: int, model, device):
    """(input_ids [1, Q], position_ids [1, Q], 4D attention mask [1, 1, Q, P + Q]) for the
    completions' tokens `fed` laid end to end after a cached prompt of `prompt_len` tokens.
    The mask is boolean (True: attend) for SDPA and additive (0 / dtype min) otherwise,
    the two forms transformers passes through as a prepared 4D mask."""
    lens = [len(x) for x in fed]
    q = sum(lens)
    ids = torch.tensor([t for x in fed for t in x], dtype=torch.long)[None]
    positions = torch.cat([torch.arange(prompt_len, prompt_len + n) for n in lens])[None]
    allow = torch.zeros((q, prompt_len + q), dtype=torch.bool)
    allow[:, :prompt_len] = True
    start = prompt_len
    for n in lens:  # each completion: causal within itself, blind to the others
        allow[start - prompt_len:start - prompt_len + n, start:start + n] = torch.ones(
            (n, n), dtype=torch.bool).tril()
        start += n
    if getattr(model.config, "_attn_implementation", "sdpa") == "sdpa":
        mask = allow
    else:
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(allow.shape, dtype=dtype).masked_fill(~allow, torch.finfo(dtype).min)
    return ids.to(device), positions.to(device), mask[None, None].to(device)


def _packs(seqs: list[list[int]], prompt_len: int, token_budget: int) -> list[list[int]]:
    """Indices of `seqs`, in order, in packs of at most about `token_budget` tokens with the
    prompt (a pack's mask is Q x (P + Q): the budget bounds its memory too); a completion
    longer than the budget is a pack of its own. Packing wastes nothing on padding (the
    padded sub-batches this replaced fed 21-27% extra tokens on SmolLM2)."""
    packs: list[list[int]] = []
    size = 0
    for i, x in enumerate(seqs):
        n = max(len(x) - 1, 0)
        if packs and prompt_len + size + n <= token_budget:
            packs[-1].append(i)
            size += n
        else:
            packs.append([i])
            size = n
    return packs


def _cache_kw(decoder) -> str:
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters \
        else "past_key_values"


class PromptCache:
    """KV caches of recent prompts, per (model object, policy version), so that a prompt
    prefix shared by many tasks (the chat template and a task family's system prompt: 25 to
    110 of SmolLM2's 37 to 130 prompt tokens) is computed once, not once per task group.

    A prompt reuses the entry with the longest common prefix of at least `min_prefix`
    tokens: the entry's KV cache is copied, cropped to that prefix, and only the rest of
    the prompt runs. Under causal attention the prefix's keys and values are the same
    computation either way (up to kernel rounding, far inside the thresholds). Entries are
    keyed by version as well as by the model object, because the trainer's live model
    changes its weights when its version changes; a weak reference guards against a freed
    model's id being reused. At most `max_entries` prompts and `max_tokens` prompt tokens are
    kept (LRU)."""

    def __init__(self, max_entries: int = 16, min_prefix: int = 16, max_tokens: int = 4096):
        # max_tokens bounds the memory: a 7B model's KV cache is ~130 KB per token in bf16
        self.max_entries, self.min_prefix, self.max_tokens = max_entries, min_prefix, max_tokens
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (ref, cache, last)
        self.hits = self.misses = 0
        self.tokens_saved = 0

    def run(self, model, version: int, decoder, prompt: list[int], device):
        """(KV cache of the whole prompt, last hidden row [1, H]); the cache is never
        mutated afterwards (callers copy it)."""
        base, n = self._best(model, version, prompt)
        ids = torch.as_tensor(prompt[n:], dtype=torch.long)[None].to(device)
        kwargs = {"use_cache": True}
        if base is not None:
            base = copy.deepcopy(base)
            extra = base.get_seq_length() - n
            if extra > 0:  # a negative count removes tokens in every transformers version
                base.crop(-extra)
            kwargs[_cache_kw(decoder)] = base
            self.hits, self.tokens_saved = self.hits + 1, self.tokens_saved + n
        else:
            self.misses += 1
        out = decoder(input_ids=ids, **kwargs)
        cache, last = out.past_key_values, out.last_hidden_state[0, -1:]
        key = (id(model), int(version), tuple(prompt))
        self._entries[key] = (weakref.ref(model), cache, last)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries or (
                len(self._entries) > 1
                and sum(len(k[2]) for k in self._entries) > self.max_tokens):
            self._entries.popitem(last=False)
        return cache, last

    def _best(self, model, version: int, prompt: list[int]):
        """(cache, n): the entry sharing the longest prefix n >= min_prefix with `prompt`,
        n < len(prompt) (the prompt's last token must run: its hidden row is needed)."""
        best, best_n = None, 0
        for (mid, ver, tokens), (ref, cache, _) in self._entries.items():
            if mid != id(model) or ver != version or ref() is not model:
                continue
            if not getattr(cache, "is_croppable", True):
                continue
            n = _common_prefix(tokens, prompt, len(prompt) - 1)
            if n > best_n:
                best, best_n = cache, n
        return (best, best_n) if best_n >= self.min_prefix else (None, 0)


def _common_prefix(a, b, limit: int) -> int:
    n = 0
    while n < limit and n < len(a) and a[n] == b[n]:
        n += 1
    return n
