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

Adopting never changes the node's config (it is read-only): each accepted manifest yields
an `EffectiveSettings`, the config with the adopted fields applied, bound to that checkpoint;
the role switches to it when it loads the checkpoint and hands it to every round.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ...protocol import PROTOCOL_VERSION
from ...protocol.messages import SamplingParams, SwarmSettings
from ..config import Config
from ..errors import ConfigError, NodeError
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


@dataclass(frozen=True)
class EffectiveSettings:
    """The settings a follower samples with, as one immutable value: its own (read-only)
    config with the swarm settings it adopted applied. A role binds one to each checkpoint it
    loads and hands it to each round (the worker reads nothing else), so a round never sees
    half an adoption; swapping it is one assignment on the event loop, between rounds."""

    config: Config
    """The node's config with the adopted fields replaced (validated, read-only)."""
    adopted: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    """Announced setting name -> value, for what differs from this node's config."""
    model_id: str = ""
    """The base model the policy is used with: the trainer's when adopted (then loaded from
    the checkpoint directory itself), else this node's `model.name`."""

    @classmethod
    def local(cls, cfg: Config) -> EffectiveSettings:
        """No trainer settings (yet): this node's own."""
        return cls(cfg, MappingProxyType({}), cfg.model.name)

    @classmethod
    def adopting(cls, cfg: Config, adopt: Mapping[str, object]) -> EffectiveSettings:
        overrides = {".".join(ADOPTABLE[k]): v for k, v in adopt.items() if k != "model_id"}
        config = cfg.with_overrides(overrides, "swarm settings") if overrides else cfg
        return cls(config, MappingProxyType(dict(adopt)),
                   str(adopt.get("model_id", cfg.model.name)))


class SettingsFollower:
    """A follower's side: `check(settings, trainer, version)` (the manifest gate's hook)
    decides whether a policy can be used with this node's config and returns the refusal
    line (None: usable); `effective_for(trainer, version)` is the `EffectiveSettings` of an
    accepted checkpoint. The node's config is never changed."""

    KEEP = 16  # accepted versions whose settings are remembered (a follower loads the newest)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.local = EffectiveSettings.local(cfg)
        self.refused: str | None = None
        self.refused_version = -1  # the version of the newest refused manifest
        self._by_version: OrderedDict[tuple[str, int], EffectiveSettings] = OrderedDict()
        self._logged: set[str] = set()
        self._adopted_logged: dict[str, object] = {}
        self.view: dict = {"adopted": {}, "refused": None}  # for /status

    @property
    def adopted(self) -> dict[str, object]:
        """What the newest accepted policy's settings change here (for /status, tests)."""
        return dict(self.view["adopted"])

    def effective_for(self, trainer: str | None, version: int) -> EffectiveSettings:
        """The settings of an accepted checkpoint; for a version not checked in this run,
        those of the trainer's newest accepted one; else (none accepted, or its manifests
        carry no settings) this node's own."""
        exact = self._by_version.get((trainer or "", version))
        if exact is not None:
            return exact
        theirs = [s for (t, _), s in self._by_version.items() if t == (trainer or "")]
        return theirs[-1] if theirs else self.local

    def _explicit(self, section: str, field: str) -> bool:
        return field in getattr(self.cfg, section).model_fields_set

    def check(self, settings: SwarmSettings | None, trainer: str = "",
              version: int = -1) -> str | None:
        if settings is None:  # the trainer announces nothing: local settings apply
            self._remember(trainer, version, self.local)
            return None
        if settings.protocol_version != PROTOCOL_VERSION:
            return self._refuse(trainer, [(f"protocol version {settings.protocol_version} "
                                          f"(this node speaks {PROTOCOL_VERSION})")], version)
        diffs, adopt = [], {}
        for name, value in _announced(settings).items():
            if name not in ADOPTABLE:
                continue
            section, field_ = ADOPTABLE[name]
            mine = getattr(getattr(self.cfg, section), field_)
            if mine == value:
                continue
            if self._explicit(section, field_):
                diffs.append(f"{section}.{field_} = {mine!r} here, {value!r} in the swarm")
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
        if not diffs:
            try:
                effective = EffectiveSettings.adopting(self.cfg, adopt)
            except ConfigError as e:  # a value our config cannot hold (out of its range)
                diffs.append(str(e).removeprefix("invalid configuration: "))
        if diffs:
            return self._refuse(trainer, diffs, version)
        self.refused = self.view["refused"] = None
        self.refused_version = -1
        self._remember(trainer, version, effective)
        self.view["adopted"] = dict(adopt)
        if adopt and adopt != self._adopted_logged:  # once per distinct adoption
            self._adopted_logged = dict(adopt)
            log.info("adopted the swarm settings of trainer %s: %s", trainer[-8:] or "?",
                     ", ".join(f"{ADOPTABLE[k][0]}.{ADOPTABLE[k][1]} = {v!r}"
                               for k, v in adopt.items()))
        return None

    def _remember(self, trainer: str, version: int, effective: EffectiveSettings) -> None:
        self._by_version[(trainer, version)] = effective
        self._by_version.move_to_end((trainer, version))
        while len(self._by_version) > self.KEEP:
            self._by_version.popitem(last=False)

    def _refuse(self, trainer: str, diffs: list[str], version: int) -> str:
        line = (f"refusing the policy of trainer {trainer[-8:] or '?'}: its swarm settings "
                f"differ: {'; '.join(diffs)} (remove these settings to adopt the swarm's, "
                f"or follow another trainer)")
        if line not in self._logged:  # one line per distinct refusal, not one per advert
            self._logged.add(line)
            log.error("%s", line)
        self.refused = self.view["refused"] = line
        self.refused_version = max(self.refused_version, version)
        return line


def _task_mix_problem(mix: dict[str, float], params: dict) -> str | None:
    """Why this node cannot draw tasks from `mix` with `params` (e.g. a task it does not
    know)."""
    try:
        TaskSource(mix, "check", params=params)
    except NodeError as e:
        return f"tasks.mix {mix!r} with params {params!r} cannot be used here: {e}"
    return None
