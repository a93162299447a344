"""``code_tests``: a code task's reward, the share of its tests a completion passes.

The completion's code is its last fenced block (```python ... ``` or a bare
```), else the whole completion. The sample's answer holds its tests, in one
of two forms:

- input/output cases, a JSON (or Python literal) list of
  ``{"stdin": "...", "stdout": "..."}``: each case runs the code once in the
  sandbox with that input and passes when the program exits 0 and prints
  that output (compared line by line, trailing whitespace ignored). The
  comparison happens outside the sandbox, so a program cannot forge it.
- Python test statements, e.g. ``assert add(2, 3) == 5`` one per line:
  the code runs once, followed by each statement in turn; a statement
  passes when it raises nothing. They run in the program's own process,
  so a program written to cheat could fake them: use cases where that matters.

Any failure (a syntax error, a timeout, the memory limit) scores those
tests 0; the reward itself never raises on a bad completion.
"""

from __future__ import annotations

import ast
import json
import re
import secrets

from rldsl.rewards.sandbox import DEFAULT_MEMORY, run_python

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_CODE_LANGUAGES = ("", "python", "py", "python3")


def extract_code(completion: str) -> str:
    """The last fenced Python (or unlabelled) block, else the completion."""
    blocks = [body for language, body in _FENCE.findall(completion) if language.lower() in _CODE_LANGUAGES]
    return blocks[-1] if blocks else completion


def parse_cases(tests: str) -> list[dict] | None:
    """Input/output cases, or None when ``tests`` holds test statements."""
    for parse in (json.loads, ast.literal_eval):
        try:
            cases = parse(tests)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(cases, dict):
            cases = [cases]
        if isinstance(cases, list) and cases and all(isinstance(c, dict) and "stdout" in c for c in cases):
            return cases
    return None


def code_tests(response: str, answer: str, prompt: str = "", timeout: float = 2.0,
               memory: int = DEFAULT_MEMORY) -> float:
    """The share of the answer's tests the response's code passes, in [0, 1]
    (``timeout`` seconds and ``memory`` bytes per run of the code)."""
    code = extract_code(response)
    cases = parse_cases(answer)
    if cases is not None:
        return sum(_passes(code, case, timeout, memory) for case in cases) / len(cases)
    statements = _statements(answer)
    if not statements:
        raise ValueError("code_tests: the answer holds no tests: expected a list of "
                         '{"stdin": ..., "stdout": ...} cases or Python test statements')
    return _statements_passed(code, statements, timeout, memory) / len(statements)


def _passes(code: str, case: dict, timeout: float, memory: int) -> bool:
    result = run_python(code, str(case.get("stdin", "")), timeout=timeout, memory=memory)
    return result.ok and _lines(result.stdout) == _lines(str(case["stdout"]))


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def _statements(tests: str) -> list[str]:
    """Each top-level statement of the tests, as its own source."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as error:
        raise ValueError(f"code_tests: the tests do not parse: {error}") from None
    return [ast.unparse(node) for node in tree.body]


def _statements_passed(code: str, statements: list[str], timeout: float, memory: int) -> int:
    mark = f"rldsl-tests-{secrets.token_hex(8)}"
    harness = (f"import sys\n_code, _tests = {code!r}, {statements!r}\n"
               "_scope = {'__name__': '__main__'}\n"
               "exec(compile(_code, 'solution.py', 'exec'), _scope)\n"
               "_passed = 0\n"
               "for _test in _tests:\n"
               "    try:\n"
               "        exec(_test, _scope)\n"
               "        _passed += 1\n"
               "    except BaseException:\n"
               "        pass\n"
               f"sys.stdout.flush()\nsys.stderr.write('\\n{mark} %d\\n' % _passed)\n")
    result = run_python(harness, "", timeout=timeout, memory=memory)
    found = re.findall(rf"^{mark} (\d+)$", result.stderr, re.MULTILINE)
    return min(int(found[-1]), len(statements)) if found and result.exit_code == 0 else 0
