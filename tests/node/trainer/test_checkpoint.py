"""Checkpoints: atomic layout, retention, exact round trip of weights/optimizer/RNG."""

from __future__ import annotations

import json
import random

import pytest
import torch
from swarm_node.node.models import load_model
from swarm_node.node.trainer.checkpoint import CheckpointError, CheckpointStore


def _train_a_bit(model, opt, sched):
    ids = torch.tensor([[5, 6, 7, 8]])
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_roundtrip_retention_and_layout(tiny_model_dir, tmp_path):
    model, tok = load_model(tiny_model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    store = CheckpointStore(tmp_path / "ck", keep=2)
    assert store.latest() is None
    for v in (1, 2, 3):
        _train_a_bit(model, opt, sched)
        ck = store.save(v, model, tok, opt, sched, state={"version": v, "note": "x"})
    assert [c.version for c in store.list()] == [2, 3]  # keep last 2
    assert ck.path.name == "step-00000003"
    names = {p.name for p in ck.policy_files()}
    assert "model.safetensors" in names and "config.json" in names
    assert all(p.is_file() for p in ck.policy_dir.iterdir())  # flat: the broadcaster's rule
    assert not (ck.policy_dir / "state.safetensors").exists()
    manifest = json.loads((ck.policy_dir / "checkpoint.json").read_text())
    assert manifest["version"] == 3
    assert {f["name"] for f in manifest["files"]} == names - {"checkpoint.json"}
    assert not list(ck.path.rglob("*.bin")) and not list(ck.path.rglob("*.pt"))
    from swarm_node.node.broadcast.manifest import checkpoint_files

    assert {e.name for e in checkpoint_files(ck.policy_dir)} == names

    # the policy directory loads through the normal model path, weights identical
    m2, _ = load_model(ck.policy_dir)
    # ... and through the sampler's weight swap
    from swarm_node.node.sampler.hf import HFSampler

    m3, tok3 = load_model(tiny_model_dir)
    sampler = HFSampler(m3, tok3)
    sampler.load_weights(ck.policy_dir, version=3)
    assert sampler.version == 3
    for (n, a), (_, b) in zip(model.state_dict().items(), m3.state_dict().items()):
        assert torch.equal(a, b), n
    for (n, a), (_, b) in zip(model.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n

    # trainer state: optimizer, scheduler and RNG restored exactly
    torch_rng_at_save = torch.get_rng_state()
    expected_next = torch.rand(3)
    py_next = random.random()
    m2.train()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: min(1.0, (s + 1) / 10))
    torch.manual_seed(123)
    state = store.restore(ck, opt2, sched2)
    assert state == {"version": 3, "note": "x"}
    assert sched2.last_epoch == sched.last_epoch
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1[k][name], s2[k][name])
    # RNG at restore equals RNG at save time (the save happened before torch.rand above)
    assert torch.equal(torch.get_rng_state(), torch_rng_at_save)
    assert torch.equal(torch.rand(3), expected_next)
    assert random.random() == py_next
    # one more identical step on both gives identical weights
    _train_a_bit(model, opt, sched)
    _train_a_bit(m2, opt2, sched2)
    for (n, a), (_, b) in zip(model.state_dict().items(), m2.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-7), n


def test_crash_leftovers_and_corruption(tiny_model_dir, tmp_path):
    model, tok = load_model(tiny_model_dir)
    root = tmp_path / "ck"
    store = CheckpointStore(root, keep=3)
    ck = store.save(1, model, tok)
    # a half-written checkpoint from a crash is invisible and cleaned on open
    (root / ".tmp-step-00000002-abc").mkdir()
    (root / ".tmp-step-00000002-abc" / "model.safetensors").write_bytes(b"partial")
    store = CheckpointStore(root, keep=3)
    assert [c.version for c in store.list()] == [1]
    assert not (root / ".tmp-step-00000002-abc").exists()
    with pytest.raises(CheckpointError):
        store.save(1, model, tok)
    # a corrupted trainer state is a clear error, not a crash
    (ck.trainer_dir / "state.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(CheckpointError):
        store.restore(ck)
