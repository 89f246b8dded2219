"""API keys and their limits, without a server."""

from __future__ import annotations

import hashlib

import pytest

from deployments.keys import OPEN, KeyLimiter, KeyRing, key_hash


def test_keys_are_held_hashed_and_looked_up_by_token():
    ring = KeyRing.from_entries(
        [{"key": "sk-1", "tenant": "acme"}, {"sha256": hashlib.sha256(b"sk-2").hexdigest().upper(), "tenant": "b"}]
    )
    assert set(ring.keys) == {key_hash("sk-1"), key_hash("sk-2")}  # no plain key kept
    assert ring.lookup("sk-1").tenant == "acme" and ring.lookup("sk-2").tenant == "b"
    assert ring.lookup("sk-3") is None and ring.lookup("") is None
    assert ring.lookup("sk-1").library_tenant("bob") == "acme/bob" and OPEN.library_tenant(None) == "default"


@pytest.mark.parametrize(
    "entry",
    [{"tenant": "a"}, {"key": "k"}, {"key": "k", "tenant": "a/b"}, {"key": "k", "tenant": "a", "max_concurrent": 0}],
)
def test_bad_key_entries_are_refused(entry):
    with pytest.raises(ValueError):
        KeyRing.from_entries([entry])


def test_single_key_is_a_one_tenant_admin_shorthand(tmp_path):
    assert KeyRing.load(None, None) is None  # open server
    ring = KeyRing.load(None, "secret")
    assert ring.lookup("secret").tenant == "default" and ring.lookup("secret").admin


def test_limits_per_key_with_the_wait_until_a_retry_passes():
    ring = KeyRing.from_entries(
        [
            {"key": "r", "tenant": "r", "requests_per_minute": 2},
            {"key": "t", "tenant": "t", "tokens_per_minute": 100},
            {"key": "c", "tenant": "c", "max_concurrent": 1},
        ]
    )
    lim = KeyLimiter()
    r, t, c = ring.lookup("r"), ring.lookup("t"), ring.lookup("c")
    assert lim.admit(r, now=0.0) is None and lim.admit(r, now=10.0) is None
    assert lim.admit(r, now=20.0) == ("requests_per_minute", 40.0)
    assert lim.admit(r, now=60.5) is None  # the first request left the window
    assert lim.admit(t, now=0.0) is None
    lim.done(t, 150, now=1.0)
    assert lim.admit(t, now=2.0) == ("tokens_per_minute", 59.0) and lim.admit(t, now=61.5) is None
    assert lim.admit(c) is None and lim.admit(c)[0] == "max_concurrent"
    lim.done(c)
    assert lim.admit(c) is None
