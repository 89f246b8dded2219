"""``benchmarks.studies.loadtest_local``'s app specs: each option lands in the config it names."""

import pytest

from benchmarks.studies.loadtest_local import app_config
from deployments.config import ServeAppConfig


@pytest.mark.parametrize(
    "spec,retrieval",
    [
        ("ts=toolspec", {}),
        ("ts=toolspec+lexical", {"key": "lexical"}),
        ("ts=toolspec+hidden", {"key": "hidden"}),
    ],
)
def test_a_library_method_gets_its_own_store_and_the_key_asked_for(tmp_path, spec, retrieval):
    name, extra = app_config(spec, str(tmp_path))
    assert name == "ts"
    assert extra["retrieval"]["store"] == {"backend": "edge", "path": str(tmp_path / "ts")}
    assert {k: v for k, v in extra["retrieval"].items() if k != "store"} == retrieval
    cfg = ServeAppConfig(**extra)  # what the app is built from accepts it
    assert cfg.retrieval.enabled and cfg.retrieval.key == retrieval.get("key", "qwen")


def test_noretrieval_threads_and_chunk_options(tmp_path):
    _, extra = app_config("x=toolspec+noretrieval+threads1+chunk128", str(tmp_path))
    assert extra["retrieval"] == {"enabled": False}
    assert extra["threads"] == 1 and extra["prefill_chunk_tokens"] == 128
    _, ar = app_config("ar=ar", str(tmp_path))
    assert ar["retrieval"] == {"enabled": False}  # plain greedy reads no library


@pytest.mark.parametrize("spec", ["ts=toolspec+encoderless", "=toolspec", "ts=toolspec+chunk0"])
def test_an_unknown_option_is_a_usage_error(tmp_path, spec):
    with pytest.raises(SystemExit, match="cannot read"):
        app_config(spec, str(tmp_path))
