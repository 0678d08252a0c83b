"""Learning smoke test on the real model: GRPO steps on SmolLM2 move probability mass
toward the rewarded answer of an arithmetic task and away from the wrong one.

Real parts: SmolLM2-135M-Instruct, the reasoning-gym task and its scorer (rewards come from
the decoded token ids), the trainer with its buffer and the chunked-logprob path. The
completions are fixed texts rather than samples so the test is deterministic and short: one
step already moves the log-odds by ~3 nats (the bar is 1), so one step is all it takes.
"""

from __future__ import annotations

import pytest
import torch
from swarm_node.node.config import Config
from swarm_node.node.sampler.base import Sample
from swarm_node.node.tasks import format_prompt, get_task
from swarm_node.node.trainer.data import TrainRow
from swarm_node.node.trainer.logprobs import completion_logprobs, pack
from swarm_node.node.trainer.trainer import Trainer
from swarm_node.protocol.messages import TaskRef

REF = TaskRef(dataset="rg/basic_arithmetic", params={"min_terms": 2, "max_terms": 2,
              "min_digits": 1, "max_digits": 1, "operators": "+", "allow_parentheses": False,
              "allow_negation": False}, seed=3, index=0)


def _log_odds(trainer, prompt, right, wrong) -> float:
    """log p(right | prompt) - log p(wrong | prompt): both rows in one forward pass."""
    rows = [TrainRow(prompt, ids, None, 0.0, 1.0, 0.0) for ids in (right, wrong)]
    with torch.no_grad():
        batch = pack(rows, trainer.tokenizer.pad_token_id, trainer.device)
        right_lp, wrong_lp = completion_logprobs(trainer.model, batch)[0].split(batch.lengths)
    return float(right_lp.sum() - wrong_lp.sum())


@pytest.mark.slow
@pytest.mark.timeout(1200)  # ~20 s on 2 free cores; minutes on a shared machine
def test_grpo_on_smollm2_prefers_the_rewarded_answer(smollm2_dir, tmp_path):
    cfg = Config.model_validate({
        "model": {"device": "cpu"},
        "trainer": {"learning_rate": 1e-4, "local_items": 1, "external_items": 0,
                    "checkpoint_every": 100, "max_staleness": 100}})
    trainer = Trainer(cfg, smollm2_dir, tmp_path / "data", policy_id="smoke")
    try:
        tok, task = trainer.tokenizer, get_task(REF)
        prompt = format_prompt(tok, task)
        wrong_answer = str(int(task.answer) + 3)
        right = tok.encode(f"<answer>{task.answer}</answer>", add_special_tokens=False)
        wrong = tok.encode(f"<answer>{wrong_answer}</answer>", add_special_tokens=False)
        right, wrong = right + [tok.eos_token_id], wrong + [tok.eos_token_id]
        before = _log_odds(trainer, prompt, right, wrong)
        samples = [Sample(task=REF, prompt_ids=prompt, completion_ids=ids,
                          logprobs=None, finish_reason="eos", seed=j, text="ignored",
                          hidden=None, policy_version=trainer.version)
                   for j, ids in enumerate([right, wrong, right, wrong])]
        assert trainer.add_local(samples) == 1, "the group must carry signal"
        stats = trainer.step()
        assert stats.trained and stats.mean_reward == pytest.approx(0.5)
        after = _log_odds(trainer, prompt, right, wrong)
    finally:
        trainer.close()
    # the log-odds of the right answer over the wrong one grew by a clear margin
    assert after > before + 1.0, (before, after)
