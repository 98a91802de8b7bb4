"""``bit_wise_stale/*``: the exact logprob gap of samples generated with an older weight version.

Async RL trains on samples a few versions old. Their generator logprobs can only be checked bit for bit
against the weights that produced them, so the trainer keeps the last ``keep`` versions' weights and
recomputes, with a second model, every turn whose generated tokens all carry one such version. Turns a swap
split are skipped (their context mixes versions) and counted.

Where the weights are kept decides what the metric costs each step (with the versions on the CPU, a push's
trainer side cost many times the server's swap: docs/gpu_runs.md §9, "The RL loop on the GPU"). On the CPU
every push copies the model device to host and every recompute copies it back. So with ``device="auto"`` the
versions stay on the compute device when ``keep`` of them take at most a quarter of its free memory (a
device-to-device clone per push, no copy per recompute: the second model's parameters are pointed at the kept
tensors), and on the CPU otherwise (a 9B model next to its generator).

The recompute runs in the trainer's loss chunks (``chunk_tokens``, ``rl.loss_chunk_tokens``: whole samples, a
longer one alone): one version's stale samples of a long-answer step are hundreds of thousands of tokens, whose
single forward would take tens of GB beside a trainer and generator budgeted to fill the GPU. Under batch invariance the chunks'
logprobs are the one pass's bit for bit (a row's bits do not depend on the rows packed with it).

LoRA runs (``lora``): the base weights never move, so they are kept once and each version keeps only its adapters
(a push then copies the adapters, not the model, and the second model's base is pointed at or converted once).
"""

from __future__ import annotations

from typing import Any

import torch

DEVICES = ("auto", "cpu")
_AUTO_FREE_FRACTION = 0.25


