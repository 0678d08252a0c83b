"""Swarm settings travel with the policy (NODE_SPEC 7.1, `CheckpointManifest.settings`).

The trainer signs, in each manifest, the settings its policy is used with: protocol
version, base model, task mix, tasks per round, format reward weight, prompt style (system
prompt name, few-shot examples), group size and sampling parameters. A follower compares them with its own config, field by field:
- equal: nothing to do;
- different and NOT set by the operator (a default): adopted, logged once;
- different and set explicitly (TOML or a flag), or another protocol version: the policy is
  refused with one line naming each difference (`settings_mismatch`).
The model dtype and context length travel too but are informational: hardware may differ
and verification tolerates it, so they are never adopted nor refused.
"""

from __future__ import annotations

import logging

from ...protocol import PROTOCOL_VERSION
from ...protocol.messages import SamplingParams, SwarmSettings
from ..errors import NodeError
from ..tasks import MAX_FEW_SHOT, TaskSource, system_prompt_names

log = logging.getLogger(__name__)

# settings field -> (config section, config field)
ADOPTABLE = {
    "model_id": ("model", "name"),
    "task_mix": ("tasks", "mix"),
    "task_params": ("tasks", "params"),
    "tasks_per_round": ("tasks", "tasks_per_round"),
    "format_reward": ("tasks", "format_reward"),
    "system_prompt": ("tasks", "system_prompt"),
    "few_shot": ("tasks", "few_shot"),
    "completions_per_task": ("sampler", "completions_per_task"),
    "temperature": ("sampler", "temperature"),
    "top_p": ("sampler", "top_p"),
    "top_k": ("sampler", "top_k"),
    "max_new_tokens": ("sampler", "max_new_tokens"),
}


def swarm_settings(cfg) -> SwarmSettings:
    """The settings a trainer announces, from its node config."""
    s = cfg.sampler
    return SwarmSettings(
        protocol_version=PROTOCOL_VERSION, model_id=cfg.model.name[:128],
        dtype=cfg.model.dtype, max_context=cfg.model.max_context,
        task_mix={k: float(v) for k, v in cfg.tasks.mix.items()},
        tasks_per_round=cfg.tasks.tasks_per_round, format_reward=cfg.tasks.format_reward,
        completions_per_task=s.completions_per_task, system_prompt=cfg.tasks.system_prompt,
        few_shot=cfg.tasks.few_shot, task_params=cfg.tasks.params,
        sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_new_tokens=s.max_new_tokens))


def _announced(settings: SwarmSettings) -> dict:
    flat = settings.model_dump()
    flat.update(flat.pop("sampling"))
    return flat


class SettingsFollower:
    """A follower's side: `check(settings)` adopts what it may and returns the refusal line
    (None when the policy can be used). `model_changed` tells the role to reload its model
    from the checkpoint (the checkpoint directory is a complete model directory)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.adopted: dict[str, object] = {}
        self.refused: str | None = None
        self.model_changed = False
        self._logged: set[str] = set()
        self.view: dict = {"adopted": self.adopted, "refused": None}  # live, for /status

    def _explicit(self, section: str, field: str) -> bool:
        return field in getattr(self.cfg, section).model_fields_set

    def check(self, settings: SwarmSettings | None, trainer: str = "") -> str | None:
        if settings is None:
            return None  # the trainer announces nothing: local settings apply
        if settings.protocol_version != PROTOCOL_VERSION:
            return self._refuse(trainer, [(f"protocol version {settings.protocol_version} "
                                          f"(this node speaks {PROTOCOL_VERSION})")])
        diffs, adopt = [], {}
        for name, value in _announced(settings).items():
            if name not in ADOPTABLE:
                continue
            section, field = ADOPTABLE[name]
            mine = getattr(getattr(self.cfg, section), field)
            if mine == value or self.adopted.get(name) == value:
                continue
            if self._explicit(section, field) and name not in self.adopted:
                diffs.append(f"{section}.{field} = {mine!r} here, {value!r} in the swarm")
            else:
                adopt[name] = value
        if {"task_mix", "task_params"} & set(adopt):
            mix = adopt.get("task_mix", self.cfg.tasks.mix)
            params = adopt.get("task_params", self.cfg.tasks.params)
            if problem := _task_mix_problem(mix, params):
                diffs.append(problem)
        if "system_prompt" in adopt and adopt["system_prompt"] not in system_prompt_names():
            diffs.append(f"tasks.system_prompt {adopt['system_prompt']!r} is unknown here")
        if adopt.get("few_shot", 0) > MAX_FEW_SHOT:
            diffs.append(f"tasks.few_shot {adopt['few_shot']} is over {MAX_FEW_SHOT} here")
        if diffs:
            return self._refuse(trainer, diffs)
        self.refused = self.view["refused"] = None
        for name, value in adopt.items():
            section, field = ADOPTABLE[name]
            if name == "model_id":
                self.model_changed = True  # loaded from the checkpoint itself, see role
            else:
                setattr(getattr(self.cfg, section), field, value)
            self.adopted[name] = value
        if adopt:
            log.info("adopted the swarm settings of trainer %s: %s", trainer[-8:] or "?",
                     ", ".join(f"{ADOPTABLE[k][0]}.{ADOPTABLE[k][1]} = {v!r}"
                               for k, v in adopt.items()))
        return None

    def _refuse(self, trainer: str, diffs: list[str]) -> str:
        line = (f"refusing the policy of trainer {trainer[-8:] or '?'}: its swarm settings "
                f"differ: {'; '.join(diffs)} (remove these settings to adopt the swarm's, "
                f"or follow another trainer)")
        if line not in self._logged:  # one line per distinct refusal, not one per advert
            self._logged.add(line)
            log.error("%s", line)
        self.refused = self.view["refused"] = line
        return line


def _task_mix_problem(mix: dict[str, float], params: dict) -> str | None:
    """Why this node cannot draw tasks from `mix` with `params` (e.g. a task it does not
    know)."""
    try:
        TaskSource(mix, "check", params=params)
    except NodeError as e:
        return f"tasks.mix {mix!r} with params {params!r} cannot be used here: {e}"
    return None
