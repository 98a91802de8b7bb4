"""Verifiable rewards: boxed-answer math correctness, a format reward, and a tiny synthetic task.

Math: ``extract_boxed`` takes the *last* ``\\boxed{...}`` / ``\\fbox{...}`` of a completion (nested and
escaped braces handled; the braceless ``\\boxed 5`` too); ``math_equal`` checks it against the
reference with Math-Verify (HuggingFace's ``math-verify``: LaTeX -> sympy, symbolic and numeric
equivalence, sets/intervals/tuples) when it is installed, else with a small, restricted sympy
comparison. ``MathReward``: 1.0 if equivalent, else ``format_reward`` (default 0.0) if a boxed answer
was found at all, else 0.0.

``SyntheticTask``: prompts such as ``"What is 3 plus 4? The answer is"`` whose answer is one digit
(one token for the tiny tokenizer, ``" 7"``), scored leniently on the first number of the completion
-- a task a tiny random model can learn on CPU in a demo.
"""

from __future__ import annotations

import random
import re
import threading
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "extract_boxed",
    "math_equal",
    "format_reward",
    "MathReward",
    "SyntheticExample",
    "SyntheticTask",
    "math_verify_available",
]

# ----------------------------------------------------------------------------------------------
# answer extraction

# a control word ends at the first non-letter: \boxed5 is \boxed + "5", \boxedx is another macro
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _brace_group(text: str, j: int) -> tuple[str, int] | None:
    """``text[j] == "{"``: the content up to the matching ``}`` and the index after it, or None
    when unbalanced. Escaped braces (``\\{``, ``\\}``) do not count."""
    depth = 0
    k = j
    while k < len(text):
        ch = text[k]
        if ch == "\\":
            k += 2  # skip the escaped character, so \} inside a set does not close the group
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1 : k], k + 1
        k += 1
    return None


def _box_argument(text: str, i: int) -> str | None:
    j = i
    while j < len(text) and text[j].isspace():  # TeX skips spaces after a control word
        j += 1
    if j < len(text) and text[j] == "{":
        g = _brace_group(text, j)
        return None if g is None else g[0]
    # braceless "\boxed 5": take the run up to whitespace or '$' (models mean the whole number, not
    # TeX's single-token argument), minus closing math delimiters and sentence punctuation
    m = re.match(r"[^\s$]+", text[j:])
    if m is None:
        return None
    arg = m.group(0)
    arg = re.sub(r"(\\\)|\\\]|\})+$", "", arg).rstrip(".,;:")
    return arg or None


def extract_boxed(text: str) -> str | None:
    """Content of the last parseable ``\\boxed``/``\\fbox`` in ``text`` (stripped), or None."""
    for m in reversed(list(_BOX_RE.finditer(text))):
        arg = _box_argument(text, m.end())
        if arg is not None and arg.strip():
            return arg.strip()
    return None


def format_reward(completion: str) -> float:
    """1.0 when the completion states a boxed final answer, else 0.0."""
    return 1.0 if extract_boxed(completion) is not None else 0.0


# ----------------------------------------------------------------------------------------------
# equivalence


def math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")


def _normalize(s: str) -> str:
    """Presentation-only rewrites shared by both backends' fast path and the sympy fallback."""
    s = s.strip().strip("$").strip()
    s = _TEXT_CMD_RE.sub(r"\1", s)
    for a, b in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""),
                 ("\\ ", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^{\\circ}", ""),
                 ("^\\circ", ""), ("\\%", ""), ("\\$", ""), ("\\displaystyle", "")):
        s = s.replace(a, b)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators: 1,000 -> 1000
        s = s.replace(",", "")
    return s


def _math_verify_equal(pred: str, ref: str) -> bool:
    from math_verify import parse, verify

    # Math-Verify's timeouts use SIGALRM, which only the main thread may set; elsewhere run without
    timeout: int | None = 5 if threading.current_thread() is threading.main_thread() else None
    # wrapping in \boxed{} sends both sides through its LaTeX extractor (plain numbers parse too)
    gold = parse(f"\\boxed{{{ref}}}", parsing_timeout=timeout)
    guess = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
    if not gold or not guess:
        return False
    return bool(verify(gold, guess, timeout_seconds=timeout))


