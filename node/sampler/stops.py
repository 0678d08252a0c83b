"""Where a completion stops: the EOS id set and the context limit, one definition shared by
the samplers (HF, vLLM) and the verifier, so an honest completion is never judged by other
rules than the ones it was sampled with (ARCHITECTURE.md "Sampler output"; NODE_SPEC 5.2
`bad_shape`, `tokens_after_eos`).
"""

from __future__ import annotations

from ..errors import NodeError

UNLIMITED = 1 << 30


def eos_token_ids(tokenizer, generation_config=None) -> frozenset[int]:
    """The tokenizer's EOS id plus every id of `generation_config.eos_token_id` (an int or a
    list: Qwen2.5-Instruct lists two)."""
    if tokenizer.eos_token_id is None:
        raise NodeError("tokenizer has no EOS token; cannot tell when a completion ends")
    ids = {int(tokenizer.eos_token_id)}
    extra = getattr(generation_config, "eos_token_id", None)
    if extra is not None:
        ids |= {int(x) for x in (extra if isinstance(extra, (list, tuple)) else [extra])}
    return frozenset(ids)


def model_eos_ids(model, tokenizer) -> frozenset[int]:
    """`eos_token_ids` of a loaded HF model (its `generation_config`, when it has one)."""
    return eos_token_ids(tokenizer, getattr(model, "generation_config", None))


def context_limit(model_config, configured: int | None) -> int:
    """min(configured `model.max_context`, the model's own `max_position_embeddings`)."""
    own = getattr(model_config, "max_position_embeddings", None) or UNLIMITED
    return min(int(configured), int(own)) if configured else int(own)
