"""``math``: competition problems with a boxed answer (e.g. DAPO-Math-17k), from a local file or the hub,
scored by ``rewards.MathReward``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_rl_ext.rl.envs import Scorer
from titan_rl_ext.rl.tasks import register_task
from titan_rl_ext.rl.tasks.base import RolloutSource, Task, epochs

if TYPE_CHECKING:
    from titan_rl_ext.rl.config import RLConfig


@dataclass(frozen=True)
class MathItem:
    prompt: str
    answer: str


def _rows(path: str, hub_id: str) -> list[dict[str, Any]]:
    path = path or os.environ.get("DAPO_MATH_PATH", "")
    if path:
        p = Path(path)
        if p.suffix in (".jsonl", ".json"):
            return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        import pandas as pd

        files = sorted(p.glob("**/*.parquet")) if p.is_dir() else [p]
        return [r for f in files for r in pd.read_parquet(f).to_dict("records")]
    from datasets import load_dataset  # the hub, when reachable

    return list(load_dataset(hub_id, split="train"))


def _item(row: dict[str, Any], tokenizer: Any) -> MathItem:
    """DAPO-Math-17k rows: ``prompt`` = chat messages, ``reward_model.ground_truth`` = answer;
    plain ``{"prompt"|"problem": str, "answer"|"solution": str}`` rows work too."""
    prompt = row.get("prompt", row.get("problem"))
    rm = row.get("reward_model") or {}
    answer = rm.get("ground_truth") if isinstance(rm, dict) and rm.get("ground_truth") is not None else row.get("answer", row.get("solution"))
    if not isinstance(prompt, str):
        msgs = [dict(m) for m in list(prompt)]
        prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return MathItem(str(prompt), str(answer))


class MathTask(Task):
    def prompts(self, rl: RLConfig, tokenizer: Any, start: int, source: RolloutSource | None) -> Iterator[Any]:
        rows = _rows(rl.dataset_path, rl.dataset_hub_id)
        if not rows:
            raise ValueError("task='math': the dataset has no rows")
        return (_item(r, tokenizer) for r in epochs(rows, rl.seed, start))

    def eval_items(self, rl: RLConfig, tokenizer: Any) -> list[Any]:
        if not rl.eval_path:
            raise ValueError("task='math' with eval_every > 0 needs rl.eval_path (a held-out jsonl/parquet set)")
        return [_item(r, tokenizer) for r in _rows(rl.eval_path, "")[: rl.eval_items]]

    def scorer(self) -> Scorer:
        from titan_rl_ext.rl.rewards import MathReward

        return MathReward()


register_task("math", MathTask())
