"""The serving plugin stands alone: ``vllm_titan_plugin`` never imports the RL stack (``titan_rl_ext.rl``),
so a serving deployment runs without it. The weight wire format lives in ``titan_rl_ext.wire``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "vllm_titan_plugin"


def _imported_modules(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
    return mods


def test_no_plugin_module_names_the_rl_stack() -> None:
    """Every import statement of the plugin, lazy ones inside functions included."""
    offenders = {str(p.relative_to(PLUGIN)): sorted(m for m in _imported_modules(p) if m == "titan_rl_ext.rl" or m.startswith("titan_rl_ext.rl."))
                 for p in sorted(PLUGIN.rglob("*.py"))}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"the plugin imports the RL stack: {offenders}"


def test_plugin_imports_with_the_rl_stack_unimportable() -> None:
    """Import every plugin module (and the wire protocol the swap endpoint uses) in a process where any
    import of ``titan_rl_ext.rl`` raises."""
    code = f"""
import importlib, importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "titan_rl_ext.rl" or name.startswith("titan_rl_ext.rl."):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
for m in {sorted(".".join(("vllm_titan_plugin",) + p.relative_to(PLUGIN).with_suffix("").parts) for p in PLUGIN.rglob("*.py") if p.stem != "__init__")!r}:
    importlib.import_module(m)
import titan_rl_ext.wire.cuda_ipc, titan_rl_ext.wire.weights, titan_rl_ext.wire.protocol, titan_rl_ext.wire.collective
assert not any(k == "titan_rl_ext.rl" or k.startswith("titan_rl_ext.rl.") for k in sys.modules)
print("OK")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
