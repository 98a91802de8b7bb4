"""Weight transports by name (``--rl.weight_transport NAME``; ``RLConfig.weight_transport``).

A transport is one module of this package: a class that meets ``base.WeightTransport`` (most extend
``base.HttpTransport``), built from the pusher's ``base.Link``, with ``@register_transport("name")`` above
it. Nothing else names it: the first lookup imports every module here, and the pusher finds it by that
name. A transport defined elsewhere (a test's) registers the same way and is found once its module is
imported.
"""

from __future__ import annotations

from collections.abc import Callable

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


__all__ = ["TRANSPORT_REGISTRY", "Link", "WeightTransport", "make_transport", "register_transport",
           "transport_names"]
