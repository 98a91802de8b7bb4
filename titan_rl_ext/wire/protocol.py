"""Names of the swap endpoint's protocol, shared by the pusher, the rollout client and the server."""

from __future__ import annotations

TOKEN_ENV = "TITAN_SWAP_TOKEN"
"""The server enables its swap routes only with this set; clients send it as a bearer token."""
WEIGHTS_ROUTE = "/titan/v1/weights"
VERSION_ROUTE = f"{WEIGHTS_ROUTE}/version"
CHECKSUMS_ROUTE = f"{WEIGHTS_ROUTE}/checksums"
BI_ROUTE = "/titan/v1/batch_invariant"
TRANSPORTS = ("safetensors", "cuda_ipc")
"""``safetensors``: the bytes over HTTP (CPU, GPU, across hosts). ``cuda_ipc``: CUDA IPC handles in a JSON
manifest, for a generator on the same host that sees the trainer's GPU (``wire.cuda_ipc``)."""
MODES = ("keep", "recompute")
"""What a swap does to requests in flight: continue on their KV/GDN state, or recompute it with the new weights."""
VERSION_HEADER = "x-titan-weight-version"
VERSION_FIELD = "titan_weight_version"
"""Key the server puts into each streamed JSON chunk: the weight version that produced the chunk's last token."""
SPANS_FIELD = "titan_weight_spans"
"""Key of each finished choice: ``[[version, start, end], ...]`` over its output-token indexes, as the engine
core stamped its outputs. Authoritative where present; a chunk's ``VERSION_FIELD`` is the fallback."""
SWAP_PORT_ENV = "TITAN_SWAP_PORT"
"""The server's own weights listener: unset or ``off`` (the default) none -- pushes go to the OpenAI port;
``0`` any free port; ``N`` that port. Opened only when asked for (bound where the API server binds; loopback
when it serves a Unix socket only)."""
PUSH_PORT_FIELD = "push_port"
"""Field of the version route's answer: the port of the server's own weights listener (absent or null when
it runs none); pushers send there so a busy OpenAI event loop cannot delay a push."""
GDN_RECURRENT_FIELD = "gdn_recurrent"
"""Field of the version route's answer: the kernel of the server's recurrent GDN forwards (``TITAN_GDN_RECURRENT``).
It rounds differently from the other one, so a trainer checks it matches its own before BI steps (a mismatch
would show as a nonzero BI gap, with nothing to say why)."""
SALT_PREFIX = "titan-v"
"""Prefix-cache salt of a request is ``titan-v<version>``: no cache hits across weight versions."""
BOOT_HEADER = "x-titan-boot-id"
"""Response header (and field of the version and push answers): a random id drawn when the server started.
A generator that restarted has a new one, so a fleet can tell "the server I pushed v to" from "a fresh
process on the same address that never got v"."""
