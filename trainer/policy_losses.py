"""The policy losses the learner can train with, each declared once with the traits the learner reads
from it, and the config that picks one (`learner.loss`).

A loss is a `PolicyLoss`: the function of one micro-batch plus what the learner must know to call it
(what it averages over, whether it needs the log-probs before the step's first update, how SAT measures
staleness for it, the class of its own knobs). The built-in losses register under their names; a
user's loss is named `module:attribute`, the module is imported and the attribute is a `PolicyLoss` (or
a plain function of `(LossInputs, LossConfig)`, taken with the default traits), as a user's env is
named `module:Name-v0`:

    # my_losses.py
    from pacerl.trainer.policy_losses import LossInputs, PolicyLoss
    from pacerl.trainer.losses import gspo_loss, ClipConfig

    @dataclass(frozen=True)
    class Settings:
        scale: float = 1.0

    def scaled(inputs: LossInputs, config: LossConfig) -> LossOutput: ...
    SCALED = PolicyLoss(scaled, settings=Settings, sat="sequence")

    pacerl train learner.loss.name=my_losses:SCALED learner.loss.options='{"scale": 0.5}'

A built-in loss's knobs sit in its section of `LossConfig` (`gspo`, `grpo`, ...); a user's in
`learner.loss.options`, given to its settings class. Either way `LossConfig.settings` is the chosen
loss's.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from pacerl.trainer.losses import (
    ClipConfig,
    LossOutput,
    SATConfig,
    decoupled_ppo_loss,
    gmc_loss,
    grpo_loss,
    gspo_loss,
)
from pacerl.trainer.plugins import Registry, chosen_settings

Anchor = Literal["behaviour", "recompute"]
Aggregation = Literal["sequence", "token"]
Entries = Literal["token", "sequence", "group"]


@dataclass(frozen=True)
class GSPOSettings:
    """gspo and gspo_token (GSPO, arXiv 2507.18071)."""

    ratio_anchor: Anchor = "behaviour"
    """The ratio's denominator: the rollout engine's log-probs (SAT, slime), or the trainer's own before
    the update (then the ratio starts at 1 and staleness is not corrected)."""

    def __post_init__(self) -> None:
        check_choice("gspo.ratio_anchor", self.ratio_anchor, typing.get_args(Anchor))


@dataclass(frozen=True)
class GRPOSettings:
    """grpo: the token-level clipped ratio."""

    ratio_anchor: Anchor = "behaviour"
    """As `GSPOSettings.ratio_anchor`."""
    aggregation: Aggregation = "token"
    """Mean of per-sequence token means (the paper's 1/|o_i|), or one mean over all tokens (DAPO)."""

    def __post_init__(self) -> None:
        check_choice("grpo.ratio_anchor", self.ratio_anchor, typing.get_args(Anchor))
        check_choice("grpo.aggregation", self.aggregation, typing.get_args(Aggregation))


@dataclass(frozen=True)
class DecoupledPPOSettings:
    """decoupled_ppo: AReaL's proximal policy with a behaviour weight."""

    behaviour_weight: Literal["none", "mask", "truncate"] = "mask"
    """The π_prox/μ weight: masked above the cap (AReaL), truncated at it (TIS), or off."""
    weight_cap: float = 5.0
    """The cap of the behaviour weight. > 1."""
    aggregation: Aggregation = "token"
    """As `GRPOSettings.aggregation`."""

    def __post_init__(self) -> None:
        check_choice("decoupled_ppo.behaviour_weight", self.behaviour_weight, ("none", "mask", "truncate"))
        check_choice("decoupled_ppo.aggregation", self.aggregation, typing.get_args(Aggregation))
        if not self.weight_cap > 1:
            raise ValueError(f"decoupled_ppo.weight_cap must be > 1, got {self.weight_cap!r}")


@dataclass(frozen=True)
class GMCSettings:
    """gmc: group-mass capping (arXiv 2610.01896)."""

    eps: float = 0.2
    """A group's importance mass is capped at G·(1 + eps). > 0."""

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"gmc.eps must be > 0, got {self.eps!r}")


def check_choice(name: str, value: object, choices: tuple[Any, ...]) -> None:
    """ValueError naming `name` unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch as every policy loss sees it (`[B, T]` per token, `[B]` per sequence)."""

    logprobs: torch.Tensor
    """log π_θ of the targets, with gradient."""
    proximal: torch.Tensor
    """log-probs before the step's first update (detached): decoupled PPO's π_prox, `recompute`'s anchor."""
    behaviour: torch.Tensor
    """The rollout engine's log-probs, log μ."""
    advantages: torch.Tensor
    """One per sequence."""
    mask: torch.Tensor
    """True on trainable tokens."""
    groups: torch.Tensor
    """Group index per sequence (GMC caps each group's importance mass)."""
    sat_threshold: torch.Tensor | None
    """SAT's quantile over the whole mini-batch; None: the loss takes this micro-batch's."""
    denominator: float
    """The whole mini-batch's count its mean is over (`PolicyLoss.mean_unit`): its trainable tokens for
    a token mean, its sequences with trainable tokens for a sequence mean."""


