"""benchmarks/gpu_check.py on the CPU (its `--device cpu` smoke mode), with the tiny model:
the bf16 case and the report written after each part."""

from __future__ import annotations

import json
import sys

from benchmarks import gpu_check


def test_gpu_check_smoke_covers_bf16_and_writes_the_report(tiny_model_dir, tmp_path,
                                                           monkeypatch):
    out = tmp_path / "gpu_check.json"
    monkeypatch.setattr(sys, "argv", [
        "gpu_check", "--model", str(tiny_model_dir), "--device", "cpu", "--batches", "8",
        "--new-tokens", "8", "--check-batch", "8", "--check-new-tokens", "8",
        "--out", str(out)])
    gpu_check.main()
    report = json.loads(out.read_text())
    assert not out.with_name(out.name + ".part").exists()
    noise = report["noise"]["vocab"]["49152"]
    assert noise["mantissas_identical"] and all(noise["argmax_identical"].values())
    row = report["speed"][0]
    assert row["hf"]["tokens"] > 0 and row["hf_bf16"]["tokens"] > 0
    assert 0 <= row["bf16_identical_to_fp32"] <= 8
    # each sampler's honest batch, checked in its own dtype (a bf16 batch by the bf16
    # verifier: NODE_SPEC 5.2 `config_dtype` otherwise), every completion accepted
    assert set(report["acceptance"]) == {
        "hf sampled float32/cpu, verified float32/cpu",
        "hf_bf16 sampled bfloat16/cpu, verified bfloat16/cpu"}
    for case in report["acceptance"].values():
        assert case["reasons"] == {"ok": 8}, case
    assert {"noise", "model", "speed", "verify float32/cpu",
            "verify bfloat16/cpu"} <= set(report["seconds"])
