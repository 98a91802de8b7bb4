"""Every named flavor of every family in ``models.architectures``, ``FLAVORS[name].build()`` -> model.
Imports torch only."""

from __future__ import annotations

from titan_rl_ext.models.architectures import FAMILIES
from titan_rl_ext.models.common.decoder import DecoderConfig

FLAVORS: dict[str, DecoderConfig] = {name: cfg for family in FAMILIES.values()
                                     for name, cfg in family.flavor_configs().items()}