def _sequence_mean(settings: object) -> Aggregation:
    return "sequence"


def _no_proximal(settings: object) -> bool:
    return False


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss and the traits the learner reads from it, declared once."""

    compute: Callable[[LossInputs, LossConfig], LossOutput]
    """The loss of one micro-batch, normalised by `inputs.denominator` so that micro-batches add up to
    the whole mini-batch's loss; reads its knobs from `config.settings`."""
    settings: type | None = None
    """The class of its own knobs (a dataclass): a built-in loss's section of `LossConfig`, or built
    from `learner.loss.options` for a user's loss; None: it takes no options."""
    mean_unit: Callable[[Any], Aggregation] = _sequence_mean
    """What it averages over, given its settings: `token` (then `denominator` is the mini-batch's
    trainable tokens) or `sequence` (its sequences)."""
    entries: Entries = "sequence"
    """What its `clip_fraction` and SAT shares count, which weighs them when micro-batches are averaged."""
    uses_proximal: Callable[[Any], bool] = _no_proximal
    """Whether, given its settings, it needs `inputs.proximal` (then the learner spends a no-grad pass
    over the batch before a step of several updates)."""
    sat: Literal["sequence", "token"] | None = None
    """How SAT's quantile over a mini-batch is taken for it: over each sequence's mean log-ratio (GSPO),
    over tokens, or None: the loss applies no SAT and needs no quantile."""
    section: str = ""
    """A built-in loss's section of `LossConfig` holding its settings ("" for a user's loss)."""


def _clip(cfg: LossConfig) -> ClipConfig:
    return ClipConfig(cfg.eps_low, cfg.eps_high)


def sat_config(cfg: LossConfig) -> SATConfig | None:
    """The SAT settings of `cfg`, or None when SAT is off."""
    return SATConfig(cfg.sat_quantile, cfg.sat_kernel) if cfg.sat else None


def _anchor(inputs: LossInputs, anchor: Anchor) -> torch.Tensor:
    return inputs.behaviour if anchor == "behaviour" else inputs.proximal


def _gspo(inputs: LossInputs, cfg: LossConfig, *, token_level: bool) -> LossOutput:
    return gspo_loss(
        inputs.logprobs,
        _anchor(inputs, cfg.gspo.ratio_anchor),
        inputs.advantages,
        inputs.mask,
        _clip(cfg),
        token_level,
        sat_config(cfg),
        inputs.behaviour,
        sat_threshold=inputs.sat_threshold,
        denominator=inputs.denominator,
    )


