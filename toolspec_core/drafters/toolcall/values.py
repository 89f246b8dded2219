"""Argument values copied from the context: the FSM knows a value has begun, so match its text
so far against the conversation at the *character* level and draft the rest of the span.

Token-level prompt lookup misses exactly here: the value's first token follows ``": "`` in the
call but a space or a quote in the source, so the n-gram key never matches, and digits are one
token each. Text matching at a word start has no such boundary problem; the continuation is
then tokenized at the boundary like any schema candidate.
"""

from __future__ import annotations

import functools
import re

_NUMBER = re.compile(r"[-+0-9.eE]*")
_STRING_END = '"\n'


def value_spans(source: str, prefix: str, scalar: bool, max_chars: int = 48, max_matches: int = 3) -> list[str]:
    """Distinct continuations of ``prefix`` at word starts in ``source``, most recent first.

    A string span ends where the source's line or JSON string ends (closing quote included when
    the source quoted it too); a scalar span is the rest of the number / literal.
    """
    if scalar and prefix[:1] == "-":  # a negative number: its digits may be written unsigned ("122.4194 W")
        prefix = prefix[1:]
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


def digit_run(prefix: str, min_run: int = 3, stop: str = "0") -> str:
    """The rest of a counting run a value has begun ("123" -> "4567890"): placeholder ids,
    phone numbers and account numbers models make up count up, and digits are one token each.
    Ends after ``stop`` ("...890"); the verifier keeps what the model really writes."""
    run = 1
    while (
        run < len(prefix)
        and prefix[-run - 1].isdigit()
        and prefix[-run].isdigit()
        and (int(prefix[-run]) - int(prefix[-run - 1])) % 10 == 1
    ):
        run += 1
    if run < min_run or not prefix[-1].isdigit() or prefix[-1] == stop:
        return ""
    out, d = "", int(prefix[-1])
    while str(d) != stop:
        d = (d + 1) % 10
        out += str(d)
    return out


# ---- values written in another form than the context's: dates and times ----
# A user says "March 19th at 9:30 AM"; the call says "2023-03-19 09:30:00". Digits are one token
# each, so such a value costs a step per digit unless it is drafted whole: render every date the
# conversation mentions in the forms a call would use (the schema's own strftime format first).

_MONTHS = {
    m: i + 1
    for i, m in enumerate(
        (
            "january",
            "february",
            "march",
            "april",
            "may",
            "june",
            "july",
            "august",
            "september",
            "october",
            "november",
            "december",
        )
    )
}
_MONTHS.update({m[:3]: i for m, i in list(_MONTHS.items())})
_MONTHS["sept"] = 9
_MON = r"(?P<mon>" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\.?"
_DAY = r"(?P<day>[0-3]?\d)(?:st|nd|rd|th)?"
_YEAR = r"(?P<year>(?:19|20)\d\d)"
_DATE_PATTERNS = (
    re.compile(r"\b" + _MON + r"\s+" + _DAY + r"\b(?:,?\s+" + _YEAR + r"\b)?", re.IGNORECASE),
    re.compile(r"\b" + _DAY + r"\s+(?:of\s+)?" + _MON + r"\b(?:,?\s+" + _YEAR + r"\b)?", re.IGNORECASE),
    re.compile(r"\b(?P<mnum>[01]?\d)/(?P<day>[0-3]?\d)/" + _YEAR + r"\b"),
)
_TIME = re.compile(
    r"\b(?P<h>[012]?\d)(?::(?P<m>[0-5]\d))?(?::[0-5]\d)?\s*(?P<ap>[ap])\.?m\b\.?|\b(?P<h24>[012]?\d):(?P<m24>[0-5]\d)\b",
    re.IGNORECASE,
)
_ANY_YEAR = re.compile(r"\b" + _YEAR + r"\b")
_STRFTIME = re.compile(r"%[YmdHMSIpyBbj](?:[^%\"'a-zA-Z\n]{0,3}%[YmdHMSIpyBbj])*")
_DATE_WORDS = re.compile(r"date|time|day|when|deadline|start|end|birth|schedule|expir", re.IGNORECASE)


def context_dates(text: str, window: int = 60) -> list[tuple[tuple[int, int, int], tuple[int, int] | None]]:
    """((year, month, day), (hour, minute) or None) for each date the text mentions, latest first.

    A date without a year takes the latest year written before it (or the first one after:
    "The current year is 2023." often opens a system prompt); a time in the same sentence, within
    ``window`` characters of the date, is taken as its time.
    """
    times = [(m.start(), m.end(), _hm(m)) for m in _TIME.finditer(text)]
    years = [(m.start(), int(m.group("year"))) for m in _ANY_YEAR.finditer(text)]
    found: dict[int, tuple[tuple[int, int, int], tuple[int, int] | None]] = {}
    for pat in _DATE_PATTERNS:
        for m in pat.finditer(text):
            month = _MONTHS[m.group("mon").lower()] if "mon" in pat.groupindex else int(m.group("mnum"))
            day = int(m.group("day"))
            year = int(m.group("year")) if m.group("year") else _year_near(years, m.start())
            if year is None or not (1 <= month <= 12 and 1 <= day <= 31) or m.start() in found:
                continue
            near = [
                (g, hm)
                for a, b, hm in times
                if hm is not None and (g := _gap(text, m.start(), m.end(), a, b)) <= window
            ]
            found[m.start()] = ((year, month, day), min(near)[1] if near else None)
    return [found[k] for k in sorted(found, reverse=True)]


