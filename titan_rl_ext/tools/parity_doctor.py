"""``tools.parity --doctor``: find the first op where generator and trainer stop being bit-identical.

Both sides run the titan modules, so every module has the same name on both sides: names are taken
relative to the titan ``Decoder`` wherever an engine nests it, and the GDN wrapper's ``.layer``
segment is stripped. Forward hooks
record each module's output for one sequence; the outputs are compared in the trainer's execution
order and the first module whose bits differ is reported -- its inputs were identical (the previous
module matched), so that op is where the divergence starts.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn

_WRAPPER_SEGMENTS = re.compile(r"(?<=linear_attn)\.layer(?=\.|$)")


def canonical_name(name: str) -> str:
    return _WRAPPER_SEGMENTS.sub("", name)


def _first_tensor(out: object) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


@dataclass
class Capture:
    """Outputs per module (in first-call order), concatenated over calls along the token dim."""

    order: list[str] = field(default_factory=list)
    chunks: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, name: str, t: torch.Tensor) -> None:
        if name not in self.chunks:
            self.order.append(name)
            self.chunks[name] = []
        self.chunks[name].append(t.detach().to("cpu", copy=True))

    def tensor(self, name: str) -> torch.Tensor:
        return torch.cat(self.chunks[name], dim=0)


def titan_decoder(root: nn.Module) -> nn.Module:
    """The titan ``Decoder`` inside whatever an engine wraps it in (names are taken relative to it)."""
    from titan_rl_ext.models.common.decoder import Decoder

    for mod in root.modules():
        if isinstance(mod, Decoder):
            return mod
    raise TypeError(f"no titan Decoder inside {type(root).__name__}")


@contextlib.contextmanager
def capture(root: nn.Module, into: Capture) -> Iterator[Capture]:
    """Record the output of every submodule of the titan decoder in ``root`` whose output is a
    token-major tensor."""
    handles = []
    # an engine wrapper and the titan module it holds share a canonical name: keep the inner one
    by_key: dict[str, nn.Module] = {}
    for name, mod in titan_decoder(root).named_modules():
        if name:
            by_key[canonical_name(name)] = mod
    for key, mod in by_key.items():

        def hook(_m: nn.Module, _inp: object, out: object, key: str = key) -> None:
            t = _first_tensor(out)
            if t is not None and t.dim() >= 1:
                into.add(key, t)

        handles.append(mod.register_forward_hook(hook))
    try:
        yield into
    finally:
        for h in handles:
            h.remove()


@dataclass
class Divergence:
    module: str
    rows_differing: int
    rows: int
    max_abs: float


def unmatched_modules(trainer: Capture, generator: Capture) -> list[str]:
    """Trainer modules the generator side never reported (naming mismatch or bypassed modules)."""
    return [n for n in trainer.order if n not in generator.chunks]


def first_divergence(trainer: Capture, generator: Capture, n_tokens: int) -> Divergence | None:
    """Compare the first ``n_tokens`` rows of every module both sides captured, in trainer order."""
    for name in trainer.order:
        if name not in generator.chunks:
            continue
        a = trainer.tensor(name)[:n_tokens]
        b = generator.tensor(name)[:n_tokens]
        if a.shape != b.shape:
            return Divergence(name + f" (shapes {tuple(a.shape)} vs {tuple(b.shape)})", -1, n_tokens, float("nan"))
        same_rows = (a == b).reshape(a.shape[0], -1).all(dim=1) if a.numel() else torch.ones(0, dtype=torch.bool)
        if not bool(same_rows.all()):
            diff = (a.double() - b.double()).abs().max().item()
            return Divergence(name, int((~same_rows).sum()), a.shape[0], diff)
    return None


def perturb_output_hook(root: nn.Module, module_name: str) -> torch.utils.hooks.RemovableHandle:
    """Debug aid: nudge one module's output by one ulp on one side, to show the doctor finds it."""
    mods = {canonical_name(n): m for n, m in titan_decoder(root).named_modules()}
    if module_name not in mods:
        raise KeyError(f"no module {module_name!r}; e.g. {sorted(mods)[:8]}")

    def hook(_m: nn.Module, _inp: object, out: object) -> object:
        t = _first_tensor(out)
        if t is None:
            return out
        bumped = torch.nextafter(t, torch.full_like(t, float("inf")))
        return bumped if isinstance(out, torch.Tensor) else (bumped, *out[1:])  # type: ignore[index]

    return mods[module_name].register_forward_hook(hook)
