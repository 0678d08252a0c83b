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
    P+T-2) for completions sharing one prompt (`prefill_groups` for one group). `pad_id` is
    unused (kept for callers; nothing is padded)."""
    del pad_id
    return prefill_groups(model, [(prompt, completions)], token_budget, prompt_cache,
                          version)[0]


@torch.inference_mode()
def prefill_groups(model, groups, token_budget: int = 8192,
                   prompt_cache: PromptCache | None = None,
                   version: int = 0) -> list[list[torch.Tensor]]:
    """Per (prompt, completions) group, the hidden rows of `prefill` (fp32 [T, H] per
    completion: positions P-1 .. P+T-2). Each prompt runs once (with `prompt_cache`, only its
    part after the longest prefix cached for this model and `version`). Then the groups'
    completion tokens 0..T-2 (the last token is never an input) run together, packed end to
    end without padding behind the groups' prompt KV caches laid side by side: a token
    attends to its own group's prompt and its own completion's earlier tokens only (a
    block-diagonal causal 4D mask; positions counted from its prompt's end). Packs hold
    about `token_budget` tokens, prompts included (memory: the mask is Q x (P + Q)). One
    pass over a batch's groups feeds the matrix products more rows (SmolLM2's layers run
    ~83 GFLOP/s at 110 rows, ~89 at 220 on this CPU) and pays the per-layer overhead once."""
    device = next(model.parameters()).device
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    cache_kw = _cache_kw(decoder)
    heads = []  # per group: (prompt KV cache, last prompt hidden row [1, H], prompt length)
    for prompt, _ in groups:
        prompt = [int(x) for x in prompt]
        if prompt_cache is not None:
            cache, last = prompt_cache.run(model, version, decoder, prompt, device)
        else:
            p = torch.as_tensor(prompt, dtype=torch.long)[None].to(device)
            out = decoder(input_ids=p, use_cache=True)
            cache, last = _out_cache(out), out.last_hidden_state[0, -1:]
        heads.append((cache, last, len(prompt)))
    fed = [[[int(x) for x in c][:-1] for c in comps] for _, comps in groups]
    mergeable = len(groups) == 1 or all(_layers(h[0]) is not None for h in heads)
    results = [[None] * len(comps) for _, comps in groups]
    budget = min(token_budget, pack_tokens(model.config))
    for pack in _packs(fed, [h[2] for h in heads], budget, across=mergeable):
        hidden = _run_pack(decoder, cache_kw, model, device, heads, fed, pack)
        start = 0
        for g, i in pack:
            n = len(fed[g][i])
            rows = [heads[g][1]] + ([hidden[start:start + n]] if n else [])
            results[g][i] = torch.cat(rows).float().cpu()
            start += n
    return results


# attention over a pack costs about this fraction of its linear layers at most
ATTENTION_SHARE = 0.15


def pack_tokens(config) -> int:
    """Tokens per pack (prompts included): the masked attention of a pack of n tokens costs
    ~4 n H FLOPs per token and layer whatever the mask hides, the linear layers ~2 x their
    weights, so packs stay below ATTENTION_SHARE of the linear cost (SmolLM2-135M: ~460
    tokens, a batch of 2 groups x 4 in one pack, where one pack measured 0-11% faster than
    one per group; a 7B model: ~3,700); never under 256, where the matrix products run at
    their full rate here (~90 GFLOP/s at 256 rows, 83 at 110)."""
    h, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv = h // heads * (getattr(config, "num_key_value_heads", None) or heads)
    linear = 2 * (2 * h * h + 2 * h * kv + 3 * h * inter)  # per token and layer
    return max(256, int(ATTENTION_SHARE * linear / (4 * h)))


def _run_pack(decoder, cache_kw, model, device, heads, fed, pack):
    """Hidden states [Q, H] of one pack's completion tokens (None when it feeds none)."""
    if not any(fed[g][i] for g, i in pack):
        return None
    groups = list(dict.fromkeys(g for g, _ in pack))  # in order, each once
    offsets, total = {}, 0
    for g in groups:
        offsets[g], total = total, total + heads[g][2]
    q = sum(len(fed[g][i]) for g, i in pack)
    ids = torch.tensor([t for g, i in pack for t in fed[g][i]], dtype=torch.long)[None]
    positions = torch.cat([torch.arange(heads[g][2], heads[g][2] + len(fed[g][i]))
                           for g, i in pack])[None]
    allow = torch.zeros((q, total + q), dtype=torch.bool)
    start = 0
    for g, i in pack:  # its prompt, and causal within its own completion
        n = len(fed[g][i])
        allow[start:start + n, offsets[g]:offsets[g] + heads[g][2]] = True
        allow[start:start + n, total + start:total + start + n] = torch.ones(
            (n, n), dtype=torch.bool).tril()
        start += n
    if getattr(model.config, "_attn_implementation", "sdpa") == "sdpa":
        mask = allow
    else:  # the additive form other attention implementations take
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(allow.shape, dtype=dtype).masked_fill(~allow, torch.finfo(dtype).min)
    cache = _merged([heads[g][0] for g in groups])
    return decoder(input_ids=ids.to(device), position_ids=positions.to(device),
                   attention_mask=mask[None, None].to(device), use_cache=True,
                   **{cache_kw: cache}).last_hidden_state[0]


def _layers(cache):
    """The per-layer key/value holders of a transformers DynamicCache (transformers >= 4.56
    keeps them in `cache.layers`), or None when this cache cannot be merged here."""
    layers = getattr(cache, "layers", None)
    if layers is None or any(type(x).__name__ != "DynamicLayer" for x in layers):
        return None
    return layers


def _merged(caches):
    """A fresh cache holding `caches`' keys and values side by side along the sequence (RoPE
    is already applied to cached keys, so each keeps its own positions); one is copied."""
    merged = copy.deepcopy(caches[0])
    if len(caches) > 1:
        for k, layer in enumerate(_layers(merged)):
            layer.keys = torch.cat([_layers(c)[k].keys for c in caches], dim=-2)
            layer.values = torch.cat([_layers(c)[k].values for c in caches], dim=-2)
    return merged


def _packs(fed: list[list[list[int]]], prompt_lens: list[int], token_budget: int,
           across: bool = True) -> list[list[tuple[int, int]]]:
    """(group, completion) pairs in order, in packs of at most about `token_budget` tokens
    counting the prompts of the groups a pack touches; one completion over the budget is a
    pack of its own. With `across` False a pack never spans two groups. Packing wastes
    nothing on padding (the padded sub-batches this replaced fed 21-27% extra tokens on
    SmolLM2)."""
    packs: list[list[tuple[int, int]]] = []
    size, last_group = 0, None
    for g, comps in enumerate(fed):
        for i, tokens in enumerate(comps):
            extra = len(tokens) + (prompt_lens[g] if g != last_group else 0)
            if packs and (across or g == last_group) and size + extra <= token_budget:
                packs[-1].append((g, i))
                size += extra
            else:
                packs.append([(g, i)])
                size = prompt_lens[g] + len(tokens)
            last_group = g
    return packs


def _cache_kw(decoder) -> str:
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters \
        else "past_key_values"


def _out_cache(out):
    """The KV cache of a model output: `cache` in newer transformers (reading the older
    `past_key_values` there logs a deprecation warning), `past_key_values` before."""
    cache = out.get("cache")
    return cache if cache is not None else out.past_key_values


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
        cache, last = _out_cache(out), out.last_hidden_state[0, -1:]
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