def _grpo(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    return grpo_loss(
        inputs.logprobs,
        _anchor(inputs, cfg.grpo.ratio_anchor),
        inputs.advantages,
        inputs.mask,
        _clip(cfg),
        cfg.grpo.aggregation,
        sat_config(cfg),
        inputs.behaviour,
        sat_threshold=inputs.sat_threshold,
        denominator=inputs.denominator,
    )


def _decoupled_ppo(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    return decoupled_ppo_loss(
        inputs.logprobs,
        inputs.proximal,
        inputs.behaviour,
        inputs.advantages,
        inputs.mask,
        _clip(cfg),
        behaviour_weight=cfg.decoupled_ppo.behaviour_weight,
        weight_cap=cfg.decoupled_ppo.weight_cap,
        aggregation=cfg.decoupled_ppo.aggregation,
        sat=sat_config(cfg),
        sat_threshold=inputs.sat_threshold,
        denominator=inputs.denominator,
    )


def _gmc(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    return gmc_loss(
        inputs.logprobs,
        inputs.behaviour,
        inputs.advantages,
        inputs.mask,
        inputs.groups,
        eps=cfg.gmc.eps,
        denominator=inputs.denominator,
    )


def _recomputes(settings: GSPOSettings | GRPOSettings) -> bool:
    return settings.ratio_anchor == "recompute"


def _aggregation(settings: GRPOSettings | DecoupledPPOSettings) -> Aggregation:
    return settings.aggregation


def _gspo_loss(token_level: bool) -> PolicyLoss:
    return PolicyLoss(
        functools.partial(_gspo, token_level=token_level),
        GSPOSettings,
        uses_proximal=_recomputes,
        sat="sequence",
        section="gspo",
    )


_BUILT_IN: dict[str, PolicyLoss] = {
    "gspo": _gspo_loss(token_level=False),
    "gspo_token": _gspo_loss(token_level=True),
    "grpo": PolicyLoss(
        _grpo,
        GRPOSettings,
        mean_unit=_aggregation,
        entries="token",
        uses_proximal=_recomputes,
        sat="token",
        section="grpo",
    ),
    "decoupled_ppo": PolicyLoss(
        _decoupled_ppo,
        DecoupledPPOSettings,
        mean_unit=_aggregation,
        entries="token",
        uses_proximal=lambda settings: True,
        sat="token",
        section="decoupled_ppo",
    ),
    "gmc": PolicyLoss(_gmc, GMCSettings, entries="group", section="gmc"),
}


def _as_loss(found: object) -> PolicyLoss | None:
    if isinstance(found, PolicyLoss):
        return found
    return PolicyLoss(found) if callable(found) and not isinstance(found, type) else None


LOSSES: Registry[PolicyLoss] = Registry("loss", _as_loss, "a PolicyLoss or a loss function")
LOSSES.update(_BUILT_IN)
"""`learner.loss.name` → the loss: the built-ins, and any a module adds with `register_loss`."""
BUILT_IN_LOSSES: tuple[str, ...] = tuple(LOSSES)
"""The losses pacerl ships."""


def register_loss(name: str, loss: PolicyLoss) -> None:
    """Make `loss` trainable as `learner.loss.name=<name>` (a module that registers is named
    `module:name`, so that it is imported first)."""
    LOSSES.register(name, loss)


def policy_loss(name: str) -> PolicyLoss:
    """The loss named `name`: a registered one, or `module:attribute` (the module imported, the
    attribute a `PolicyLoss`, a plain loss function taken with the default traits, or a name the module
    registered). A ValueError says what is wrong."""
    return LOSSES.lookup(name)


@dataclass(frozen=True)
class LossConfig:
    """Which policy loss, its trust region and its regularisers. The knobs of one built-in loss alone sit
    in that loss's section (`gspo`, `grpo`, `decoupled_ppo`, `gmc`), a user's loss's in `options`; only
    the chosen loss's are read, so a sweep over `name` can keep every section set."""

    moved_keys: typing.ClassVar[dict[str, str]] = {
        "ratio_anchor": "gspo.ratio_anchor or grpo.ratio_anchor",
        "aggregation": "grpo.aggregation or decoupled_ppo.aggregation",
        "behaviour_weight": "decoupled_ppo.behaviour_weight",
        "weight_cap": "decoupled_ppo.weight_cap",
        "gmc_eps": "gmc.eps",
    }
    """Keys of earlier versions → where they live now (the config loader names the new place)."""

    name: str = "gspo"
    """gspo | gspo_token (GSPO, arXiv 2507.18071), grpo (token clip), decoupled_ppo (AReaL's proximal
    policy with a behaviour weight), gmc (group-mass capping, arXiv 2610.01896), or a user's loss as
    module:name (`pacerl.trainer.policy_losses`)."""
    eps_low: float = 0.2
    """Lower clip radius of gspo, gspo_token, grpo and decoupled_ppo (the SAT paper's comparisons use 0.2
    on both sides)."""
    eps_high: float = 0.2
    """Upper clip radius (DAPO's clip-higher sets it above eps_low)."""
    sat: bool = True
    """Staleness-adaptive trust region (SAT, arXiv 2607.18722) on gspo, gspo_token, grpo, decoupled_ppo."""
    sat_quantile: float = 0.9
    """SAT gates entries whose |log π_θ − log μ| exceeds this quantile of the mini-batch."""
    sat_kernel: Literal["cauchy", "rational"] = "cauchy"
    """SAT's contraction kernel (a reconstruction; see `pacerl.trainer.losses.sat_bounds`)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the initial policy (0: no reference model is kept)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (subtracted from the loss)."""
    gspo: GSPOSettings = field(default_factory=GSPOSettings)
    """gspo's and gspo_token's own knobs."""
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    """grpo's own knobs."""
    decoupled_ppo: DecoupledPPOSettings = field(default_factory=DecoupledPPOSettings)
    """decoupled_ppo's own knobs."""
    gmc: GMCSettings = field(default_factory=GMCSettings)
    """gmc's own knobs."""
    options: dict[str, Any] = field(default_factory=dict)
    """A user's loss's own knobs, given to its `PolicyLoss.settings` class (a built-in loss takes none)."""

    def __post_init__(self) -> None:
        self.settings  # noqa: B018 (a user's options are checked by building its settings)
        ClipConfig(self.eps_low, self.eps_high)
        SATConfig(self.sat_quantile, self.sat_kernel)
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("need kl_coef >= 0 and entropy_coef >= 0")

    @property
    def loss(self) -> PolicyLoss:
        """The chosen loss."""
        return policy_loss(self.name)

    @property
    def settings(self) -> Any:
        """The chosen loss's own knobs: its section, its `options` built into its settings class, or None."""
        return chosen_settings(self, self.name, self.loss, self.options, "learner.loss.options")

    @property
    def mean_unit(self) -> Aggregation:
        """What the chosen loss averages over (`PolicyLoss.mean_unit`)."""
        return self.loss.mean_unit(self.settings)

    @property
    def uses_proximal(self) -> bool:
        """Whether the chosen loss reads the log-probs before the step's first update."""
        return self.loss.uses_proximal(self.settings)
