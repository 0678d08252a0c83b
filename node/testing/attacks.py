"""Honest batches and the attacks the verifier must reject (used by tests and benchmarks).

`make_batch` packs sampler output exactly like the inference role. Each attack returns a
modified copy. "Consistent" forgeries recompute logprobs, proof, text and claimed reward
with the real model after changing tokens, so only the check aimed at them can fire — the
strongest form of each attack a peer holding the real weights can mount.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import torch

from ...protocol.messages import Completion, RolloutBatch, SamplingParams, TensorData
from ...verifier.checks import prefill
from ...verifier.proof import build_proofs, proof_size
from ..sampler.hf import HFSampler
from ..sampler.seeded import completion_seed, gumbel_noise, mask_logits
from ..tasks import format_prompt, get_task


def ids_tensor(ids) -> TensorData:
    return TensorData.from_numpy(np.asarray(list(ids), dtype=np.int32))


def make_batch(tasks, samples, *, swarm_id: str, round_: int, policy_id: str,
               policy_version: int, params: SamplingParams) -> RolloutBatch:
    """A RolloutBatch from (task, Sample) pairs, with proofs (as the inference role does)."""
    proofs = build_proofs([s.hidden for s in samples])
    completions = [
        Completion(task=s.task, prompt_ids=ids_tensor(s.prompt_ids),
                   completion_ids=ids_tensor(s.completion_ids),
                   logprobs=TensorData.from_torch(s.logprobs.float()),
                   finish_reason=s.finish_reason, seed=s.seed,
                   claimed_reward=float(task.score(s.text)), text=s.text, proof=proof)
        for task, s, proof in zip(tasks, samples, proofs)]
    return RolloutBatch(swarm_id=swarm_id, round=round_, policy_id=policy_id,
                        policy_version=policy_version, sampling=params, completions=completions)


# Models ----------------------------------------------------------------------------------


def scaled_copy(model, factor: float):
    """The model with every weight multiplied by `factor`."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(factor)
    return other


def mixed_copy(model, other, alpha: float):
    """(1 - alpha) * model + alpha * other, weight by weight."""
    mixed = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(mixed.parameters(), other.parameters()):
            p.mul_(1 - alpha).add_(q, alpha=alpha)
    return mixed


# Completion forgeries --------------------------------------------------------------------


def reprove(batch: RolloutBatch, model, tokenizer, which=None,
            hidden_out: dict | None = None) -> RolloutBatch:
    """Recompute logprobs, proofs, text and claimed reward of completions `which` (default:
    all) from the tokens as they stand, with `model` (the real one for a consistent forgery).
    The hidden states the new proofs commit to go into `hidden_out[i]` when given."""
    which = range(len(batch.completions)) if which is None else which
    comps = list(batch.completions)
    targets = [i for i in which]
    pairs = [(comps[i].prompt_ids.to_numpy(), comps[i].completion_ids.to_numpy()) for i in targets]
    outs = prefill(model, pairs, tokenizer.pad_token_id or 0)
    temp = batch.sampling.temperature
    proofs = build_proofs([h for h, _ in outs])
    for i, (hidden, logits), proof in zip(targets, outs, proofs):
        if hidden_out is not None:
            hidden_out[i] = hidden
        c = comps[i]
        tokens = torch.from_numpy(c.completion_ids.to_numpy().astype("int64"))
        logp = torch.log_softmax(logits / temp if temp > 0 else logits, dim=-1)
        lp = logp.gather(1, tokens[:, None])[:, 0]
        text = tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
        comps[i] = c.model_copy(update={
            "logprobs": TensorData.from_torch(lp.float()), "proof": proof, "text": text,
            "claimed_reward": float(get_task(c.task).score(text))})
    return batch.model_copy(update={"completions": comps})


def _set_tokens(c: Completion, tokens: list[int], finish: str | None = None) -> Completion:
    update = {"completion_ids": ids_tensor(tokens),
              "logprobs": TensorData.from_numpy(np.resize(c.logprobs.to_numpy(), len(tokens)))}
    if finish is not None:
        update["finish_reason"] = finish
    return c.model_copy(update=update)


def _random_token(rng: random.Random, vocab: int, avoid: set[int]) -> int:
    while True:
        tok = rng.randrange(vocab)
        if tok not in avoid:
            return tok


