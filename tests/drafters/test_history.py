"""Per-tenant histories: bounded in tokens and tenants, repeats skipped."""

from __future__ import annotations


def test_tenant_histories_bound_tokens_and_tenants_and_skip_repeats():
    from toolspec_core.drafters.history import TenantHistories

    h = TenantHistories(depth=8, max_tokens=40, max_tenants=2)
    assert len(h.trie("a")) == 1  # empty for an unknown tenant
    assert h.add("a", [1, 2, 3], lead=[0]) and not h.add("a", [1, 2, 3])  # the same output once
    assert h.trie("a").walk([0, 1, 2, 3]) > 0 and h.trie("b").walk([1, 2]) < 0  # tenants apart
    for i in range(10):
        h.add("a", [10 + i] * 5)
    assert 20 <= h.tokens("a") <= 40  # shrank to the newest half, not to nothing
    assert h.trie("a").walk([19] * 5) > 0 and h.trie("a").walk([10] * 5) < 0  # oldest gone
    assert h.add("a", [10] * 5)  # a dropped output may come back
    h.add("b", [7, 7])
    h.trie("a")  # a used more recently than b
    h.add("c", [8, 8])
    assert h.tokens("b") == 0 and h.tokens("a") > 0 and h.tokens("c") == 2  # least recently used tenant dropped
