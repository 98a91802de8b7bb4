"""Policy-gradient losses by name (``--rl.loss NAME [KEY=VALUE ...]``; ``RLConfig.loss``).

A loss is one module of this package: a ``PolicyLoss`` subclass (``base``) with its ``Config``, above it
``@register_loss("name")``. Nothing else names it: the first lookup imports every module here, and the
command line, the recipes and the trainer find it by that name. A loss defined elsewhere registers the
same way and is found once its module is imported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from titan_rl_ext.rl.losses.base import PolicyLoss
from titan_rl_ext.rl.registry import Registry

LOSS_REGISTRY: Registry[type[PolicyLoss]] = Registry("loss", __name__)
register_loss = LOSS_REGISTRY.register


def loss_names() -> list[str]:
    return LOSS_REGISTRY.names()


def loss_config(name: str, **overrides: Any) -> PolicyLoss.Config:
    """The named loss's ``Config`` with ``overrides`` (a nested config's fields as a dict:
    ``mismatch={"tis": True}``); an unknown field is an error naming the loss's fields."""
    return _replace(LOSS_REGISTRY.get(name).Config(), overrides, name)


def loss_name(config: PolicyLoss.Config) -> str:
    """The name the loss of ``config`` is registered under."""
    return LOSS_REGISTRY.name_of(type(config)._owner)  # type: ignore[arg-type]


def _replace(config: Any, overrides: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(config)}
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in names:
            raise ValueError(f"loss {where!r} has no field {key!r}; its fields: {', '.join(sorted(names))}")
        current = getattr(config, key)
        # a nested config takes a dict of its own fields; anything else is the value itself
        changes[key] = (_replace(current, value, f"{where}.{key}")
                        if dataclasses.is_dataclass(current) and isinstance(value, dict) else value)
    return dataclasses.replace(config, **changes)
