"""GPU diagnosis for batch invariance: run one sequence alone, packed with others, and as split
prefill + decode with carried state; report the first module whose output bits differ (the
parity doctor's capture/compare on the trainer model alone).

    python tests/gpu/diagnose_bi.py
"""

from __future__ import annotations

import torch

from titan_rl_ext.kernels.batch_invariant import batch_invariant
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.flavors import FLAVORS
from titan_rl_ext.tools import parity_doctor as pd


@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)
    import copy

    from titan_rl_ext.models.qwen3_5.model import hybrid_layer_types

    big = copy.deepcopy(FLAVORS["qwen3_5-9b"])
    big.n_layers, big.layer_types, big.vocab_size = 2, hybrid_layer_types(2, 2), 4096
    configs = {"qwen3-debug": copy.deepcopy(FLAVORS["qwen3-debug"]), "qwen3_5-debug": FLAVORS["qwen3_5-debug"],
               "qwen3_5-9b-shapes-2l": big}
    configs["qwen3-debug"].head_dim = 32
    for flavor, cfg in configs.items():
        model = cfg.build().cuda()
        model.init_weights(buffer_device=torch.device("cuda"))
        model = model.to(torch.bfloat16)
        a = torch.randint(0, cfg.vocab_size, (70,), device="cuda")
        b = torch.randint(0, cfg.vocab_size, (45,), device="cuda")
        with batch_invariant():
            alone = pd.Capture()
            with pd.capture(model, alone):
                model(a, SeqBatch.from_lengths([70], device="cuda"))
            packed = pd.Capture()
            with pd.capture(model, packed):
                model(torch.cat([a, b]), SeqBatch.from_lengths([70, 45], device="cuda"))
            d = pd.first_divergence(alone, packed, 70)
            print(f"{flavor} alone vs packed-first: {d}")
            packed2 = pd.Capture()
            with pd.capture(model, packed2):
                model(torch.cat([b, a]), SeqBatch.from_lengths([45, 70], device="cuda"))
            # a's rows sit at 45..114 in the second packing: compare by slicing
            rows = pd.Capture(order=packed2.order, chunks={k: [packed2.tensor(k)[45:]] for k in packed2.order
                                                           if packed2.tensor(k).shape[0] == 115})
            print(f"{flavor} alone vs packed-second: {pd.first_divergence(alone, rows, 70)}")
            states = model.init_states(1)
            split = pd.Capture()
            with pd.capture(model, split):
                _, states = model.step(a[:40], SeqBatch.from_lengths([40], device="cuda"), states)
                for t in range(40, 70):
                    _, states = model.step(a[t : t + 1], SeqBatch.from_lengths([1], [t], device="cuda"), states)
            print(f"{flavor} alone vs prefill+decode: {pd.first_divergence(alone, split, 70)}")


if __name__ == "__main__":
    main()
