"""The final answer of a model response, and the LaTeX that math-verify parses for an answer and a reference.

Everything here is plain Python (``re`` only) and runs in the scorer's own process; math-verify runs in the worker
processes (:mod:`megatron_dynamo.reward.verify`).
"""

from __future__ import annotations

import re
from typing import Sequence, Union

#: A reference answer: one string, or a list of accepted forms (any of them verifying counts as correct).
Reference = Union[str, Sequence[str]]

# --- answer extraction limits. They bound the work on adversarial text (a 200k-character response must cost
# milliseconds): the brace matcher gives up after this many characters of boxed content ...
_MAX_BOXED_SCAN_CHARS = 20_000
# ... only the last few \boxed occurrences are tried (a later unclosed or empty one falls back to an earlier one)
_MAX_BOXED_CANDIDATES = 8
# ... and the unboxed fallback only looks at the tail of the response, where a final answer lives.
_FALLBACK_WINDOW_CHARS = 2_000

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# A backslash escape (skipped, so "\{" and "\}" do not count) or a brace.
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.S)
# Inline or display math with bounded lengths: no unbounded backtracking.
_MATH_SEGMENT_RE = re.compile(
    r"\$\$([^$]{1,500})\$\$|\$([^$]{1,500})\$|\\\((.{1,500}?)\\\)|\\\[(.{1,500}?)\\\]", re.S
)
# A number: optional sign, thousands separators, decimals, a simple fraction; not glued to a word.
_NUMBER_RE = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?")
_SCIENTIFIC_RE = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?)[eE]([+-]?\d+)\s*$")
_UNESCAPED_DOLLAR_RE = re.compile(r"(?<!\\)\$")
# A plain decimal integer: ASCII digits only (str.isdigit and int() take other scripts' digits, math-verify's parser
# does not), at most 30 of them (the lengths tests/test_reward.py checks against math-verify; longer ones go to it).
_PLAIN_INTEGER_RE = re.compile(r"-?[0-9]{1,30}")


def _matching_brace(text: str, open_pos: int, max_chars: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_pos``; None if the text ends first; -1 if it is still
    open after ``max_chars`` characters."""
    depth = 0
    scan_end = min(len(text), open_pos + max_chars)
    for token in _BRACE_TOKEN_RE.finditer(text, open_pos, scan_end):
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            depth -= 1
            if depth == 0:
                return token.start()
    return -1 if scan_end < len(text) else None


def _boxed_content(text: str, macro_end: int) -> str | None:
    """Content of the ``\\boxed`` whose name ends at ``macro_end``; None if unclosed or empty.

    Content still open after ``_MAX_BOXED_SCAN_CHARS`` is returned cut at that length, so that the scorer's
    length cap rejects it (rather than falling back to some number inside it).
    """
    pos = macro_end
    while pos < len(text) and text[pos] in " \t":
        pos += 1
    if pos >= len(text):
        return None
    if text[pos] == "{":
        close = _matching_brace(text, pos, _MAX_BOXED_SCAN_CHARS)
        if close is None:
            return None
        if close == -1:
            return text[pos + 1:pos + _MAX_BOXED_SCAN_CHARS]
        content = text[pos + 1:close].strip()
    elif pos > macro_end:
        # "\\boxed 42": TeX would box one token; models mean the whole word.
        match = re.match(r"[^\s$]{1,200}", text[pos:pos + 200])
        content = match.group().rstrip(".,;:") if match else ""
    else:
        return None
    return content or None


def extract_answer(response: str, *, require_boxed: bool = False) -> str | None:
    """The final answer of a model response, or None when there is none.

    Rule, in order:

    1. The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 42``) with balanced braces
       (escaped ``\\{``/``\\}`` do not count). An unclosed or empty last box (a truncated answer, or an echo
       of the instruction "put your answer in \\boxed{}") falls back to the box before it (up to 8 boxes).
       A box still open after 20,000 characters gives its first 20,000 characters (too long to be scored).
    2. Unless ``require_boxed``: in the last 2,000 characters, whichever ends last of the last inline/display
       math segment (``$...$``, ``$$...$$``, ``\\(...\\)``, ``\\[...\\]``) and the last number (``-3``,
       ``1,000``, ``2.5``, ``3/4``; not part of a word like ``x2``).

    The work is bounded whatever the input (regex scans are linear, the brace matcher and the fallback
    window are capped): a 200,000-character string takes about a millisecond.
    """
    if not response:
        return None
    boxed_positions = [m.end() for m in _BOXED_RE.finditer(response)]
    for macro_end in reversed(boxed_positions[-_MAX_BOXED_CANDIDATES:]):
        content = _boxed_content(response, macro_end)
        if content is not None:
            return content
    if require_boxed:
        return None

    window = response[-_FALLBACK_WINDOW_CHARS:]
    last_math = None
    for last_math in _MATH_SEGMENT_RE.finditer(window):
        pass
    last_number = None
    for last_number in _NUMBER_RE.finditer(window):
        pass
    if last_math is not None and (last_number is None or last_math.end() >= last_number.end()):
        content = next(g for g in last_math.groups() if g is not None).strip()
        return content or None
    if last_number is not None:
        return last_number.group()
    return None


def _scientific_to_latex(text: str) -> str:
    """``3.83e35`` -> ``3.83 \\times 10^{35}``: LaTeX parsing would read ``e`` as Euler's number."""
    match = _SCIENTIFIC_RE.match(text)
    if match is None:
        return text
    return f"{match.group(1)} \\times 10^{{{int(match.group(2))}}}"


