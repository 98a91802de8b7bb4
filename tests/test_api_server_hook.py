"""The swap routes reach the API server's app whichever way vLLM's server was launched."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import pytest

from vllm_titan_plugin import compat

NAME = "vllm.entrypoints.openai.api_server"


def _server_module(run_as_main: bool) -> types.ModuleType:
    mod = types.ModuleType("__main__" if run_as_main else NAME)
    mod.__spec__ = importlib.machinery.ModuleSpec(NAME, None)
    mod.build_app = lambda args: {"app_for": args}
    return mod


@pytest.mark.parametrize("run_as_main", [False, True], ids=["imported", "python -m (vLLM 0.26)"])
def test_build_app_passes_through_the_hook(monkeypatch: pytest.MonkeyPatch, run_as_main: bool) -> None:
    mod = _server_module(run_as_main)
    for name in compat.API_SERVER_ENTRY_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "__main__" if run_as_main else NAME, mod)
    seen: list[Any] = []

    def hook(app: Any, args: Any) -> Any:
        seen.append(args)
        return {**app, "hooked": True}

    assert compat.wrap_api_server_build_app(hook, "__test_mark__")
    assert compat.wrap_api_server_build_app(hook, "__test_mark__")  # a second call: same wrapper, not two
    assert mod.build_app("ns") == {"app_for": "ns", "hooked": True}
    assert seen == ["ns"]


def test_no_server_module_patches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in compat.API_SERVER_ENTRY_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert not compat.wrap_api_server_build_app(lambda app, args: app, "__test_mark__")
