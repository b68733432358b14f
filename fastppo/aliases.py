"""One setting, two names: TRL GRPO's (``epsilon``, ``max_completion_length``, ``num_iterations``) and TRL PPO's
(``cliprange``, ``response_length``, ``num_ppo_epochs``), both fields of ``PPOConfig``. The name the user gave
fills the other (``fill_aliases``) and is the one messages use (``given_name``); two different values are left
for ``checks.check_settings`` to refuse, naming both."""
from __future__ import annotations

GRPO_NAMES = {"max_completion_length": "response_length", "num_iterations": "num_ppo_epochs"}  # TRL GRPO's: TRL PPO's
ALIASES = {"epsilon": "cliprange", **GRPO_NAMES}  # every setting with two names: TRL GRPO's name -> TRL PPO's


class Untouched:
    """A number left at its field's default, marked so that ``__post_init__`` can tell it from the same number
    given by the user (``PPOConfig(cliprange=0.2, epsilon=0.3)`` names two values of one setting; ``cliprange``
    left alone and ``epsilon=0.3`` names one). The marks are dropped there: every field is a plain number after."""

    class Int(int):
        pass

    class Float(float):
        pass

    @staticmethod
    def of(value):
        return Untouched.Int(value) if isinstance(value, int) else Untouched.Float(value)

    @staticmethod
    def marked(value) -> bool:
        return isinstance(value, (Untouched.Int, Untouched.Float))

    @staticmethod
    def plain(value):
        return int(value) if isinstance(value, Untouched.Int) else float(value) if isinstance(value, Untouched.Float) \
            else value


def fill_aliases(config) -> None:
    """Each setting of two names filled from the name the user gave (or GRPOConfig's default), that name kept in
    ``config.given_as`` for the messages; both given with two values are left as they are, for the checks."""
    config.given_as = {}
    for grpo_name, ppo_name in ALIASES.items():
        grpo_value, ppo_value = getattr(config, grpo_name), getattr(config, ppo_name)
        if grpo_value is None or (Untouched.marked(grpo_value) and not Untouched.marked(ppo_value)):
            setattr(config, grpo_name, ppo_value)  # given by TRL PPO's name, or neither (a subclass's default)
        elif Untouched.marked(ppo_value):
            setattr(config, ppo_name, grpo_value)  # given by TRL GRPO's name (or GRPOConfig's default)
            config.given_as[ppo_name] = grpo_name  # the name the messages use
        for name in (grpo_name, ppo_name):
            setattr(config, name, Untouched.plain(getattr(config, name)))


def given_name(config, name: str) -> str:
    """The name a setting of two names goes by in this config (``max_completion_length`` for ``response_length``
    when the user, or GRPOConfig, gave that one): the one messages use."""
    return getattr(config, "given_as", {}).get(name, name)
