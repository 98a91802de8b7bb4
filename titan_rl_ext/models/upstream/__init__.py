"""torchtitan's own model definitions (``torchtitan.models.qwen3``, ``torchtitan.models.llama3``), unmodified.

The project's models live in ``titan_rl_ext.models.qwen3`` / ``qwen3_5``; this package lets a torchtitan user
serve and train torchtitan's instead:

- ``build``: a torchtitan model config from a checkpoint's HF ``config.json`` (the spec is named, e.g.
  ``torchtitan.models.qwen3``), the spec's own state-dict adapter, and the refusal for specs whose modules
  cannot be served (naming the module and why);
- ``bi_ops``: batch invariance for code the project does not own: a ``TorchFunctionMode`` that routes the
  few batch-variant torch functions torchtitan's modules call (``linear``, ``rms_norm``, ``silu``) to the
  project's batch-invariant kernels;
- ``packed``: the trainer side: a packed-sequence ``inner_attention`` and the per-token logprobs.

torchtitan is imported here, so nothing outside this package imports it eagerly.
"""
