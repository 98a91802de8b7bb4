"""Entry point for ``torchtitan.train --module titan_rl_ext --config <recipe>`` (see ``configs``)."""

from titan_rl_ext.compat import patch_torchtitan

# torchtitan imports this inside argument parsing: after its own modules copied the device type,
# before the Trainer is built -- the moment the CPU/torch-2.13 shims must be in place.
patch_torchtitan()

from titan_rl_ext.configs import qwen3_5_debug, qwen3_5_moe_debug, qwen3_debug  # noqa: E402

__all__ = ["qwen3_5_debug", "qwen3_5_moe_debug", "qwen3_debug"]
from titan_rl_ext.configs import qwen3_5_9b_dapo_math, rl_tiny_cpu  # noqa: E402,F401
