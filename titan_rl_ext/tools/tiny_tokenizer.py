"""A small byte-level BPE tokenizer built offline (no hub), with Qwen's chat special tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Training text: arithmetic and plain English, enough to give the BPE merges for the demo tasks.
_CORPUS = [
    "What is {a} plus {b}? The answer is {c}.",
    "Compute {a} + {b} = {c}. Then {c} - {b} = {a}.",
    "The quick brown fox jumps over the lazy dog while the model learns to add numbers.",
    "Question: how many apples are left if you have {a} and eat {b}? Answer: {d}.",
    "user assistant system reasoning think step by step final answer",
]


def _corpus() -> list[str]:
    lines = []
    for a in range(0, 100, 3):
        for b in range(0, 100, 7):
            for t in _CORPUS:
                lines.append(t.format(a=a, b=b, c=a + b, d=a - b))
    return lines


def build_tokenizer(vocab_size: int = 512, extra_special: Sequence[str] = ()):
    """Returns a ``transformers.PreTrainedTokenizerFast``; len(tokenizer) <= vocab_size. ``extra_special``:
    more special tokens, ids right after the chat ones (the merges shrink to make room)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(extra_special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", *extra_special],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(out_dir: str | Path, vocab_size: int = 512, extra_special: Sequence[str] = ()) -> int:
    """Writes tokenizer files into ``out_dir``; returns the number of tokens."""
    tok = build_tokenizer(vocab_size, extra_special)
    tok.save_pretrained(str(out_dir))
    return len(tok)


QWEN3_TOOL_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def add_qwen3_tool_tokens(model_dir: str | Path) -> list[int]:
    """Rebuild a tiny checkpoint's tokenizer with Qwen3's think/tool special tokens too (within the model's
    embedding rows; the weights do not depend on the tokenizer), for chat renderers that look them up
    (verifiers' Qwen3 renderer). Returns their ids."""
    import json

    from transformers import AutoTokenizer

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    save_tokenizer(model_dir, cfg.get("text_config", cfg)["vocab_size"], QWEN3_TOOL_TOKENS)
    return AutoTokenizer.from_pretrained(str(model_dir)).convert_tokens_to_ids(QWEN3_TOOL_TOKENS)