class StaleGap:
    def __init__(self, keep: int, model_dir: str, device: str = "auto", chunk_tokens: int = 0,
                 lora: Any = None) -> None:
        """``lora``: the trainer's ``LoRAConfig`` (None: none), so the second model has its adapters."""
        if device not in DEVICES:
            raise ValueError(f"stale gap device must be one of {DEVICES}, got {device!r}")
        self.keep, self.model_dir, self.device, self.lora = keep, model_dir, device, lora
        self.chunk_tokens = chunk_tokens  # tokens a recompute pass takes at most (0: one pass)
        self.history: dict[int, dict[str, torch.Tensor]] = {}  # version -> weights
        self._scratch: Any = None  # the second model, built on first use
        self._store: torch.device | None = None  # where the versions live, chosen at the first remember
        # LoRA: the base never moves, so it is kept once and each version keeps its adapters alone
        self._base: dict[str, torch.Tensor] | None = None
        self._base_set = False  # the second model's parameters already point at the (converted) base

    def _where(self, sd: dict[str, torch.Tensor]) -> torch.device:
        dev = next(iter(sd.values())).device
        if self.device == "cpu" or dev.type != "cuda":
            return torch.device("cpu")
        from titan_rl_ext.models.common.lora import is_lora_param

        per_version = sum(t.numel() * t.element_size() for n, t in sd.items() if self.lora is None or is_lora_param(n))
        base = sum(t.numel() * t.element_size() for n, t in sd.items() if self.lora is not None and not is_lora_param(n))
        need = base + self.keep * per_version
        free, _ = torch.cuda.mem_get_info(dev)
        return dev if need <= _AUTO_FREE_FRACTION * free else torch.device("cpu")

    def remember(self, version: int, sd: dict[str, torch.Tensor]) -> None:
        """Keep a copy of ``sd`` (the trainer updates its weights in place) as ``version``'s weights."""
        if self.keep <= 0:
            return
        if self._store is None:
            self._store = self._where(sd)
        if self.lora is not None:
            from titan_rl_ext.models.common.lora import is_lora_param

            if self._base is None:
                self._base = {n: t.detach().to(self._store, copy=True) for n, t in sd.items() if not is_lora_param(n)}
                if not self._base:
                    raise ValueError("StaleGap.remember with LoRA: the first weights kept must include the frozen base")
            sd = {n: t for n, t in sd.items() if is_lora_param(n)}
        self.history[version] = {n: t.detach().to(self._store, copy=True) for n, t in sd.items()}
        for old in sorted(self.history)[:-self.keep]:
            del self.history[old]

    def _use(self, version: int) -> None:
        """Point the second model's parameters at ``version``'s weights: the kept tensors themselves where they
        already have the parameter's device and dtype (no copy), a converted copy otherwise; buffers are copied.
        Strict, as ``load_state_dict``."""
        weights = self.history[version] if self._base is None else {**self._base, **self.history[version]}
        own = dict(self._scratch.state_dict(keep_vars=True))
        if own.keys() != weights.keys():
            missing, extra = sorted(own.keys() - weights.keys()), sorted(weights.keys() - own.keys())
            raise KeyError(f"version {version}'s weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
        with torch.no_grad():
            for name, mine in own.items():
                if self._base_set and name in self._base:  # type: ignore[operator]
                    continue  # the base, pointed at (or converted) by an earlier call: the same for every version
                w = weights[name]
                if w.shape != mine.shape:
                    raise ValueError(f"version {version}: {name} has shape {tuple(w.shape)}, the model {tuple(mine.shape)}")
                if not isinstance(mine, torch.nn.Parameter):
                    mine.copy_(w)  # a buffer the forward may update in place must not alias the kept copy
                elif (w.device, w.dtype) == (mine.device, mine.dtype):
                    mine.data = w
                else:  # the conversion load_state_dict's copy_ would make
                    mine.data = w.to(mine.device, mine.dtype)
        self._base_set = self._base is not None

    def recompute(self, packed: Any, version: int, dtype: torch.dtype) -> torch.Tensor:
        """The logprobs ``[T]`` of ``packed``'s samples (``pack_samples``, on the device to compute on) under
        ``version``'s weights, one loss chunk of samples at a time. Call with the step's batch-invariance setting."""
        from titan_rl_ext.models.hf import load_hf_model
        from titan_rl_ext.rl.logprobs import token_logprobs
        from titan_rl_ext.rl.loss_chunks import packed_chunks

        device = packed.tokens_T.device
        if self._scratch is None:
            self._scratch, _ = load_hf_model(self.model_dir, dtype=dtype, device=device,
                                             **({"lora": self.lora} if self.lora is not None else {}))
            self._scratch.eval()
        self._use(version)
        with torch.no_grad():
            return torch.cat([token_logprobs(self._scratch, packed.tokens_T[t], seqs)
                              for _, _, t, seqs in packed_chunks(packed, self.chunk_tokens)])

    def metrics(self, samples: list[Any], current: int, dtype: torch.dtype, device: torch.device) -> dict[str, float]:
        """Over the tokens of ``samples`` exact at a remembered version other than ``current``
        (``Sample.exact_versions``: a multi-turn sample whose turns a swap separates is compared turn by
        turn, each at its own version). Call with the step's batch-invariance setting."""
        from titan_rl_ext.rl.metrics import gap_metrics
        from titan_rl_ext.rl.samples import exact_at_mask, pack_samples

        by_version: dict[int, list[Any]] = {}
        skipped = across = 0
        for smp in samples:
            exact = smp.exact_versions
            if any(v is None and m for v, m in zip(exact, smp.loss_mask)):
                skipped += 1  # a turn a swap split: its context mixes versions
            versions = {v for v in exact if v is not None}
            across += len(versions) > 1  # turns on both sides of a swap, each compared at its own version
            for v in versions - {current}:
                if v in self.history:
                    by_version.setdefault(v, []).append(smp)
                else:
                    skipped += 1
        gen, ours = [], []
        for v, group in sorted(by_version.items()):
            packed = pack_samples(group, device=device)
            lp_T = self.recompute(packed, v, dtype)
            at_v_T = exact_at_mask(group, v, device=device)
            gen.append(packed.gen_logprobs_T[at_v_T])
            ours.append(lp_T[at_v_T])
        out = gap_metrics(torch.cat(gen) if gen else torch.zeros(0), torch.cat(ours) if ours else torch.zeros(0),
                          "bit_wise_stale")
        out["bit_wise_stale/skipped_samples"] = skipped
        out["bit_wise_stale/samples_across_swaps"] = across
        return out
