"""Every ``TITAN_*`` environment variable the project reads, declared once: its type, default, allowed values,
which side reads it and what it does. The rest of the code asks a ``Setting`` here (``GDN_RECURRENT.get()``)
instead of ``os.environ``, so a value is parsed and refused the same way everywhere, and ``docs/settings.md``
is this table (``markdown_table()``; a test keeps the two equal).

Values are read from the environment at each ``get()``, not cached at import: engine workers inherit the
server's environment, and tests and benchmarks switch settings within one process. An empty value counts as
unset. ``check(side)`` refuses bad values at start-up with every problem at once: the plugin's model build
(``vllm_titan_plugin.checks``) and the trainer's entry point (``titan_rl_ext.train``) run it.

Standard library only: the plugin imports this in a bare vLLM deployment, without the RL stack.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Literal, TypeVar

Side = Literal["plugin", "trainer", "both"]
T = TypeVar("T")


class SettingError(ValueError):
    """A setting's value is not one it accepts; the message names the variable, the value and what it takes."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    name: str
    default: str
    """As the environment would spell it: what an unset (or empty) variable means."""
    parse: Callable[[str], T]
    """Raw value -> typed value; raises ValueError on a value outside ``allowed``."""
    allowed: str
    """The accepted values in words, for the error and the docs."""
    side: Side
    """Which processes read it: the vLLM plugin (generators), the trainer, or both."""
    doc: str

    def raw(self) -> str:
        value = os.environ.get(self.name, "")
        return value if value != "" else self.default

    def is_set(self) -> bool:
        return os.environ.get(self.name, "") != ""

    def get(self) -> T:
        raw = self.raw()
        try:
            return self.parse(raw)
        except ValueError:
            raise SettingError(f"{self.name}={raw!r}: expected {self.allowed}") from None

    def problem(self) -> str | None:
        try:
            self.get()
        except SettingError as e:
            return str(e)
        return None


SETTINGS: dict[str, Setting] = {}


def _declare(name: str, default: str, parse: Callable[[str], T], allowed: str, side: Side, doc: str) -> Setting[T]:
    if name in SETTINGS:
        raise RuntimeError(f"{name} declared twice")
    setting = Setting(name, default, parse, allowed, side, doc)
    SETTINGS[name] = setting
    return setting


def _choice(*values: str) -> tuple[Callable[[str], str], str]:
    def parse(raw: str) -> str:
        if raw not in values:
            raise ValueError(raw)
        return raw

    return parse, f"one of {', '.join(values)}"


def _flag(on: tuple[str, ...] = ("1",), off: tuple[str, ...] = ("0",), fold_case: bool = False,
          ) -> tuple[Callable[[str], bool], str]:
    """A switch: exactly the spellings its readers always understood, so that no accepted value changes meaning."""
    def parse(raw: str) -> bool:
        key = raw.lower() if fold_case else raw
        if key in on:
            return True
        if key in off:
            return False
        raise ValueError(raw)

    return parse, f"one of {', '.join(on + off)}" + (" (any case)" if fold_case else "")


def _gib(raw: str) -> int:
    gib = float(raw)
    if not 0 <= gib < float("inf"):  # also refuses nan
        raise ValueError(raw)
    return int(gib * (1 << 30))


def _text(raw: str) -> str:
    return raw


# ---- both sides ---------------------------------------------------------------------------------------------

BATCH_INVARIANT = _declare(
    "TITAN_BATCH_INVARIANT", "0", *_flag(on=("1", "true", "yes"), off=("0", "false", "no"), fold_case=True), "both",
    "Batch-invariant kernels in this process (read once at import; `set_batch_invariant` also exports it so engine "
    "workers follow). Trainer and generators of a run must agree.")
FUSED_KERNELS = _declare(
    "TITAN_FUSED_KERNELS", "1", *_flag(), "both",
    "`0`: the layers' fused Triton kernels (norms, SwiGLU, gate, conv, head statistics) give way to their torch "
    "references.")
# titan by default: trainer and generator logprobs agree through vLLM with full decode graphs, and the kernel is
# faster than FLA's fused_recurrent at train, prefill and decode sizes (docs/benchmarks.md)
GDN_RECURRENT = _declare(
    "TITAN_GDN_RECURRENT", "titan", *_choice("fla", "titan"), "both",
    "Kernel of every recurrent GDN forward on CUDA (BI mode, decode-sized steps): the project's (`titan`) or FLA's "
    "`fused_recurrent` (`fla`). They round differently: trainer and generators must name the same one.")