# the sympy fallback evaluates text with parse_expr (a Python eval): only these names may appear,
# and globals are restricted, so a completion cannot reach Python builtins (e.g. exec(bytes(...)))
_SAFE_NAMES = {"sqrt", "pi", "oo"}
_MAX_FALLBACK_LEN = 200


def _latex_group(s: str, i: int) -> tuple[str, int]:
    while i < len(s) and s[i].isspace():
        i += 1
    if i >= len(s):
        raise ValueError("missing argument")
    if s[i] == "{":
        g = _brace_group(s, i)
        if g is None:
            raise ValueError("unbalanced braces")
        return g
    if s[i] == "\\":
        m = re.match(r"\\[A-Za-z]+", s[i:])
        if m:
            return m.group(0), i + len(m.group(0))
    return s[i], i + 1  # \frac12: single-character arguments


def _latex_to_expr(s: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(s):
        if s.startswith("\\frac", i):
            a, i = _latex_group(s, i + 5)
            b, i = _latex_group(s, i)
            out.append(f"(({_latex_to_expr(a)})/({_latex_to_expr(b)}))")
        elif s.startswith("\\sqrt", i):
            i += 5
            root = None
            if i < len(s) and s[i] == "[":
                close = s.index("]", i)
                root, i = s[i + 1 : close], close + 1
            a, i = _latex_group(s, i)
            inner = _latex_to_expr(a)
            out.append(f"sqrt({inner})" if root is None else f"(({inner})**(1/({_latex_to_expr(root)})))")
        else:
            out.append(s[i])
            i += 1
    expr = "".join(out)
    for a, b in (("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("\\pi", "pi"), ("\\infty", "oo"),
                 ("^", "**"), ("{", "("), ("}", ")")):
        expr = expr.replace(a, b)
    return expr


def _to_sympy(s: str):  # -> sympy.Basic | tuple
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    s = _normalize(s)
    # "x = 3" answers: compare the value
    if s.count("=") == 1 and re.fullmatch(r"[A-Za-z]", s.split("=")[0]):
        s = s.split("=")[1]
    expr = _latex_to_expr(s)
    if "\\" in expr or not re.fullmatch(r"[0-9A-Za-z+\-*/().,\s]*", expr):
        raise ValueError(f"unsupported: {s!r}")
    for name in re.findall(r"[A-Za-z]{2,}", expr):
        if name not in _SAFE_NAMES:
            raise ValueError(f"unsupported name {name!r}")
    # exact integer powers with huge exponents would hang sympy
    if expr.count("**") > 2 or re.search(r"\*\*\(*\d{4,}", expr):
        raise ValueError("exponent too large")
    glb = {"__builtins__": {}, "Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational,
           "Symbol": sympy.Symbol, "Function": sympy.Function, "sqrt": sympy.sqrt, "pi": sympy.pi, "oo": sympy.oo}
    tr = standard_transformations + (implicit_multiplication_application, convert_xor)
    return parse_expr(expr, global_dict=glb, local_dict={}, transformations=tr)


def _sympy_scalar_equal(a, b) -> bool:
    import sympy

    try:
        if sympy.simplify(a - b) == 0:
            return True
    except Exception:
        pass
    try:
        da, db = complex(sympy.N(a)), complex(sympy.N(b))
    except Exception:
        return False
    return abs(da - db) <= 1e-6 * max(1.0, abs(db))


def _sympy_equal(pred: str, ref: str) -> bool:
    if len(pred) > _MAX_FALLBACK_LEN or len(ref) > _MAX_FALLBACK_LEN:
        return False
    try:
        a, b = _to_sympy(pred), _to_sympy(ref)
    except Exception:
        return False
    import sympy

    ta, tb = isinstance(a, (tuple, sympy.Tuple)), isinstance(b, (tuple, sympy.Tuple))
    if ta or tb:
        if not (ta and tb) or len(a) != len(b):
            return False
        return all(_sympy_scalar_equal(x, y) for x, y in zip(a, b, strict=True))
    return _sympy_scalar_equal(a, b)


Backend = Literal["auto", "math_verify", "sympy"]


def math_equal(pred: str, ref: str, backend: Backend = "auto") -> bool:
    """Whether answer ``pred`` is mathematically equivalent to reference ``ref`` (LaTeX or plain).

    ``backend="auto"`` uses Math-Verify when importable, else the sympy fallback, which handles
    numbers, ``\\frac``/``\\sqrt``/``\\pi``, products and powers, tuples and ``x = v``; anything else
    it cannot read compares as not equal (after the string fast path).
    """
    if _normalize(pred) == _normalize(ref):
        return True
    if backend == "math_verify" or (backend == "auto" and math_verify_available()):
        try:
            return _math_verify_equal(pred, ref)
        except ImportError:
            if backend == "math_verify":
                raise
        except Exception:
            # a parse/verify crash on odd model output is a wrong answer, not a training crash
            return False
    return _sympy_equal(pred, ref)


class MathReward:
    """``reward(completion, reference) -> float``: 1.0 when the last boxed answer of ``completion``
    is equivalent to ``reference`` (itself boxed or plain), else ``config.format_reward`` when a boxed
    answer exists, else 0.0."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        backend: Backend = "auto"
        format_reward: float = 0.0
        """Partial credit for a boxed but wrong answer (0.0: pure correctness reward)."""

        def build(self) -> MathReward:
            return MathReward(self)

    def __init__(self, config: Config | None = None) -> None:
        self.config = config if config is not None else MathReward.Config()
        if self.config.backend == "math_verify" and not math_verify_available():
            raise ImportError("backend='math_verify' needs the math-verify package (pip install math-verify)")

    def __call__(self, completion: str, reference: str) -> float:
        pred = extract_boxed(completion)
        if pred is None:
            return 0.0
        ref = extract_boxed(reference) or reference
        if math_equal(pred, ref, self.config.backend):
            return 1.0
        return float(self.config.format_reward)


# ----------------------------------------------------------------------------------------------
# synthetic task for CPU demos


@dataclass(frozen=True)
class SyntheticExample:
    prompt: str
    answer: str


_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(kw_only=True)
class SyntheticTask:
    """Single-digit arithmetic a tiny model can learn: ``kind="sum"`` asks for ``a + b`` with
    ``a + b <= max_answer``; ``kind="copy"`` asks to repeat a digit. With ``max_answer <= 9`` the answer
    is one digit, i.e. one token (``" 7"``) for the tiny BPE tokenizer, whose training text uses
    the same phrasing."""

    kind: Literal["sum", "copy"] = "sum"
    max_answer: int = 9

    def __post_init__(self) -> None:
        if self.kind not in ("sum", "copy"):
            raise ValueError(f"kind must be 'sum' or 'copy', got {self.kind!r}")
        if self.max_answer < 0:
            raise ValueError(f"max_answer must be >= 0, got {self.max_answer}")

    def sample(self, n: int, seed: int = 0) -> list[SyntheticExample]:
        """``n`` examples, deterministic in ``seed``."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            if self.kind == "sum":
                c = rng.randint(0, self.max_answer)
                a = rng.randint(0, c)
                out.append(SyntheticExample(f"What is {a} plus {c - a}? The answer is", str(c)))
            else:
                a = rng.randint(0, self.max_answer)
                out.append(SyntheticExample(f"Repeat {a}. The answer is", str(a)))
        return out

    @staticmethod
    def score(completion_text: str, answer: str) -> float:
        """1.0 when the first number in the completion equals the answer (``" 7."``, ``"7 apples"``,
        ``"7.0"`` all pass; ``"78"`` and ``"no idea"`` do not), else 0.0."""
        m = _NUMBER_RE.search(completion_text)
        if m is None:
            return 0.0
        try:
            return 1.0 if float(m.group(0)) == float(answer) else 0.0
        except ValueError:
            return 0.0
