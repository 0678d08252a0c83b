"""Task references, regeneration across processes, rewards, assignment, prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
from swarm_node.node.errors import NodeError
from swarm_node.node.tasks import (
    DEFAULT_RG_MIX,
    GENSYN_FAMILIES,
    MAX_FEW_SHOT,
    TOY_FAMILIES,
    PromptStyle,
    TaskSource,
    format_prompt,
    get_task,
    system_prompt_names,
)
from swarm_node.protocol.messages import TaskRef

MIXED = {**{name: 1.0 for name in TOY_FAMILIES}, **DEFAULT_RG_MIX}

_DUMP = """
import json, sys
from swarm_node.node.tasks import TaskSource, get_task
src = TaskSource(json.loads(sys.argv[1]), "swarm-x")
out = []
for ref in src.draw("peer-1", 7, 40):
    t = get_task(ref)
    out.append([ref.model_dump(mode="json"), t.prompt, t.answer])
print(json.dumps(out))
"""


def _dump_here() -> list:
    src = TaskSource(MIXED, "swarm-x")
    return [[ref.model_dump(mode="json"), get_task(ref).prompt, get_task(ref).answer]
            for ref in src.draw("peer-1", 7, 40)]


def test_refs_regenerate_identically_in_another_process():
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    res = subprocess.run([sys.executable, "-c", _DUMP, json.dumps(MIXED)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    theirs = json.loads(res.stdout)
    ours = json.loads(json.dumps(_dump_here()))
    assert theirs == ours
    assert len({row[0]["dataset"] for row in ours}) > 3  # the mix really was mixed


@pytest.mark.parametrize("name", sorted(TOY_FAMILIES))
def test_toy_rewards(name):
    for index in range(20):
        task = get_task(TaskRef(dataset=name, seed=1, index=index))
        assert task.score(task.answer) == 1.0
        assert task.score(f" {task.answer}\n") == 1.0
        assert task.score(task.reference_completion) == 1.0
        wrong = str((int(task.answer) + 1) % 10)
        assert task.score(wrong) < 1.0
        assert task.score("no digits here") == 0.0
        assert task.score(f"{task.answer} because") == 0.5
        assert 0.0 < task.score(f"{wrong}{task.answer}") < 0.5


def test_digit_successor_prompt_and_answer():
    answers = Counter()
    for index in range(200):
        task = get_task(TaskRef(dataset="toy/digit_successor", seed=3, index=index))
        d = int(task.prompt.removeprefix("What digit comes after ").removesuffix("?"))
        assert task.answer == str(d + 1)
        answers[task.answer] += 1
    assert set(answers) == set("123456789")


@pytest.mark.parametrize("family", GENSYN_FAMILIES)
def test_reasoning_gym_ground_truth_scores_one(family):
    for index in (0, 17, 999_999):
        task = get_task(TaskRef(dataset=f"rg/{family}", seed=5, index=index))
        assert task.prompt and task.answer and task.system
        assert task.score(task.reference_completion) == 1.0
        assert task.score("<answer>certainly not this</answer>") < 1.0
        assert task.score("") < 1.0


def test_format_reward():
    ref = TaskRef(dataset="rg/basic_arithmetic", seed=1, index=4)
    plain, shaped = get_task(ref), get_task(ref, format_reward=0.25)
    assert plain.score(plain.answer) == 1.0  # no tag: the whole text is the answer
    assert shaped.score(shaped.answer) == pytest.approx(0.75)
    assert shaped.score(shaped.reference_completion) == 1.0
    assert shaped.score("<answer>nonsense</answer>") == pytest.approx(0.25)
    # the last <answer> tag counts; reasoning before it is fine
    assert plain.score(f"Let me think. 1+1=2. <answer>{plain.answer}</answer>") == 1.0


def test_system_prompt_is_named_and_checked():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    ref = TaskRef(dataset="rg/basic_arithmetic", seed=1, index=4)
    assert get_task(ref).system == SYSTEM_PROMPTS["default"]
    direct = get_task(ref, style=PromptStyle("direct"))
    assert direct.system == SYSTEM_PROMPTS["direct"] != SYSTEM_PROMPTS["default"]
    assert direct.prompt == get_task(ref).prompt and direct.score(direct.answer) == 1.0
    assert "direct" in system_prompt_names()
    with pytest.raises(NodeError, match="unknown system prompt 'chatty'.*direct"):
        get_task(ref, style=PromptStyle("chatty"))
    # toy tasks have no system prompt, whatever the setting
    toy = TaskRef(dataset="toy/digit_copy", seed=0, index=0)
    assert get_task(toy, 0.0, PromptStyle("direct", 2)).system is None


def test_few_shot_examples_come_first_as_chat_turns(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    ref = TaskRef(dataset="rg/basic_arithmetic", params=params, seed=1, index=4)
    two = get_task(ref, style=PromptStyle("direct", 2))
    assert len(two.examples) == 2 and get_task(ref).examples == ()
    # the examples are the same generator's (same params), answered in the tag format
    for question, answer in two.examples:
        assert question.startswith("Calculate ") and question != two.prompt
        assert answer.startswith("<answer>") and answer.endswith("</answer>")
    # fixed per generator, not per question: every prompt of the swarm shows the same ones
    assert two.examples == get_task(ref.model_copy(update={"index": 9}),
                                    style=PromptStyle("direct", 2)).examples
    text = tok.decode(format_prompt(tok, two))
    turns = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>"
             for q, a in two.examples]
    assert "\n".join(turns) + f"\n<|im_start|>user\n{two.prompt}<|im_end|>" in text
    assert text.startswith("<|im_start|>system\n") and text.endswith("assistant\n")
    with pytest.raises(NodeError, match="few_shot"):
        get_task(ref, style=PromptStyle("direct", MAX_FEW_SHOT + 1))


def test_generator_params_travel_in_drawn_refs():
    params = {"rg/basic_arithmetic": {"max_digits": 1, "max_terms": 2}}
    mix = {"rg/basic_arithmetic": 1.0, "toy/digit_copy": 1.0}
    plain, tuned = TaskSource(mix, "s"), TaskSource(mix, "s", params=params)
    refs = tuned.draw("p", 3, 16)
    for a, b in zip(plain.draw("p", 3, 16), refs):  # same draw; only params differ
        assert (a.dataset, a.seed, a.index) == (b.dataset, b.seed, b.index)
        assert b.params == params.get(b.dataset, {}) and a.params == {}
    assert {r.dataset for r in refs} == set(mix)
    rg = next(r for r in refs if r.dataset.startswith("rg/"))
    assert tuned.assigned("p", 3, rg) and not plain.assigned("p", 3, rg)  # verifiers differ
    with pytest.raises(NodeError, match="rg/basic_arithmetic"):
        TaskSource({"toy/digit_copy": 1.0}, "s", params=params)


def test_bad_refs_are_clear_errors():
    with pytest.raises(NodeError, match="toy/nope"):
        get_task(TaskRef(dataset="toy/nope", seed=0, index=0))
    with pytest.raises(NodeError, match="rg/no_such_generator"):
        get_task(TaskRef(dataset="rg/no_such_generator", seed=0, index=0))
    with pytest.raises(NodeError, match="must start with"):
        get_task(TaskRef(dataset="other/x", seed=0, index=0))
    with pytest.raises(NodeError, match="index"):
        get_task(TaskRef(dataset="rg/basic_arithmetic", seed=0, index=10**9))
    with pytest.raises(NodeError, match="params"):
        get_task(TaskRef(dataset="rg/basic_arithmetic", params={"bogus": 1}, seed=0, index=0))
    with pytest.raises(NodeError, match="params"):
        get_task(TaskRef(dataset="toy/digit_copy", params={"x": 1}, seed=0, index=0))


def test_task_source_is_deterministic_and_checkable():
    src = TaskSource({"toy/digit_successor": 1.0, "toy/digit_copy": 3.0}, "swarm-a")
    refs = src.draw("peer-1", 5, 16)
    assert refs == TaskSource({"toy/digit_copy": 3.0, "toy/digit_successor": 1.0},
                              "swarm-a").draw("peer-1", 5, 16)
    assert refs[:4] == src.draw("peer-1", 5, 4)  # prefix-stable
    assert len({(r.dataset, r.seed, r.index) for r in refs}) == 16
    assert refs != src.draw("peer-2", 5, 16)
    assert refs != src.draw("peer-1", 6, 16)
    assert refs != TaskSource({"toy/digit_successor": 1.0, "toy/digit_copy": 3.0},
                              "swarm-b").draw("peer-1", 5, 16)
    for ref in refs:
        assert src.assigned("peer-1", 5, ref)
        assert src.assigned("peer-1", 5, ref, n=16)
    assert not src.assigned("peer-2", 5, refs[0])
    assert not src.assigned("peer-1", 6, refs[0])
    assert src.assigned("peer-1", 5, refs[15], n=15) == (refs[15] in refs[:15])
    forged = TaskRef(dataset=refs[0].dataset, seed=refs[0].seed, index=(refs[0].index + 1))
    assert not src.assigned("peer-1", 5, forged)


def test_task_source_follows_the_weights():
    src = TaskSource({"toy/digit_successor": 1.0, "toy/digit_copy": 3.0,
                      "toy/digit_predecessor": 0.0}, "s")
    counts = Counter(ref.dataset for r in range(50) for ref in src.draw("p", r, 20))
    assert counts["toy/digit_predecessor"] == 0
    assert 0.65 < counts["toy/digit_copy"] / 1000 < 0.85


def test_task_source_rejects_bad_mixes():
    for mix in ({}, {"toy/nope": 1.0}, {"rg/no_such": 1.0}, {"toy/digit_copy": -1.0},
                {"toy/digit_copy": 0.0}, {"x": 1.0}):
        with pytest.raises(NodeError):
            TaskSource(mix, "s")
    with pytest.raises(NodeError):
        TaskSource({"toy/digit_copy": 1.0}, "s").draw("p", 0, 10_000)


def test_format_prompt_uses_the_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = get_task(TaskRef(dataset="toy/digit_successor", seed=0, index=0))
    ids = format_prompt(tok, task)
    text = tok.decode(ids)
    assert text == f"<|im_start|>user\n{task.prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert len(ids) < 24  # short prompts keep the toy task fast to learn
    rg = get_task(TaskRef(dataset="rg/basic_arithmetic", seed=0, index=0))
    rg_text = tok.decode(format_prompt(tok, rg))
    assert rg_text.startswith("<|im_start|>system\n") and rg.prompt in rg_text
    tok.chat_template = None
    plain = tok.decode(format_prompt(tok, task))
    assert plain == task.prompt + "\n"
