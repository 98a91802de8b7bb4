"""Components an RL run picks by name (``--rl.task``, ``--rl.loss``): a ``Registry`` per kind.

Each component is one module of its kind's package that registers itself when imported. The first
lookup imports every module of the package, so adding a component is adding its file; code outside
the package (a user's module, a test) registers the same way and is found once it has been imported.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, package: str) -> None:
        """``kind``: what the error messages call an entry (``task``); ``package``: where its modules live."""
        self.kind = kind
        self.package = package
        self._entries: dict[str, T] = {}
        self._discovered = False

    def register(self, name: str) -> Callable[[T], T]:
        """``@register(name)`` above a class or function: ``add`` it under ``name``."""
        return lambda entry: self.add(name, entry)

    def add(self, name: str, entry: T) -> T:
        # the same object again is a module imported twice (a test's, under another name): harmless
        if name in self._entries and self._entries[name] is not entry:
            raise ValueError(f"{self.kind} {name!r} is registered twice: {self._entries[name]!r} and {entry!r}")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        self._discover()
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        self._discover()
        return sorted(self._entries)

    def name_of(self, entry: T) -> str:
        """The name ``entry`` is registered under."""
        self._discover()
        for name, e in self._entries.items():
            if e is entry:
                return name
        raise ValueError(f"{entry!r} is not a registered {self.kind}; registered: {', '.join(self.names())}")

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True  # before the imports: a module that looks a name up must not recurse
        try:
            pkg = importlib.import_module(self.package)
            for info in pkgutil.iter_modules(pkg.__path__):
                importlib.import_module(f"{self.package}.{info.name}")
        except BaseException:
            self._discovered = False  # the next lookup fails the same way instead of missing entries
            raise
