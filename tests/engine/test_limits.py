"""Every token limit of a job in one place (toolspec_core.engine.limits): each limit's error, code
and parameter, the resolved output length, and no other module range-checking it again."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from tiny import tiny_target

from toolspec_core.engine.limits import TokenLimits, requested_tokens, token_budget
from toolspec_core.engine.sequence import DecodeConfig, Sequence
from toolspec_core.errors import ContextLengthError, InvalidRequestError

ROOT = Path(__file__).resolve().parents[2]

# a replica: window 1000, a KV pool of 600 of which 64 kept for a draft tree, asks capped at 400,
# 100 by default, prompts of at most 800 tokens
SERVER = TokenLimits(context=1000, pool_tokens=600, tree_rows=64, max_tokens=400, default=100, prompt_tokens=800)
WINDOW = TokenLimits(context=1000)  # the single-request API: the target's window alone

INVALID, CONTEXT = "invalid_value", "context_length_exceeded"

# (case, call, (error class, code, param, message part) or the resolved length)
CASES = [
    ("asked in range", lambda: requested_tokens(400, None, 400), 400),
    ("asked as max_completion_tokens", lambda: requested_tokens(None, 7, 400), 7),
    ("both asked, equal", lambda: requested_tokens(7, 7, 400), 7),
    ("none asked", lambda: requested_tokens(None, None, 400), None),
    (
        "max_tokens 0",
        lambda: requested_tokens(0, None, 400),
        (InvalidRequestError, INVALID, "max_tokens", "between 1 and 400"),
    ),
    (
        "max_tokens over the cap",
        lambda: requested_tokens(401, None, 400),
        (InvalidRequestError, INVALID, "max_tokens", "got 401"),
    ),
    (
        "max_completion_tokens negative",
        lambda: requested_tokens(None, -1, 400),
        (InvalidRequestError, INVALID, "max_completion_tokens", "Invalid 'max_completion_tokens'"),
    ),
    (
        "both asked, different",
        lambda: requested_tokens(5, 6, 400),
        (InvalidRequestError, INVALID, "max_tokens", "not both"),
    ),
    ("no cap: any positive length", lambda: requested_tokens(10**6, None, None), 10**6),
    (
        "no cap: still positive",
        lambda: requested_tokens(0, None, None),
        (InvalidRequestError, INVALID, "max_tokens", "positive"),
    ),
    (
        "a bool is no length",
        lambda: requested_tokens(True, None, None),
        (InvalidRequestError, INVALID, "max_tokens", "True"),
    ),
    ("fits everything", lambda: token_budget(100, 300, SERVER), 300),
    ("empty prompt", lambda: token_budget(0, 5, SERVER), (InvalidRequestError, INVALID, "messages", "prompt is empty")),
    (
        "prompt over limits.prompt_tokens",
        lambda: token_budget(801, 5, SERVER),
        (InvalidRequestError, INVALID, "messages", "limits.prompt_tokens"),
    ),
    (
        "asked over the server's cap",
        lambda: token_budget(10, 401, SERVER),
        (InvalidRequestError, INVALID, "max_tokens", "between 1 and 400"),
    ),
    (
        "prompt + asked over the window",
        lambda: token_budget(990, 11, WINDOW),
        (ContextLengthError, CONTEXT, "messages", "context window of 1000 tokens"),
    ),
    ("prompt + asked fills the window", lambda: token_budget(990, 10, WINDOW), 10),
    (
        "prompt alone fills the window",
        lambda: token_budget(1000, None, WINDOW),
        (ContextLengthError, CONTEXT, "messages", "max_tokens 1 exceeds the context window"),
    ),
    (
        "prompt + asked over the KV pool",
        lambda: token_budget(300, 237, SERVER),
        (
            ContextLengthError,
            CONTEXT,
            "messages",
            "KV pool of 600 tokens (64 kept for a draft tree); ask for at most 236",
        ),
    ),
    ("prompt + asked fills the KV pool", lambda: token_budget(300, 236, SERVER), 236),
    (
        "prompt alone over the KV pool",
        lambda: token_budget(600, None, SERVER),
        (ContextLengthError, CONTEXT, "messages", "ask for at most 0"),
    ),
    ("default", lambda: token_budget(10, None, SERVER), 100),
    ("default cut to the window", lambda: token_budget(950, None, WINDOW), 50),
    ("default cut to the KV pool", lambda: token_budget(500, None, SERVER), 36),
]


@pytest.mark.parametrize("call,want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_limit(call, want):
    if not isinstance(want, tuple):
        assert call() == want
        return
    cls, code, param, part = want
    with pytest.raises(InvalidRequestError) as err:
        call()
    assert type(err.value) is cls
    assert (err.value.code, err.value.param) == (code, param)
    assert part in str(err.value)


@pytest.mark.parametrize(
    "limits,prompt,new", [(SERVER, 1, 1), (SERVER, 100, 300), (SERVER, 300, 236), (WINDOW, 990, 10), (SERVER, 535, 1)]
)
def test_what_the_budget_lets_through_holds(limits, prompt, new):
    """The engine's invariant (:meth:`TokenLimits.holds`) is exactly what token_budget allows."""
    free = TokenLimits(limits.context, limits.pool_tokens, limits.tree_rows)  # the engine's part of the limits
    assert token_budget(prompt, new, free) == new
    assert free.holds(prompt, new)
    for p, n in ((prompt, new + 1000), (prompt + 1000, new), (0, new), (prompt, 0)):
        assert not free.holds(p, n)
        with pytest.raises(InvalidRequestError):
            token_budget(p, n, free)


