"""The tiny tokenizer and in-memory text dataset every recipe hands torchtitan (offline, built once into
``cache_dir()``): the debug recipes train on the dataset; the RL recipes never read it, but torchtitan's trainer
builds a text dataloader all the same. Its own module so that ``configs/__init__.py`` and ``rl_common`` both import
it without importing each other.
"""

from __future__ import annotations

from titan_rl_ext.paths import cache_dir

TINY_DATASET = "titan_tiny_corpus"


def tiny_tokenizer_dir() -> str:
    """The offline tiny tokenizer (built once, cached): torchtitan always loads a tokenizer directory."""
    from titan_rl_ext.tools.tiny_tokenizer import save_tokenizer

    d = cache_dir() / "tiny_tokenizer"
    if not (d / "tokenizer.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        save_tokenizer(d)
    return str(d)


def register_tiny_dataset() -> None:
    """An in-memory text dataset (no files, no network) in torchtitan's dataset registry."""
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from titan_rl_ext.tools.tiny_tokenizer import _corpus

    def load(_path: str) -> Dataset:
        lines = _corpus()
        docs = [" ".join(lines[i : i + 4]) for i in range(0, len(lines), 4)]
        return Dataset.from_dict({"text": docs})

    DATASETS[TINY_DATASET] = DatasetConfig(path="<in-memory>", loader=load, sample_processor=lambda s: s["text"])