def tamper_tokens(batch, rng: random.Random, vocab: int, eos_ids: set[int], span: int = 1,
                  model=None, tokenizer=None, hidden_out: dict | None = None) -> RolloutBatch:
    """Replace `span` consecutive non-final tokens of every completion by other tokens
    (consistent when `model` is given)."""
    comps = []
    for c in batch.completions:
        tokens = c.completion_ids.to_numpy().tolist()
        body = len(tokens) - 1 if tokens[-1] in eos_ids else len(tokens)
        n = min(span, body)
        start = rng.randrange(0, body - n + 1) if body > 0 else 0
        for k in range(start, start + n):
            tokens[k] = _random_token(rng, vocab, eos_ids | {tokens[k]})
        comps.append(_set_tokens(c, tokens))
    out = batch.model_copy(update={"completions": comps})
    return reprove(out, model, tokenizer, hidden_out=hidden_out) if model is not None else out


def tamper_logprobs(batch, rng: random.Random, delta: float = 0.05) -> RolloutBatch:
    """Shift one claimed logprob per completion by `delta` (toward probability 1)."""
    comps = []
    for c in batch.completions:
        lp = c.logprobs.to_numpy().copy()
        k = rng.randrange(len(lp))
        lp[k] = min(0.0, lp[k] + delta) if lp[k] < -delta else lp[k] - delta
        comps.append(c.model_copy(update={"logprobs": TensorData.from_numpy(lp)}))
    return batch.model_copy(update={"completions": comps})


def proof_partners(batch) -> list[int]:
    """For each completion, the next other completion of the same length (or just the next)."""
    comps = batch.completions
    n = len(comps)
    out = []
    for i, c in enumerate(comps):
        same = [j for j in list(range(i + 1, n)) + list(range(i)) if
                comps[j].completion_ids.shape == c.completion_ids.shape]
        out.append(same[0] if same else (i + 1) % n)
    return out


def swap_proofs(batch) -> RolloutBatch:
    """Each completion carries the proof of another one (`proof_partners`)."""
    comps = batch.completions
    out = [c.model_copy(update={"proof": comps[j].proof})
           for c, j in zip(comps, proof_partners(batch))]
    return batch.model_copy(update={"completions": out})


def truncate_with_eos(batch, rng: random.Random, eos_id: int, model, tokenizer,
                      hidden_out: dict | None = None) -> RolloutBatch:
    """Cut every completion short and end it with EOS, consistently re-proven."""
    comps = []
    for c in batch.completions:
        tokens = c.completion_ids.to_numpy().tolist()
        k = rng.randrange(0, max(1, len(tokens) - 1))
        comps.append(_set_tokens(c, tokens[:k] + [eos_id], "eos"))
    return reprove(batch.model_copy(update={"completions": comps}), model, tokenizer,
                   hidden_out=hidden_out)


def append_after_eos(batch, rng: random.Random, vocab: int, eos_id: int, model,
                     tokenizer) -> RolloutBatch:
    """Put an EOS inside every completion and keep going (consistently re-proven)."""
    comps = []
    for c in batch.completions:
        tokens = c.completion_ids.to_numpy().tolist()
        if tokens[-1] == eos_id:
            tokens = tokens + [_random_token(rng, vocab, {eos_id}) for _ in range(3)]
        else:
            tokens[rng.randrange(0, len(tokens) - 1)] = eos_id
        comps.append(_set_tokens(c, tokens))
    return reprove(batch.model_copy(update={"completions": comps}), model, tokenizer)


def forge_reward(batch) -> RolloutBatch:
    comps = [c.model_copy(update={"claimed_reward": 1.0 if c.claimed_reward < 1.0 else 0.5})
             for c in batch.completions]
    return batch.model_copy(update={"completions": comps})


def sample_batch(model, tokenizer, task_source, sender: str, *, round_: int = 0,
                 version: int = 0, tasks: int = 2, n: int = 4, params: SamplingParams,
                 swarm_id: str = "default", policy_id: str = "trainer", max_batch: int = 64,
                 label_round: int | None = None, hidden_out: list | None = None) -> RolloutBatch:
    """Sample `n` completions of each of the first `tasks` tasks of (sender, round_) with the
    HF sampler and pack them (batch labelled `label_round`, default `round_`)."""
    sampler = HFSampler(model, tokenizer, peer_id=sender, version=version, max_batch=max_batch)
    refs = task_source.draw(sender, round_, tasks)
    regenerated = [get_task(r) for r in refs]
    prompts = [(r, format_prompt(tokenizer, t)) for r, t in zip(refs, regenerated)]
    groups = sampler.generate(prompts, n, params)
    flat_tasks = [t for t, g in zip(regenerated, groups) for _ in g]
    samples = [s for g in groups for s in g]
    if hidden_out is not None:
        hidden_out.extend(s.hidden for s in samples)
    return make_batch(flat_tasks, samples, swarm_id=swarm_id,
                      round_=round_ if label_round is None else label_round,
                      policy_id=policy_id, policy_version=version, params=params)


