"""How a flat token stream splits into sequences: the one metadata object every layer sees."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqBatch:
    """T tokens packed back to back, N sequences.

    ``cu_seqlens`` [N+1] (int32) bounds the *new* tokens of each sequence; ``positions`` [T] (int64)
    is each token's absolute position in its sequence, so a sequence that continues from a cached
    prefix of P tokens has positions P, P+1, ...
    """

    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    max_seqlen: int

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.positions.numel()

    def rows_to_next_tokens(self, rows_T: torch.Tensor) -> torch.Tensor:
        """``out[t] = rows[t - 1]`` within each sequence, NaN at each sequence's first token: from what row t scores
        (the token after it) to the token each position holds. By ``roll``/``where``, not boolean indexing:
        nothing sized by the data, so no host sync."""
        T = rows_T.shape[0]
        nan_T = torch.full((T,), float("nan"), dtype=rows_T.dtype, device=rows_T.device)
        if T == 0:
            return nan_T
        is_first = torch.zeros(T, dtype=torch.bool, device=rows_T.device)
        is_first[self.cu_seqlens[:-1].long().clamp(max=T - 1)] = True
        return torch.where(is_first, nan_T, rows_T.roll(1))

    def lengths(self) -> list[int]:
        b = self.cu_seqlens.tolist()
        return [e - s for s, e in zip(b[:-1], b[1:])]

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[int],
        start_positions: Sequence[int] | None = None,
        device: torch.device | str | None = None,
    ) -> SeqBatch:
        if any(n < 0 for n in lengths):
            raise ValueError(f"sequence lengths must be >= 0, got {list(lengths)}")
        starts = list(start_positions) if start_positions is not None else [0] * len(lengths)
        if len(starts) != len(lengths):
            raise ValueError(f"{len(lengths)} lengths but {len(starts)} start positions")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        if lengths:
            cu[1:] = torch.tensor(list(lengths), dtype=torch.int32).cumsum(0)
        pos = [torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, lengths)]
        positions = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64)
        return cls(cu.to(device), positions.to(device), max(lengths, default=0))

    @classmethod
    def uniform(cls, batch_size: int, seq_len: int, device: torch.device | str | None = None) -> SeqBatch:
        return cls.from_lengths([seq_len] * batch_size, device=device)
