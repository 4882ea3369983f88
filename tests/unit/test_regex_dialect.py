"""The regex dialect: \\d \\w \\s are ASCII classes unless the regex opts in with (?u)."""

from __future__ import annotations

import pytest

from canteen.regex_dialect import ascii_classes


@pytest.mark.parametrize(
    ("regex", "expected"),
    [
        (r"\d{3}-\d{4}", "[[:digit:]]{3}-[[:digit:]]{4}"),
        (r"\W\S\D", "[[:^word:]][[:^space:]][[:^digit:]]"),
        (r"[\d\s_]+", "[[:digit:][:space:]_]+"),
        (r"[^\D]", "[^[:^digit:]]"),
        (r"[]\w]", "[][:word:]]"),
        (r"\\d\.", r"\\d\."),  # an escaped backslash, then a literal d
        (r"\p{L}\w", r"\p{L}[[:word:]]"),
        (r"[a[:alpha:]]\d", "[a[:alpha:]][[:digit:]]"),
        (r"(?u)\d+", r"(?u)\d+"),  # the Unicode opt-in passes as written
    ],
)
def test_classes_become_ascii(regex: str, expected: str) -> None:
    assert ascii_classes(regex) == expected