def bogus_batch(batch, rng: random.Random, vocab: int, proof: bytes | None = None,
                hidden_size: int | None = None, tokenizer=None) -> RolloutBatch:
    """The sybil flood's batch: `batch`'s tasks, prompts, seeds and finish reasons with
    random tokens, zero logprobs and a garbage proof (`proof`, or random bytes of the exact
    length for `hidden_size`). With `tokenizer`, text and claimed reward match the random
    tokens, so the batch passes every check before the forward pass."""
    comps = []
    for c in batch.completions:
        n = c.completion_ids.shape[0]
        tokens = [rng.randrange(vocab) for _ in range(n)]
        if c.finish_reason == "eos":
            tokens[-1] = int(c.completion_ids.to_numpy()[-1])
        junk = proof if proof is not None else bytes([1]) + rng.randbytes(
            proof_size(n, hidden_size) - 1)
        text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer else ""
        reward = float(get_task(c.task).score(text)) if tokenizer else c.claimed_reward
        comps.append(c.model_copy(update={
            "completion_ids": ids_tensor(tokens), "text": text, "claimed_reward": reward,
            "logprobs": TensorData.from_numpy(np.zeros(n, dtype=np.float32)), "proof": junk}))
    return batch.model_copy(update={"completions": comps})


def bogus_round(tokenizer, task_source, sender: str, *, round_: int, version: int, tasks: int,
                n: int, params: SamplingParams, hidden_size: int, rng: random.Random,
                policy_id: str, swarm_id: str = "default", length: int = 8) -> RolloutBatch:
    """A sybil's batch for (sender, round_) built without any model: the right tasks,
    prompts, seeds and proof length, random tokens (text and reward made consistent), so
    only the forward pass can reject it."""
    eos = tokenizer.eos_token_id
    comps = []
    for ref in task_source.draw(sender, round_, tasks):
        task = get_task(ref)
        prompt = format_prompt(tokenizer, task)
        for j in range(n):
            tokens = [_random_token(rng, len(tokenizer), {eos}) for _ in range(length - 1)]
            tokens.append(eos)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            comps.append(Completion(
                task=ref, prompt_ids=ids_tensor(prompt), completion_ids=ids_tensor(tokens),
                logprobs=TensorData.from_numpy(np.zeros(length, dtype=np.float32)),
                finish_reason="eos", seed=completion_seed(ref, sender, version, j),
                claimed_reward=float(task.score(text)), text=text,
                proof=bytes([1]) + rng.randbytes(proof_size(length, hidden_size) - 1)))
    return RolloutBatch(swarm_id=swarm_id, round=round_, policy_id=policy_id,
                        policy_version=version, sampling=params, completions=comps)


@torch.inference_mode()
def steer_near_ties(batch, model, tokenizer, tie_eps: float, rate: float = 1.0,
                    rng: random.Random | None = None, narrow_rate: float = 0.0,
                    steered: list | None = None) -> RolloutBatch:
    """Resample every completion with the seeded sampler, but take the runner-up token at
    "wide" near-ties (top-two noisy scores within (tie_eps/4, tie_eps]) with probability
    `rate`, and at narrow ones (within tie_eps/4) with `narrow_rate`; consistently
    re-proven. Each completion passes the per-rollout checks at that tie_eps; only the
    per-peer steering tests (sequential.py) can see it. `steered` gets (positions steered,
    positions) appended per completion."""
    rng = rng or random.Random(0)
    params = batch.sampling
    eos = tokenizer.eos_token_id
    comps = []
    for c in batch.completions:
        prompt = c.prompt_ids.to_numpy().tolist()
        tokens: list[int] = []
        n_steered = 0
        for t in range(params.max_new_tokens):
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1].float()
            scores = mask_logits(logits / params.temperature, params) + gumbel_noise(
                c.seed, t, logits.shape[-1])
            top = scores.topk(2)
            margin = float(top.values[0] - top.values[1])
            p = rate if tie_eps / 4 < margin <= tie_eps else narrow_rate \
                if margin <= tie_eps / 4 else 0.0
            pick = 1 if p and rng.random() < p else 0
            n_steered += pick
            tokens.append(int(top.indices[pick]))
            if tokens[-1] == eos:
                break
        if steered is not None:
            steered.append((n_steered, len(tokens)))
        comps.append(_set_tokens(c, tokens, "eos" if tokens[-1] == eos else "length"))
    return reprove(batch.model_copy(update={"completions": comps}), model, tokenizer)
