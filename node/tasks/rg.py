"""Reasoning-gym tasks: `rg/<generator>`; (params, seed, index) pick the entry.

Any node regenerates the question and ground truth from the reference alone; rewards are
reasoning-gym's own `score_answer` on the text inside the last <answer>...</answer> (or the
whole completion when there is no tag). With `format_reward` f > 0 the reward is
(1 - f) * correctness + f * [the completion has an <answer> tag].
"""

from __future__ import annotations

import contextlib
import functools
import io
import json

from ...protocol.messages import TaskRef
from ..errors import NodeError
from .base import Task

# Gensyn RL Swarm's mix (REFERENCE.md section 1), equal weights.
GENSYN_FAMILIES = [
    "arc_1d", "basic_arithmetic", "base_conversion", "bf", "binary_matrix",
    "calendar_arithmetic", "decimal_arithmetic", "fraction_simplification",
    "propositional_logic",
]
DEFAULT_RG_MIX = {f"rg/{name}": 1.0 for name in GENSYN_FAMILIES}
# Entries are addressed by index; the dataset object is created with this many entries.
INDEX_SPACE = 1_000_000


def rg_names() -> set[str]:
    from reasoning_gym.factory import DATASETS

    return set(DATASETS)


@functools.lru_cache(maxsize=64)
def _dataset(name: str, params_json: str, seed: int):
    import reasoning_gym

    if name not in rg_names():
        raise NodeError(f"unknown reasoning-gym dataset 'rg/{name}'")
    try:
        return reasoning_gym.create_dataset(name, size=INDEX_SPACE, seed=seed,
                                            **json.loads(params_json))
    except (TypeError, ValueError, AssertionError) as e:  # bad generator config
        raise NodeError(f"reasoning-gym dataset 'rg/{name}' rejects params {params_json}: {e}") \
            from None


def system_prompt() -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


def rg_task(ref: TaskRef, format_reward: float = 0.0) -> Task:
    name = ref.dataset.removeprefix("rg/")
    if ref.index >= INDEX_SPACE:
        raise NodeError(f"task index {ref.index} of {ref.dataset} is >= {INDEX_SPACE}")
    # some generators (bf) print while generating; keep stdout clean for the node's output
    with contextlib.redirect_stdout(io.StringIO()):
        ds = _dataset(name, json.dumps(dict(ref.params), sort_keys=True), int(ref.seed))
        entry = ds[int(ref.index)]
    answer = entry.get("answer")
    if answer is None:  # e.g. propositional_logic: any valid conclusion scores
        answer = entry.get("metadata", {}).get("example_answer", "")
    answer = str(answer)

    def scorer(text: str) -> float:
        from reasoning_gym.utils import extract_answer

        tagged = extract_answer(text)
        candidate = tagged if tagged is not None else text.strip()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                correct = float(ds.score_answer(answer=candidate, entry=entry))
        except Exception:  # noqa: BLE001 - a third-party scorer must not let a peer's text crash us
            correct = 0.0
        if format_reward > 0:
            return (1.0 - format_reward) * correct + format_reward * (tagged is not None)
        return correct

    return Task(ref=ref, prompt=str(entry["question"]), answer=answer, system=system_prompt(),
                scorer=scorer, reference_completion=f"<answer>{answer}</answer>")
