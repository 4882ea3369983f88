"""The regex dialect of a ``regex`` constraint: Rust regex syntax with ASCII classes.

llguidance reads a regex as Rust's ``regex`` crate does, where ``\\d``, ``\\w`` and ``\\s``
are Unicode classes: ``\\d`` then matches the segmented digits U+1FBF0..9 too, and a model
that likes an emoji's lead byte writes those. Users of vLLM and Outlines, and JSON Schema's
``pattern`` (ECMA-262), expect ASCII: ``\\d`` is ``[0-9]``. So each of the six escapes
becomes its ASCII POSIX class before the engine sees the regex. A regex that starts with
``(?u)`` opts in to the engine's Unicode classes and is passed on as written.
"""

from __future__ import annotations

UNICODE_OPT_IN = "(?u)"
# escape -> POSIX class, used as is inside a bracket class and wrapped in [...] outside one
_CLASSES = {
    "d": "[:digit:]",
    "D": "[:^digit:]",
    "w": "[:word:]",
    "W": "[:^word:]",
    "s": "[:space:]",
    "S": "[:^space:]",
}


def ascii_classes(regex: str) -> str:
    """``regex`` with ``\\d \\w \\s`` (and their negations) as ASCII classes, unless it
    starts with ``(?u)``. Escaped backslashes and ``\\p{...}`` stay as they are."""
    if regex.startswith(UNICODE_OPT_IN):
        return regex
    out: list[str] = []
    depth, at = 0, 0  # depth: nesting of bracket classes, e.g. [a[:digit:]]
    while at < len(regex):
        char = regex[at]
        if char == "\\" and at + 1 < len(regex):
            escaped = regex[at + 1]
            posix = _CLASSES.get(escaped)
            if posix is None:
                out.append(regex[at : at + 2])
            else:
                out.append(posix if depth else f"[{posix}]")
            at += 2
            continue
        if char == "[":
            depth += 1
            out.append(char)
            at += 1
            # a "]" first in a class (after an optional "^") is a literal
            if at < len(regex) and regex[at] == "^":
                out.append("^")
                at += 1
            if at < len(regex) and regex[at] == "]":
                out.append("]")
                at += 1
            continue
        if char == "]" and depth:
            depth -= 1
        out.append(char)
        at += 1
    return "".join(out)
