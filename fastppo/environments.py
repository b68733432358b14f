"""Environments of a rollout (TRL 1.16 GRPOTrainer's ``environment_factory=``), as TRL holds them:

* ``environment_factory`` is one callable or a dict of them, a row's ``environment`` field choosing its factory;
  each factory is called once at construction (a probe, and the pool's first instance) and its class read: a
  ``reset`` it must have, an optional ``get_reward``, and its other public methods, which become the tools of the
  rows it serves (beside the run's own ``tools``), each bound to the row's own instance;
* every rollout gets an instance of its own (each of a prompt's ``num_generations`` completions too), taken from a
  pool reused from batch to batch and grown when a batch needs more (the instances in ``held`` are skipped: dynamic
  sampling holds a batch's earlier rounds', so that each kept rollout keeps its environment as its round left it);
* before sampling, ``reset(**row)`` (without the ``environment`` field of a dict of factories) runs for each rollout,
  and a string it returns is appended to the prompt's last message;
* a class's ``get_reward()`` is a reward source of its own, named after the class, weighted 1, after the
  ``reward_funcs``: ``None`` for the rollouts of another class (not judged). Every reward function gets the rollouts'
  ``environments``.
"""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

from fastppo.errors import SettingsError
from fastppo.tools import check_tools

UNNAMED = None  # the key of a single factory


class Environments:
    """The factories, their tools, their reward functions and the pool of instances."""

    def __init__(self, factory, tools: list[Callable]):
        self.multi = isinstance(factory, dict)
        self.factories = dict(factory) if self.multi else {UNNAMED: factory}
        if not self.factories or not all(callable(f) for f in self.factories.values()):
            raise SettingsError("environment_factory must be a callable that returns an environment, or a dict of "
                                "them by name")
        self.pool: dict = {}
        self.held: set[int] = set()  # the ids of instances assign() does not hand out (dynamic sampling's)
        self.tools: dict = {}  # name -> the probe's public methods (with the run's tools): the schemas shown
        self.reward_fns: list[Callable] = []
        classes = []
        for name, make in self.factories.items():
            instance = make()
            kind = type(instance)
            members = dict(inspect.getmembers(kind, predicate=inspect.isfunction))
            if "reset" not in members:
                raise SettingsError("Each environment instance returned by `environment_factory` must define a "
                                    "callable `reset`.")
            methods = [getattr(instance, m) for m in sorted(members)
                       if m not in ("reset", "get_reward") and not m.startswith("_")]
            self.tools[name] = check_tools(list(tools) + methods)
            self.pool[name] = [instance]
            if "get_reward" in members and kind not in classes:
                classes.append(kind)
                self.reward_fns.append(_reward_of(kind))
        self._standalone = list(tools)

    @property
    def has_tools(self) -> bool:
        return any(self.tools.values())

    def assign(self, rows: list[dict]) -> tuple[list, list[str | None]]:
        """One instance per rollout from the pool (grown where a batch needs more), and each one's factory name."""
        names = []
        for row in rows:
            name = row.get("environment") if self.multi else UNNAMED
            if name not in self.factories:
                raise SettingsError(f"Example has `environment={name!r}`, which is not among the environments passed "
                                    f"to `environment_factory`. Expected one of: {list(self.factories)}.")
            names.append(name)
        used: dict = {}
        instances = []
        for name in names:
            index = used.get(name, 0)
            while index < len(self.pool[name]) and id(self.pool[name][index]) in self.held:
                index += 1
            if index == len(self.pool[name]):
                self.pool[name].append(self.factories[name]())
            used[name] = index + 1
            instances.append(self.pool[name][index])
        return instances, names

    def row_tools(self, instance) -> list[Callable]:
        """The tools of a rollout: the run's, then its own instance's public methods."""
        members = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
        return self._standalone + [getattr(instance, m) for m in sorted(members)
                                   if m not in ("reset", "get_reward") and not m.startswith("_")]

    def reset(self, instances: list, rows: list[dict], prompts: list[list[dict]]) -> list[list[dict]]:
        """Each rollout's ``reset(**row)``; a string it returns appended to the last message of its prompt (a copy)."""
        out = []
        for instance, row, prompt in zip(instances, rows, prompts):
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else dict(row)
            observation = instance.reset(**kwargs)
            if observation is None:
                out.append(prompt)
                continue
            if not isinstance(observation, str):
                raise SettingsError(f"{type(instance).__name__}.reset returned {type(observation).__name__}: it "
                                    "returns a string (appended to the prompt's last message) or None")
            last = prompt[-1]
            out.append(list(prompt[:-1]) + [{**last, "content": last["content"] + observation}])
        return out


def _reward_of(kind: type) -> Callable:
    """An environment class's ``get_reward`` as a reward function: its score for the rollouts of that class, None
    (not judged) for the others; named after the class, as TRL logs it. An ``async`` one is awaited, the rollouts'
    calls together, beside the other async rewards."""
    if inspect.iscoroutinefunction(kind.get_reward):
        async def get_reward(environments, **kwargs):
            async def one(e):
                return await e.get_reward() if type(e) is kind else None

            return list(await asyncio.gather(*map(one, environments)))
    else:
        def get_reward(environments, **kwargs):
            return [e.get_reward() if type(e) is kind else None for e in environments]

    get_reward.__name__ = get_reward.__qualname__ = kind.__name__
    return get_reward