GDN_BI_FORM = _declare(
    "TITAN_GDN_BI_FORM", "recurrent", *_choice("recurrent", "grid"), "both",
    "Definition of the GDN rule under batch invariance: `recurrent` (token by token, `kernels.gdn_triton`) or `grid` "
    "(opt-in: `kernels.gdn_chunk_grid`, 64-token chunks anchored at each sequence's first token, an open-chunk buffer "
    "as a third vLLM state tensor). They round differently: trainer and generators must name the same one; `grid` "
    "needs `TITAN_BATCH_INVARIANT=1`.")
SWAP_TOKEN = _declare(
    "TITAN_SWAP_TOKEN", "", _text, "any secret string (unset: weight pushes off)", "both",
    "Generators: turns on the weight-push routes, which accept this token. Trainer: the token it pushes with.")

# ---- plugin (vLLM generators) -------------------------------------------------------------------------------

GDN_MIXED_STEPS = _declare(
    "TITAN_GDN_MIXED_STEPS", "recurrent", *_choice("recurrent", "peel"), "plugin",
    "How a non-BI engine step mixing decodes and prefills runs GDN. `recurrent`: a step of two tokens a sequence or "
    "fewer runs whole on the recurrent kernel, a longer one peels its decodes off onto it and runs its prefills on "
    "FLA's chunk kernel; `peel`: every such step is peeled, as vLLM's own GDN layer does.")
PREFILL_ATTENTION = _declare(
    "TITAN_PREFILL_ATTENTION", "titan", *_choice("titan", "vllm"), "plugin",
    "Attention kernel of non-BI steps with a prefill: the project's (`titan`) or vLLM's backend (`vllm`).")
SWAP_PORT = _declare(
    "TITAN_SWAP_PORT", "off", _text, "off, or a TCP port 0-65535 (0: any free one; checked by the listener)", "plugin",
    "A separate listener for the weight-push routes; `off` keeps them on the OpenAI app's port.")
SWAP_SIGNED_ONLY = _declare(
    "TITAN_SWAP_SIGNED_ONLY", "0", *_flag(), "plugin",
    "`1`: weight pushes must carry a per-request signature; a bare `Bearer <token>` is refused.")

# ---- trainer ------------------------------------------------------------------------------------------------

RL_CACHE = _declare(
    "TITAN_RL_CACHE", "~/.cache/vllm-titan", lambda raw: Path(raw).expanduser(), "a directory", "trainer",
    "Where tiny checkpoints, tokenizers, warm-ups, run outputs and search indexes go.")
HEAD_SAVE_GB = _declare(
    "TITAN_HEAD_SAVE_GB", "8", _gib, "a number of GiB >= 0", "trainer",
    "fp32 logits the LM head's forward keeps per call for its backward (read once at import); `0`: always "
    "recompute them.")
FLA_CHUNK_BWD = _declare(
    "TITAN_FLA_CHUNK_BWD", "1", *_flag(), "trainer",
    "`0`: keep fla-core's guard that refuses its chunk backward on Hopper with Triton 3.4-3.7.0 (BI training then "
    "differentiates the torch chunked form; non-BI training raises).")
VERIFIERS_PYTHON = _declare(
    "TITAN_VERIFIERS_PYTHON", "", _text, "a Python interpreter path", "trainer",
    "The Python that runs `verifiers` environments (unset: the repo's `.venv-verifiers`, else this interpreter).")


def named(name: str) -> str:
    """The value of a variable the user named in a config (e.g. ``--rl.swap-token-env``: where the trainer finds
    the generators' swap token): the declared setting's parsing when the name is one of ours, else the raw value
    ("" when unset). Kept here so that this module stays the one reader of the environment."""
    if name in SETTINGS:
        return str(SETTINGS[name].get())
    return os.environ.get(name, "")


def problems(side: Side) -> list[str]:
    """Every declared setting read on ``side`` (those of both sides included) whose value it would refuse."""
    found = (s.problem() for s in SETTINGS.values() if s.side in (side, "both"))
    return [p for p in found if p is not None]


def check(side: Side) -> None:
    """Refuse bad values before the work starts, naming each variable and what it takes."""
    found = problems(side)
    if found:
        raise SettingError("; ".join(found))


def markdown_table() -> str:
    """The settings as ``docs/settings.md`` lists them."""
    rows = ["| Variable | Default | Allowed | Read by | What it does |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        default = f"`{s.default}`" if s.default else "(unset)"
        rows.append(f"| `{s.name}` | {default} | {s.allowed} | {s.side} | {s.doc} |")
    return "\n".join(rows) + "\n"
