"""Trained titan weights out as a stock HF checkpoint, shaped like the checkpoint the run started from.

    python -m titan_rl_ext.tools.export --source SRC_DIR --dcp RUN/checkpoint/step-N --out OUT_DIR
    python -m titan_rl_ext.tools.export --source SRC_DIR --safetensors titan_state.safetensors --out OUT_DIR

What is written and what is refused: ``titan_rl_ext.models.hf_export``.
"""

from __future__ import annotations

import argparse

from titan_rl_ext.models.hf_export import export_hf, load_dcp_titan_state

__all__ = ["export_hf", "load_dcp_titan_state", "main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", required=True, help="the HF checkpoint the run started from")
    ap.add_argument("--out", required=True)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--dcp", help="a torchtitan checkpoint step directory (e.g. RUN/checkpoint/step-40)")
    g.add_argument("--safetensors", help="a safetensors file of titan-named tensors")
    args = ap.parse_args(argv)
    if args.dcp:
        sd = load_dcp_titan_state(args.dcp, args.source)
    else:
        from safetensors.torch import load_file

        sd = load_file(args.safetensors)
    out = export_hf(sd, args.source, args.out)
    print(f"exported {len(sd)} titan tensors to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