def test_the_engine_asserts_limits_it_does_not_answer_users():
    """A sequence made past the target's window is a caller's bug (a ValueError, a 500 on a
    server), not a request error: requests are refused before their sequence is made."""
    tg = tiny_target()
    with pytest.raises(ValueError, match="does not fit") as err:
        Sequence(tg, [1] * tg.max_context, None, DecodeConfig(max_new_tokens=1))
    assert not isinstance(err.value, InvalidRequestError)


# ------------------------------------------------------------------------- one owner of the checks

WORDS = ("max_tokens", "max_completion_tokens", "max_context", "capacity_tokens", "tree_rows")
MESSAGES = ("max_tokens", "max_completion_tokens", "max_new_tokens", "context window", "KV pool")
ERRORS = ("InvalidRequestError", "ContextLengthError", "APIError")


def _mentions(node: ast.AST, words) -> bool:
    for e in ast.walk(node):
        name = e.attr if isinstance(e, ast.Attribute) else e.id if isinstance(e, ast.Name) else None
        if name in words:
            return True
    return False


def _strings(node: ast.AST) -> str:
    return " ".join(e.value for e in ast.walk(node) if isinstance(e, ast.Constant) and isinstance(e.value, str))


def limit_checks(path: Path) -> list[tuple[str, int]]:
    """(what, line) of every token-limit check in a module: a comparison that reads a request's
    ``max_tokens`` / ``max_completion_tokens``, the window or the pool's capacity, and every
    user-facing error (InvalidRequestError, ContextLengthError, APIError) about an output length,
    the window or the pool."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and _mentions(node, WORDS):
            out.append(("compare", node.lineno))
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name == "ContextLengthError" or (name in ERRORS and any(m in _strings(node) for m in MESSAGES)):
                out.append((name, node.lineno))
    return out


def test_one_module_checks_token_limits():
    """toolspec_core/engine/limits.py is the one place a job's token counts are checked: a module
    that range-checks ``max_tokens`` again, compares against the window or the pool's capacity,
    or raises a user's error about them fails here. Checks of other things by those names
    (the graph pool's buckets, a config's default against its cap, the history's size) are listed."""
    allowed = {
        "toolspec_core/engine/limits.py",
        "toolspec_core/model/graphs.py",  # a captured graph's rows against the pool's capacity
        "toolspec_core/drafters/history.py",  # a tenant's history held to its own max_tokens
    }
    found = {}
    for pkg in ("toolspec_core", "deployments"):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            hits = limit_checks(path)
            if hits and rel not in allowed:
                found[rel] = hits
    assert found == {}
    assert all(limit_checks(ROOT / a) for a in allowed)  # the checker sees the checks where they are


def test_the_checker_finds_a_range_check(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(req, most):\n"
        "    if req.max_tokens > most:\n"
        "        raise APIError(f'Invalid max_tokens {req.max_tokens}', param='max_tokens')\n"
    )
    assert [w for w, _ in limit_checks(bad)] == ["compare", "APIError"]
