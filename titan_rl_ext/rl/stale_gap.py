"""``bit_wise_stale/*``: the exact logprob gap of samples generated with an older weight version.

Async RL trains on samples a few versions old. Their generator logprobs can only be checked bit for bit
against the weights that produced them, so the trainer keeps the last ``keep`` versions' weights (on the
CPU) and recomputes, with a second model, every turn whose generated tokens all carry one such version.
Turns a swap split are skipped (their context mixes versions) and counted.
"""

from __future__ import annotations

from typing import Any

import torch


class StaleGap:
    def __init__(self, keep: int, model_dir: str) -> None:
        self.keep, self.model_dir = keep, model_dir
        self.history: dict[int, dict[str, torch.Tensor]] = {}  # version -> weights
        self._scratch: Any = None  # the second model, built on first use

    def remember(self, version: int, sd: dict[str, torch.Tensor]) -> None:
        if self.keep <= 0:
            return
        self.history[version] = {n: t.detach().to("cpu", copy=True) for n, t in sd.items()}
        for old in sorted(self.history)[:-self.keep]:
            del self.history[old]

    def metrics(self, samples: list[Any], current: int, dtype: torch.dtype, device: torch.device) -> dict[str, float]:
        """Over the tokens of ``samples`` exact at a remembered version other than ``current``
        (``Sample.exact_versions``: a multi-turn sample whose turns a swap separates is compared turn by
        turn, each at its own version). Call with the step's batch-invariance setting."""
        from titan_rl_ext.models.common.batch import SeqBatch
        from titan_rl_ext.models.hf import load_hf_model
        from titan_rl_ext.rl.logprobs import token_logprobs
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
        if by_version:
            if self._scratch is None:
                self._scratch, _ = load_hf_model(self.model_dir, dtype=dtype, device=device)
                self._scratch.eval()
            for v, group in sorted(by_version.items()):
                self._scratch.load_state_dict(self.history[v], strict=True)
                packed = pack_samples(group, device=device)
                with torch.no_grad():
                    lp_T = token_logprobs(self._scratch, packed.tokens_T, SeqBatch.from_lengths(packed.lengths, device=device))
                at_v_T = exact_at_mask(group, v, device=device)
                gen.append(packed.gen_logprobs_T[at_v_T])
                ours.append(lp_T[at_v_T])
        out = gap_metrics(torch.cat(gen) if gen else torch.zeros(0), torch.cat(ours) if ours else torch.zeros(0),
                          "bit_wise_stale")
        out["bit_wise_stale/skipped_samples"] = skipped
        out["bit_wise_stale/samples_across_swaps"] = across
        return out
