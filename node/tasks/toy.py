"""Built-in toy tasks a tiny model learns from scratch on a CPU in minutes.

Answers are one digit (one token for the tiny tokenizer) followed by EOS. Rewards are shaped
so that GRPO gets a signal from a random policy:
  1.0  the completion is exactly the answer digit (whitespace ignored)
  0.5  the first digit in the completion is the answer, with other text around it
  0.1  the completion contains a digit, but the first one is wrong
  0.0  no digit
"""

from __future__ import annotations

import hashlib
import random
import re

from ...protocol.messages import TaskRef
from ..errors import NodeError
from .base import Task

_DIGIT = re.compile(r"\d")


def _rng(ref: TaskRef) -> random.Random:
    key = f"{ref.dataset}|{ref.seed}|{ref.index}".encode()
    return random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))


def digit_score(answer: str, text: str) -> float:
    stripped = text.strip()
    if stripped == answer:
        return 1.0
    m = _DIGIT.search(stripped)
    if m is None:
        return 0.0
    return 0.5 if m.group() == answer else 0.1


def _digit_successor(ref: TaskRef) -> tuple[str, str]:
    d = _rng(ref).randrange(9)
    return f"What digit comes after {d}?", str(d + 1)


def _digit_predecessor(ref: TaskRef) -> tuple[str, str]:
    d = _rng(ref).randrange(1, 10)
    return f"What digit comes before {d}?", str(d - 1)


def _digit_copy(ref: TaskRef) -> tuple[str, str]:
    d = _rng(ref).randrange(10)
    return f"Repeat the digit {d}.", str(d)


TOY_FAMILIES = {
    "toy/digit_successor": _digit_successor,
    "toy/digit_predecessor": _digit_predecessor,
    "toy/digit_copy": _digit_copy,
}


def toy_task(ref: TaskRef) -> Task:
    make = TOY_FAMILIES.get(ref.dataset)
    if make is None:
        raise NodeError(f"unknown toy task family {ref.dataset!r} (known: {sorted(TOY_FAMILIES)})")
    if ref.params:
        raise NodeError(f"toy task family {ref.dataset!r} takes no params, got {dict(ref.params)}")
    prompt, answer = make(ref)
    return Task(ref=ref, prompt=prompt, answer=answer,
                scorer=lambda text: digit_score(answer, text), reference_completion=answer)