def answer_to_latex(answer: str) -> str:
    """What math-verify parses for an extracted answer: the answer as one boxed LaTeX expression.

    Boxing makes math-verify take the whole answer (not some number inside it); stray ``$`` are dropped.
    """
    answer = _UNESCAPED_DOLLAR_RE.sub("", _scientific_to_latex(answer.strip()))
    return "\\boxed{" + answer + "}"


def reference_to_latex(reference: str) -> str:
    """What math-verify parses for a reference answer.

    A bare reference (``\\frac{1}{2}``, ``\\pi``, ``3.83e35``) is boxed: parsed raw, math-verify would miss
    ``\\pi`` and read ``\\sqrt 2`` as 2. A reference that already carries its own ``$...$`` or ``\\boxed``
    (OlympiadBench writes ``$\\frac{1}{2 n+2}$``) is left as it is.
    """
    reference = _scientific_to_latex(reference.strip())
    if _UNESCAPED_DOLLAR_RE.search(reference) or "\\boxed" in reference:
        return reference
    return "\\boxed{" + reference + "}"


def normalize_references(reference: Reference) -> tuple[str, ...]:
    """A reference (string or list of accepted forms) as a tuple of distinct non-empty strings."""
    if reference is None:
        return ()
    forms = [reference] if isinstance(reference, (str, int, float)) else list(reference)
    out: list[str] = []
    for form in forms:
        if isinstance(form, (int, float)) and not isinstance(form, bool):
            form = str(form)
        if isinstance(form, str) and form.strip() and form.strip() not in out:
            out.append(form.strip())
    return tuple(out)


def integer_verdict(answer: str, forms: Sequence[str]) -> str | None:
    """``"correct"`` or ``"wrong"`` when the extracted answer and every reference form are plain decimal integers
    (``42``, ``-7``, ``007``), compared as numbers: math-verify's verdict on such a pair (tests/test_reward.py
    compares the two), decided without a worker round trip. None when either side is anything else."""
    answer = answer.strip()
    if not forms or not _PLAIN_INTEGER_RE.fullmatch(answer) \
            or not all(_PLAIN_INTEGER_RE.fullmatch(form) for form in forms):
        return None
    return "correct" if int(answer) in {int(form) for form in forms} else "wrong"
