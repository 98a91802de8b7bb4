"""What differs between vLLM 0.26 (the lent GPU) and 0.32 (CPU) on the swap path, each side exercised."""

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


# -- the engine core's wait for idle workers -------------------------------------------------------------
class _Worker026:
    """A worker as vLLM 0.26 has it: no ``synchronize_device`` (0.32's ``WorkerBase`` has one)."""


class _Worker032:
    def __init__(self) -> None:
        self.waited = 0

    def synchronize_device(self) -> None:
        self.waited += 1


def test_workers_synchronize_with_or_without_vllms_method() -> None:
    from vllm_titan_plugin.swap.worker import METHODS

    sync = METHODS["titan_synchronize_device"]
    sync(_Worker026())  # vLLM 0.26: torch.accelerator's wait, no AttributeError
    w = _Worker032()
    sync(w)
    assert w.waited == 1  # vLLM's own wait where the worker has one
