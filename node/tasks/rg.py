"""Reasoning-gym tasks: `rg/<generator>`; (params, seed, index) pick the entry.

Any node regenerates the question and ground truth from the reference alone; rewards are
reasoning-gym's own `score_answer` on the text inside the last <answer>...</answer> (or the
whole completion when there is no tag). The system prompt is one of reasoning-gym's
SYSTEM_PROMPTS, named by the swarm setting `tasks.system_prompt`; with `tasks.few_shot` k > 0
the first k entries of the same generator (same params) at FEW_SHOT_SEED come first, as
earlier user/assistant turns answered "<answer>...</answer>". With `format_reward` f > 0 the reward is
(1 - f) * correctness + f * [the completion has an <answer> tag].
"""

from __future__ import annotations

import contextlib
import functools
import io
import json

from ...protocol.messages import TaskRef
from ..errors import NodeError
from .base import DEFAULT_STYLE, PromptStyle, Task

# Gensyn RL Swarm's mix (REFERENCE.md section 1), equal weights.
GENSYN_FAMILIES = [
    "arc_1d", "basic_arithmetic", "base_conversion", "bf", "binary_matrix",
    "calendar_arithmetic", "decimal_arithmetic", "fraction_simplification",
    "propositional_logic",
]
DEFAULT_RG_MIX = {f"rg/{name}": 1.0 for name in GENSYN_FAMILIES}
# Entries are addressed by index; the dataset object is created with this many entries.
INDEX_SPACE = 1_000_000
# Two one-digit terms, + or -: shown two worked examples, SmolLM2-135M-Instruct answers 7 of
# 32 right greedily, and GRPO lifts that (benchmarks/RESULTS.md, learning): room to learn.
SMALL_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                    "operators": "+-", "allow_parentheses": False, "allow_negation": False}
# Few-shot examples (tasks.few_shot) are entries 0..k-1 of the generator at this seed.
FEW_SHOT_SEED = 0x5EED_F00D
MAX_FEW_SHOT = 4


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


def system_prompt_names() -> list[str]:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return sorted(SYSTEM_PROMPTS)


def system_prompt(name: str = "default") -> str:
    """The text of reasoning-gym's system prompt `name` (SYSTEM_PROMPTS: "default" asks for
    step-by-step thinking, "direct" for the bare answer; both for an <answer> tag)."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if name not in SYSTEM_PROMPTS:
        raise NodeError(f"unknown system prompt {name!r} (reasoning-gym has: "
                        f"{', '.join(sorted(SYSTEM_PROMPTS))})")
    return SYSTEM_PROMPTS[name]


def _answer(entry: dict) -> str:
    answer = entry.get("answer")
    if answer is None:  # e.g. propositional_logic: any valid conclusion scores
        answer = entry.get("metadata", {}).get("example_answer", "")
    return str(answer)


def _examples(name: str, params_json: str, k: int) -> tuple[tuple[str, str], ...]:
    """The first k entries of the generator at FEW_SHOT_SEED, answered in the tag format."""
    ds = _dataset(name, params_json, FEW_SHOT_SEED)
    return tuple((str(ds[i]["question"]), f"<answer>{_answer(ds[i])}</answer>")
                 for i in range(k))


def rg_task(ref: TaskRef, format_reward: float = 0.0,
            style: PromptStyle = DEFAULT_STYLE) -> Task:
    name = ref.dataset.removeprefix("rg/")
    if ref.index >= INDEX_SPACE:
        raise NodeError(f"task index {ref.index} of {ref.dataset} is >= {INDEX_SPACE}")
    if not 0 <= style.few_shot <= MAX_FEW_SHOT:
        raise NodeError(f"tasks.few_shot {style.few_shot} is outside 0..{MAX_FEW_SHOT}")
    # some generators (bf) print while generating; keep stdout clean for the node's output
    params_json = json.dumps(dict(ref.params), sort_keys=True)
    with contextlib.redirect_stdout(io.StringIO()):
        ds = _dataset(name, params_json, int(ref.seed))
        entry = ds[int(ref.index)]
        examples = _examples(name, params_json, style.few_shot)
    answer = _answer(entry)

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

    return Task(ref=ref, prompt=str(entry["question"]), answer=answer,
                system=system_prompt(style.system), scorer=scorer,
                reference_completion=f"<answer>{answer}</answer>", examples=examples)
