"""Weight transports by name (``--rl.weight_transport NAME``; ``RLConfig.weight_transport``).

A transport is one module of this package: a class that meets ``base.WeightTransport`` (most extend
``base.HttpTransport``), built from the pusher's ``base.Link``, with ``@register_transport("name")`` above
it. Nothing else names it: the first lookup imports every module here, and the pusher finds it by that
name. A transport defined elsewhere (a test's) registers the same way and is found once its module is
imported.

A transport with settings of its own (``--rl.weight_transport_options``, ``WeightPusher(transport_options=...)``)
gives its class a ``check_options(options) -> dict`` that refuses a bad key or value (``ValueError`` naming it)
and returns them normalised; the trainer calls it at start-up (``check_transport_options``), before any model is
built, so a typo stops the run there and not at the first push. A transport without one takes no options.

A transport that pushes into one of the plugin's vLLM transfer engines names it: ``server_engine(options) -> str``
on its class. A server the run spawns is then started with that engine (``spawned_server``, ``server_flags``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from titan_rl_ext.rl.registry import Registry
from titan_rl_ext.rl.transports.base import Link, WeightTransport

TransportFactory = Callable[[Link], WeightTransport]

TRANSPORT_REGISTRY: Registry[TransportFactory] = Registry("weight transport", __name__)
register_transport = TRANSPORT_REGISTRY.register


def transport_names() -> list[str]:
    return TRANSPORT_REGISTRY.names()


def make_transport(name: str, link: Link) -> WeightTransport:
    """The transport registered as ``name``, sending through ``link`` (``ValueError`` naming the registered
    ones when there is none)."""
    return TRANSPORT_REGISTRY.get(name)(link)


def check_transport_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` for the transport registered as ``name``, checked without building it (no store opened, no
    generator called): ``ValueError`` naming an unknown transport, a key it does not take or a bad value."""
    factory = TRANSPORT_REGISTRY.get(name)
    check: Callable[[Mapping[str, Any]], dict[str, Any]] | None = getattr(factory, "check_options", None)
    if check is not None:
        return check(options)
    if options:
        raise ValueError(f"weight transport {name!r} takes no options, got {sorted(options)}")
    return {}


def spawned_server(name: str, options: Mapping[str, Any], args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The arguments and the extra environment of a server the run spawns for the transport registered as
    ``name`` (``options``: checked ones; ``args``: the user's ``rl.server_args``): ``args`` unchanged for a
    transport that needs nothing of the server; for one that pushes into a vLLM transfer engine, its flags added
    (``server_flags.with_engine``: ``ValueError`` naming both when ``args`` configure another engine)."""
    from titan_rl_ext.rl.transports import server_flags

    engine: Callable[[Mapping[str, Any]], str] | None = getattr(TRANSPORT_REGISTRY.get(name), "server_engine", None)
    if engine is None:
        return list(args), {}
    return server_flags.with_engine(args, engine(options), name), dict(server_flags.ENGINE_ENV)


__all__ = ["TRANSPORT_REGISTRY", "Link", "WeightTransport", "check_transport_options", "make_transport",
           "register_transport", "spawned_server", "transport_names"]
