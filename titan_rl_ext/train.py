"""RL training entry point:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=N -m titan_rl_ext.train \
        --module titan_rl_ext.configs --config rl_tiny_cpu [--training.steps 3 ...]

Applies the torchtitan compatibility shims, then runs torchtitan's own ``main`` (its config manager
imports ``titan_rl_ext.configs.config_registry`` if present, else ``titan_rl_ext.configs``, and calls
the recipe; ``config.build()`` constructs the ``RLTrainer`` the recipe's config belongs to).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from titan_rl_ext import settings
    from titan_rl_ext.compat import patch_torchtitan

    settings.check("trainer")  # a bad TITAN_* value stops the run here, not steps into it
    patch_torchtitan()
    import torchtitan.train

    patch_torchtitan()  # again: modules torchtitan.train imported copied the device type
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    torchtitan.train.main()


if __name__ == "__main__":
    main()