def _gap(text: str, start: int, end: int, a: int, b: int) -> float:
    """Characters between a date [start, end) and a time [a, b) of the same sentence (a time
    before the date counts double); another sentence: infinitely far."""
    between = text[end:a] if a >= end else text[b:start]
    if re.search(r"[.?!;\n](\s|$)", between):
        return float("inf")
    return len(between) if a >= end else 2 * len(between)


def _hm(m: re.Match) -> tuple[int, int] | None:
    if m.group("h24") is not None:
        h, mi = int(m.group("h24")), int(m.group("m24"))
    else:
        h, mi = int(m.group("h")) % 12 + (12 if m.group("ap").lower() == "p" else 0), int(m.group("m") or 0)
    return (h, mi) if h < 24 else None


def _year_near(years: list[tuple[int, int]], pos: int) -> int | None:
    before = [y for p, y in years if p < pos]
    return before[-1] if before else (years[0][1] if years else None)


def wants_date(key: str, schema: dict) -> bool:
    """Whether a string argument may hold a date or time (its name, description or format says so)."""
    return _wants_date(key, str(schema.get("description") or ""), str(schema.get("format") or ""))


@functools.lru_cache(maxsize=4096)
def _wants_date(key: str, description: str, fmt: str) -> bool:
    return fmt in ("date", "date-time", "time") or bool(_DATE_WORDS.search(key)) or bool(_STRFTIME.search(description))


def date_values(
    dates: list[tuple[tuple[int, int, int], tuple[int, int] | None]], schema: dict, max_values: int = 6
) -> list[str]:
    """The context's dates rendered as a call would write them: the format the schema's
    description gives (``Format: %Y-%m-%d``), then ISO date, date + time and time forms."""
    return list(
        _date_values(tuple(dates), str(schema.get("description") or ""), str(schema.get("format") or ""), max_values)
    )


@functools.lru_cache(maxsize=4096)  # the schema tree asks again at every step
def _date_values(dates: tuple, description: str, fmt: str, max_values: int) -> tuple[str, ...]:
    import datetime as dt

    hint = _STRFTIME.search(description)
    out: list[str] = []
    for (y, mo, d), hm in dates:
        try:
            when = dt.datetime(y, mo, d, *(hm or (0, 0)))
        except ValueError:
            continue
        forms = [hint.group(0)] if hint and (hm or not re.search(r"%[HMSIp]", hint.group(0))) else []
        if fmt == "time":
            forms += ["%H:%M:%S", "%H:%M"] if hm else []
        else:
            forms += (
                (["%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M"] if hm else [])
                + ["%Y-%m-%d"]
                + (["%H:%M:%S", "%H:%M"] if hm else [])
            )
        for f in forms:
            v = when.strftime(f)
            if v not in out:
                out.append(v)
    return tuple(out[:max_values])


# ---- numbers: a number argument is most often one the conversation wrote ----

_WRITTEN_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")


def context_numbers(text: str, max_numbers: int = 16) -> list[str]:
    """Distinct numbers the text writes (as JSON numbers: no leading zeros), latest first."""
    out: list[str] = []
    for m in reversed(list(_WRITTEN_NUMBER.finditer(text))):
        v = m.group()
        digits = v.lstrip("-")
        if len(digits) > 1 and digits[0] == "0" and not digits.startswith("0."):
            continue
        if v not in out:
            out.append(v)
        if len(out) >= max_numbers:
            break
    return out


def numbers_for(numbers: list[str], schema: dict, max_values: int = 4) -> list[str]:
    """The context's numbers a number / integer argument of ``schema`` may take: integers only for
    "integer", none below ``minimum`` / above ``maximum`` (exclusive bounds too), none negative
    where the schema forbids a sign."""
    out = []
    for v in numbers:
        if schema.get("type") == "integer" and "." in v:
            continue
        x = float(v)
        lo, hi = schema.get("minimum"), schema.get("maximum")
        xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if (isinstance(lo, (int, float)) and x < lo) or (isinstance(hi, (int, float)) and x > hi):
            continue
        if (isinstance(xlo, (int, float)) and x <= xlo) or (isinstance(xhi, (int, float)) and x >= xhi):
            continue
        out.append(v)
        if len(out) >= max_values:
            break
    return out
