"""The RL trainer's command-line syntax for a component chosen by name, on top of torchtitan's (tyro):

    --rl.loss NAME [KEY=VALUE ...]      e.g.  --rl.loss dppo delta=0.05 mismatch.tis=true

A field typed as a loss config takes the registered name (``rl.losses``) and the fields to change from
that loss's defaults; an unknown name or field fails while the command line is parsed, naming the
registered losses or the loss's fields. ``install()`` adds the rule to torchtitan's parser; the trainer
module calls it, and every recipe imports the trainer before torchtitan parses the command line.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from titan_rl_ext.rl.losses import loss_config, loss_name, loss_names
from titan_rl_ext.rl.losses.base import PolicyLoss

_installed = False


def install() -> None:
    """Add the rule to torchtitan's tyro registry, once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    from torchtitan.config.manager import custom_registry

    custom_registry.primitive_rule(loss_rule)


def loss_rule(type_info: Any) -> Any:
    """tyro primitive rule: a ``PolicyLoss.Config`` field is ``NAME [KEY=VALUE ...]`` on the command line."""
    import tyro

    t = type_info.type
    if not (isinstance(t, type) and issubclass(t, PolicyLoss.Config)):
        return None
    return tyro.constructors.PrimitiveConstructorSpec(
        nargs="+",
        metavar="NAME [KEY=VALUE ...]",
        instance_from_str=parse_loss,
        is_instance=lambda instance: isinstance(instance, PolicyLoss.Config),
        str_from_instance=format_loss,
    )


def parse_loss(args: list[str]) -> PolicyLoss.Config:
    """``["dppo", "delta=0.05", "mismatch.tis=true"]`` -> that loss's config. Values are JSON (numbers,
    ``true``, ``null``), else taken as strings (``aggregation=seq_mean``)."""
    if not args or "=" in args[0]:
        raise ValueError(f"name the loss first: NAME [KEY=VALUE ...] with NAME one of {', '.join(loss_names())}")
    overrides: dict[str, Any] = {}
    for arg in args[1:]:
        key, sep, text = arg.partition("=")
        if not sep:
            raise ValueError(f"{arg!r} is not KEY=VALUE")
        *path, leaf = key.replace("-", "_").split(".")
        node = overrides
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = _value(text)
    return loss_config(args[0], **overrides)


def format_loss(config: PolicyLoss.Config) -> list[str]:
    """``parse_loss``'s inverse: the name, then each field that differs from the loss's defaults."""
    return [loss_name(config), *(f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                                 for k, v in _changed(config, type(config)()).items())]


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _changed(config: Any, default: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value, base = getattr(config, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_changed(value, base, f"{prefix}{f.name}."))
        elif value != base:
            out[f"{prefix}{f.name}"] = value
    return out
