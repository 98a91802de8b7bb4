"""Run a test file's own checks in a subprocess under the Triton interpreter (CPU).

``TRITON_INTERPRET=1`` must be set before a kernel is defined and must not leak into other tests, so each
interpreter test module executes itself as a script (``run_checks`` prints "ALL OK") in a fresh process.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

ROOT = Path(__file__).resolve().parents[1]


def run_checks_under_interpreter(test_file: str, timeout_s: float = 300) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.time()
    r = subprocess.run([sys.executable, test_file], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, f"interpreter checks failed:\n{r.stdout}\n{r.stderr}"
    assert "ALL OK" in r.stdout, r.stdout
    print(r.stdout, f"(subprocess {time.time() - t0:.1f}s)")


def run_checks(checks: Iterable[Callable[[], None]]) -> None:
    """The script side: run each check under the interpreter, timing it; "ALL OK" once all have passed."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (sets TRITON_INTERPRET=1)"
    for check in checks:
        t0 = time.time()
        check()
        print(f"{check.__name__}: ok ({time.time() - t0:.2f}s)")
    print("ALL OK")


@contextlib.contextmanager
def reversed_program_order() -> Iterator[list[int]]:
    """Within the block, the interpreter runs a launch's programs last to first (it runs them first to last, one
    after the other; a GPU runs them in no set order). A kernel correct only in one order -- a program reading what
    a later program of the same launch writes -- fails one of the two. Yields a list that counts the launches run
    reversed (a check that the patch took)."""
    import triton.runtime.interpreter as interp

    executor_code = interp.GridExecutor.__call__.__code__
    launches: list[int] = []

    def grid_range(*args: int) -> Iterable[int]:
        r = builtins.range(*args)
        if sys._getframe(1).f_code is not executor_code:
            return r
        if args == (r.stop,) and r.stop > 1:
            launches.append(r.stop)
        return reversed(r)

    interp.range = grid_range  # type: ignore[attr-defined]
    try:
        yield launches
    finally:
        del interp.range
