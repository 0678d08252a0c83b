"""One SamplingParams builder: every `sampler` config field reaches the sampler (and the
wire) in the roles that `swarm-node join` runs, top_k included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from swarm_node.node.config import Config
from swarm_node.node.models import load_model
from swarm_node.node.roles.inference import InferenceRole
from swarm_node.node.roles.settings import EffectiveSettings
from swarm_node.node.roles.trainer import TrainerRole
from swarm_node.node.sampler import sampling_params
from swarm_node.node.sampler.hf import HFSampler
from swarm_node.node.tasks import TaskSource
from swarm_node.node.trainer.trainer import Trainer
from swarm_node.protocol.messages import SamplingParams

FIELDS = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 3}


class RecordingSampler(HFSampler):
    """The real HF sampler, remembering the params each generate() call got."""

    def generate(self, prompts, n, params, seeds=None):
        self.seen = params
        return super().generate(prompts, n, params, seeds)


@pytest.fixture
def cfg(tiny_model_dir, tmp_path) -> Config:
    return Config.model_validate({
        "node": {"data_dir": str(tmp_path / "data")},
        "model": {"name": str(tiny_model_dir), "device": "cpu"},
        "sampler": {**FIELDS, "completions_per_task": 2},
        "tasks": {"tasks_per_round": 1}})


def test_builder_carries_every_field(cfg):
    params = sampling_params(cfg)
    assert params == SamplingParams(**FIELDS)
    wire_fields = set(SamplingParams.model_fields)
    assert wire_fields <= set(type(cfg.sampler).model_fields), wire_fields


def test_inference_role_samples_and_publishes_with_the_config(cfg, tiny_model_dir):
    model, tok = load_model(tiny_model_dir)
    role = InferenceRole.__new__(InferenceRole)  # only the sampling path, no network
    role.cfg, role.tokenizer, role.outgoing = cfg, tok, None
    role.sampler = RecordingSampler(model, tok, peer_id="p")
    role.tasks = TaskSource(cfg.tasks.mix, cfg.node.swarm_id)
    role.identity, role.policy_id = SimpleNamespace(peer_id="p"), "trainer"
    role.effective = EffectiveSettings.local(cfg)  # no trainer settings adopted
    batch = role.sample_round(0)
    assert role.sampler.seen == SamplingParams(**FIELDS)
    assert batch.sampling == SamplingParams(**FIELDS)
    assert max(c.completion_ids.shape[0] for c in batch.completions) <= 3


def test_trainer_role_samples_locally_with_the_config(cfg, tiny_model_dir, tmp_path):
    role = TrainerRole.__new__(TrainerRole)
    role.cfg, role.identity = cfg, SimpleNamespace(peer_id="t")
    role.trainer = Trainer(cfg, tiny_model_dir, tmp_path / "t", policy_id="t")
    try:
        role.sampler = RecordingSampler(role.trainer.model, role.trainer.tokenizer,
                                        peer_id="t")
        role.tasks = TaskSource(cfg.tasks.mix, cfg.node.swarm_id)
        assert role.sample_local(0) == 2
        assert role.sampler.seen == SamplingParams(**FIELDS)
    finally:
        role.trainer.close()
