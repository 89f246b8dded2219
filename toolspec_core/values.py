"""Argument values copied from the context: the FSM knows a value has begun, so match its text
so far against the conversation at the *character* level and draft the rest of the span.

Token-level prompt lookup misses exactly here: the value's first token follows ``": "`` in the
call but a space or a quote in the source, so the n-gram key never matches, and digits are one
token each. Text matching at a word start has no such boundary problem; the continuation is
then tokenized at the boundary like any schema candidate.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"[-+0-9.eE]*")
_STRING_END = '"\n'


def value_spans(source: str, prefix: str, scalar: bool, max_chars: int = 48, max_matches: int = 3) -> list[str]:
    """Distinct continuations of ``prefix`` at word starts in ``source``, most recent first.

    A string span ends where the source's line or JSON string ends (closing quote included when
    the source quoted it too); a scalar span is the rest of the number / literal.
    """
    if not prefix or not prefix[0].isalnum():
        return []
    out: list[str] = []
    end = len(source)
    while len(out) < max_matches:
        pos = source.rfind(prefix, 0, end)
        if pos < 0:
            break
        end = pos + len(prefix) - 1
        if pos > 0 and (source[pos - 1].isalnum() or source[pos - 1] == "_"):
            continue
        rest = source[pos + len(prefix) : pos + len(prefix) + max_chars]
        if scalar:
            cont = _NUMBER.match(rest).group(0) if prefix[0] in "-0123456789" else re.match(r"[a-z]*", rest).group(0)
        else:
            cut = min((i for i in (rest.find(c) for c in _STRING_END) if i >= 0), default=len(rest))
            cont = rest[:cut] + ('"' if cut < len(rest) and rest[cut] == '"' else "")
        if cont and cont not in out:
            out.append(cont)
    return out
