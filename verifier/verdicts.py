"""The text of a trainer's per-batch summary verdict (NODE_SPEC §5), written by the intake
and read by the batch's sender. No torch here: every role imports it cheaply."""

from __future__ import annotations

from collections import Counter

SUMMARY_REASON = "batch_summary"
"""Verdict reason of a trainer's per-batch summary to the batch's sender."""


def summary_detail(accepted: int, reasons: Counter, round_: int) -> str:
    """`accepted=6 rejected=2 round=4 reasons=task_not_assigned:2` (fits Verdict.detail)."""
    text = ",".join(f"{r}:{n}" for r, n in reasons.most_common(12))
    return (f"accepted={accepted} rejected={sum(reasons.values())} round={round_} "
            f"reasons={text}")[:512]


def parse_summary(detail: str) -> dict:
    """Inverse of `summary_detail`; tolerant (a peer's text is untrusted: bad parts skipped)."""
    out = {"accepted": 0, "round": "?", "reasons": {}}
    for part in detail.split():
        key, _, value = part.partition("=")
        if key == "accepted" and value.isdigit():
            out["accepted"] = min(int(value), 1 << 20)
        elif key == "round" and value.isdigit():
            out["round"] = value
        elif key == "reasons":
            for item in value.split(",")[:12]:
                reason, _, n = item.rpartition(":")
                if reason and n.isdigit() and len(reason) <= 64:
                    out["reasons"][reason] = min(int(n), 1 << 20)
    return out
