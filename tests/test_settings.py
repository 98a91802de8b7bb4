"""The settings module (``titan_rl_ext.settings``): the one reader of ``TITAN_*`` variables, its start-up errors,
and ``docs/settings.md`` as its table. Seconds, no engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from titan_rl_ext import settings

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("titan_rl_ext", "vllm_titan_plugin")
SETTINGS_MODULE = "titan_rl_ext/settings.py"



def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (isinstance(node, ast.Name)
                                                                            and node.id == "environ")


def _read_keys(tree: ast.AST) -> list[tuple[int, ast.expr]]:
    """(line, key) of every keyed read of the environment: ``environ.get(k)``, ``environ[k]``, ``getenv(k)``,
    ``k in environ``. Writes (``environ[k] = v``, ``setdefault``, ``pop``) and whole copies are not reads of a key."""
    found: list[tuple[int, ast.expr]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if ((isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value))
                    or (isinstance(f, ast.Attribute) and f.attr == "getenv")
                    or (isinstance(f, ast.Name) and f.id == "getenv")):
                found.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            found.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            found.append((node.lineno, node.left))
    return found


def stray_reads(source: str, rel: str) -> list[str]:
    """Reads of ``TITAN_*`` variables in ``source`` (the file ``rel``): a key spelled ``TITAN_...``, or any key that
    is not a plain string (a constant or an f-string may spell one)."""
    out = []
    for line, key in _read_keys(ast.parse(source)):
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and not key.value.startswith("TITAN_"):
            continue
        out.append(f"{rel}:{line}: reads {ast.unparse(key)} (ask titan_rl_ext.settings)")
    return out


def test_no_titan_variable_is_read_outside_the_settings_module() -> None:
    found: list[str] = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel != SETTINGS_MODULE:
                found += stray_reads(path.read_text(), rel)
    assert not found, "\n".join(found)


def test_the_scan_catches_planted_reads() -> None:
    planted = {
        'os.environ.get("TITAN_X", "1")': 1, 'os.environ["TITAN_X"]': 1, 'os.getenv("TITAN_X")': 1,
        '"TITAN_X" in os.environ': 1, "os.environ.get(SOME_ENV)": 1, 'os.environ.get(f"TITAN_{n}")': 1,
        'os.environ.get("HOME")': 0, 'os.environ["TITAN_X"] = "1"': 0, 'os.environ.setdefault("TITAN_X", "1")': 0,
        "dict(os.environ)": 0,
    }
    for line, n in planted.items():
        assert len(stray_reads(f"import os\n{line}\n", "titan_rl_ext/x.py")) == n, line
    # the swap routes and the trainer's link read their settings through the module too
    assert stray_reads("import os\nos.environ.get(TOKEN_ENV)\n", "vllm_titan_plugin/swap/x.py") != []


def test_bad_values_are_refused_naming_the_variable_and_the_allowed_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for s in settings.SETTINGS.values():
        monkeypatch.delenv(s.name, raising=False)
    assert settings.problems("plugin") == [] and settings.problems("trainer") == []
    settings.check("plugin")
    cases = {"TITAN_GDN_RECURRENT": ("triton", "one of fla, titan"),
             "TITAN_FUSED_KERNELS": ("false", "one of 1, 0"),
             "TITAN_BATCH_INVARIANT": ("on", "one of 1, true, yes, 0, false, no (any case)"),
             "TITAN_HEAD_SAVE_GB": ("-1", "a number of GiB >= 0"),
             "TITAN_PREFILL_ATTENTION": ("flash", "one of titan, vllm")}
    for name, (bad, allowed) in cases.items():
        monkeypatch.setenv(name, bad)
        with pytest.raises(settings.SettingError) as e:
            settings.SETTINGS[name].get()
        assert str(e.value) == f"{name}={bad!r}: expected {allowed}"
        assert isinstance(e.value, ValueError)  # callers that caught the kernels' ValueError still do
    # start-up: every problem of the side at once; the other side's settings are not its business
    with pytest.raises(settings.SettingError) as e:
        settings.check("plugin")
    msg = str(e.value)
    assert all(n in msg for n in ("TITAN_GDN_RECURRENT", "TITAN_FUSED_KERNELS", "TITAN_PREFILL_ATTENTION")), msg
    assert "TITAN_HEAD_SAVE_GB" not in msg
    assert any("TITAN_HEAD_SAVE_GB" in p for p in settings.problems("trainer"))


def test_values_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for s in settings.SETTINGS.values():
        monkeypatch.delenv(s.name, raising=False)
    assert settings.GDN_RECURRENT.get() == "titan" and settings.FUSED_KERNELS.get() is True
    assert settings.BATCH_INVARIANT.get() is False and settings.HEAD_SAVE_GB.get() == 8 << 30
    assert settings.RL_CACHE.get() == Path.home() / ".cache" / "vllm-titan"
    monkeypatch.setenv("TITAN_BATCH_INVARIANT", "TRUE")
    monkeypatch.setenv("TITAN_HEAD_SAVE_GB", "0.5")
    monkeypatch.setenv("TITAN_GDN_RECURRENT", "")  # empty is unset
    assert settings.BATCH_INVARIANT.get() is True and settings.HEAD_SAVE_GB.get() == 1 << 29
    assert settings.GDN_RECURRENT.get() == "titan" and not settings.GDN_RECURRENT.is_set()


def test_docs_list_every_setting() -> None:
    doc = (REPO / "docs" / "settings.md").read_text()
    assert settings.markdown_table() in doc, "docs/settings.md: paste settings.markdown_table() in again"


def test_the_readme_table_names_every_setting() -> None:
    """The README's Configure table lists every declared variable, and no other ``TITAN_`` name."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Configure", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `TITAN_")}
    assert rows == set(settings.SETTINGS), rows ^ set(settings.SETTINGS)
