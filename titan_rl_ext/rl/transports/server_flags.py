"""What a vLLM server must be started with to take pushes through vLLM's weight-transfer calls (issue 43).

A transport that pushes into one of the plugin's transfer engines (``titan_gloo``, ``titan_nccl``, ``titan_ipc``)
says which (``server_engine(options)`` on its class); a server the run spawns then gets what that engine needs
(``transports.spawned_server``): the commit's worker extension, the engine in ``--weight-transfer-config``, and
vLLM's dev mode, which serves the weight-transfer routes (the plugin puts them behind the push token). A flag the
user already gave is kept, not doubled; an engine the user named that is not the transport's is refused before
anything starts, as that server could only refuse every push.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

WORKER_EXTENSION = "vllm_titan_plugin.swap.transfer_engine.TitanTransferExtension"
EXTENSION_FLAG = "--worker-extension-cls"
CONFIG_FLAG = "--weight-transfer-config"
VLLM_DEFAULT_BACKEND = "nccl"
"""``WeightTransferConfig.backend`` when a config names none (vLLM 0.26 and 0.32): never one of ours."""
ENGINE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def _flag_name(arg: str) -> str:
    """``--weight_transfer_config=X`` -> ``--weight-transfer-config``: vLLM's parser takes either spelling."""
    name = arg.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _occurrences(args: Sequence[str], flag: str) -> list[tuple[str, str | None]]:
    """Every ``flag`` in ``args`` (also ``flag.key``, vLLM's dotted form for one field of a JSON config): its
    field (``""`` for the whole value) and its value (``--f V`` or ``--f=V``; None when nothing follows)."""
    found = []
    for i, arg in enumerate(args):
        name = _flag_name(arg)
        if name != flag and not name.startswith(flag + "."):
            continue
        if "=" in arg:
            value: str | None = arg.split("=", 1)[1]
        else:
            value = args[i + 1] if i + 1 < len(args) else None
        found.append((name[len(flag) + 1:], value))
    return found


def given_backend(args: Sequence[str]) -> str | None:
    """The ``--weight-transfer-config`` backend ``args`` name (vLLM's default when a config names none), or None
    when they give no such config. ``ValueError`` for a value vLLM could not read either."""
    backend = None
    for field, value in _occurrences(args, CONFIG_FLAG):
        if value is None:
            raise ValueError(f"rl.server_args: {CONFIG_FLAG} is the last argument, with no value")
        if field == "backend":
            backend = value
        elif field == "":
            try:
                config = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"rl.server_args: {CONFIG_FLAG} {value!r} is not JSON ({e})") from None
            if not isinstance(config, dict):
                raise ValueError(f"rl.server_args: {CONFIG_FLAG} must be a JSON object, got {value!r}")
            backend = str(config.get("backend", backend or VLLM_DEFAULT_BACKEND))
        elif backend is None:
            backend = VLLM_DEFAULT_BACKEND  # another field alone: vLLM builds the config with its default backend
    return backend


def with_engine(args: Sequence[str], engine: str, transport: str) -> list[str]:
    """``args`` with what a server needs to take ``transport``'s pushes into the ``engine`` transfer engine: the
    worker extension and ``--weight-transfer-config`` appended unless given. ``ValueError`` naming both when
    ``args`` configure another engine."""
    out = list(args)
    backend = given_backend(args)
    if backend is None:
        out += [CONFIG_FLAG, json.dumps({"backend": engine})]
    elif backend != engine:
        raise ValueError(f"rl.server_args: {CONFIG_FLAG} names backend {backend!r}, but --rl.weight_transport "
                         f"{transport} pushes into the {engine!r} engine; give {CONFIG_FLAG} "
                         f"'{json.dumps({'backend': engine})}' or leave it out (the spawned server then gets it)")
    # a user's own extension is kept: it may subclass ours (one without ``titan_commit_transfer`` fails the first
    # push's commit, which commits nothing)
    if not _occurrences(args, EXTENSION_FLAG):
        out += [EXTENSION_FLAG, WORKER_EXTENSION]
    return out
