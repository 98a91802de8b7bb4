"""``require(name)``: import an optional dependency for a test, skipping only where it is not installed.

``pytest.importorskip`` also skips when the package is installed but fails to import, which turns a broken
install (the case a test should catch) into a quiet skip. Here an installed package is imported for real and
its error fails the test."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import pytest


def require(name: str) -> ModuleType:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed", allow_module_level=True)
    return importlib.import_module(name)
