"""Fixtures of the serving tests: a tiny random Qwen2 directory, ONE Ray cluster, the apps.

The fixtures are registered once, in ``tests/conftest.py``; test modules import only
the helpers and constants. The cluster fixture is idempotent (it reuses a running Ray).
"""

from __future__ import annotations

import os
import socket
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from deployments.cli import DEMO_TOOLS  # noqa: E402  (the demo's weather tool, shared)

TOOLS = [
    DEMO_TOOLS[0],
    {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send an email to a recipient.",
            "parameters": {
                "type": "object",
                "properties": {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
                "required": ["to", "subject"],
            },
        },
    },
]

WEATHER_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Use the tools when they help."},
    {"role": "user", "content": "What's the weather like in Paris right now, in celsius?"},
]


def make_tiny_model(out_dir, seed: int = 0, context: int = 2048) -> str:
    """A random 2-layer Qwen2 with the embedded model's tokenizer (real chat template)."""
    from transformers import AutoTokenizer

    from deployments.scripted import tiny_qwen2
    from toolspec_core.model.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    tiny_qwen2(tok, context=context, seed=seed).save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def chat_request(messages: list[dict], **fields):
    """The validated :class:`~deployments.protocol.ChatRequest` of a body with these fields, as the
    HTTP route hands it to the engine host."""
    from deployments.protocol import ChatRequest

    return ChatRequest.model_validate({"messages": messages, **fields})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RAY = {"started": False}  # whether this session started the local Ray and has not ended it yet


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the session (2 CPUs; every deployment asks for 0), ended after the last
    test that uses it (:func:`end_ray`) or at the session's end."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        _RAY["started"] = True
    yield ray
    end_ray()


def end_ray() -> None:
    """Shut down Serve (every app, the embedded model's replica included) and the Ray this session
    started: the tests after the last one using it would otherwise share the two cores with their
    idle control loops."""
    if not _RAY["started"]:
        return
    import ray
    from ray import serve

    _RAY["started"] = False
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_port(ray_cluster) -> int:
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def deploy(name: str, args: dict, port: int) -> str:
    """Deploy ``build_app(args)`` under ``/name``; returns the base URL (…/name/v1)."""
    from ray import serve

    from deployments.app import build_app

    base = {"replica_num_cpus": 0, "cost_model": "reference", "max_ongoing_requests": 8, "served_model_name": name}
    serve.run(build_app({**base, **args}), name=name, route_prefix=f"/{name}", blocking=False)
    return f"http://127.0.0.1:{port}/{name}/v1"


@pytest.fixture(scope="session")
def tiny_app(serve_port, tiny_model_dir) -> str:
    """Tiny random model, method toolspec, in-memory library (fast: most tests use it)."""
    return deploy(
        "tiny",
        {
            "model": tiny_model_dir,
            "method": "toolspec",
            "max_tokens_default": 24,
            "retrieval": {"store": {"backend": "memory"}, "timeout_s": 1.0},
        },
        serve_port,
    )


@pytest.fixture(scope="session")
def real_app(serve_port) -> str:
    """The embedded Qwen2.5-Coder-0.5B (real tool calls), method toolspec."""
    return deploy(
        "real",
        {
            "model": "embedded",
            "method": "toolspec",
            "max_tokens_default": 96,
            "retrieval": {"store": {"backend": "memory"}, "timeout_s": 1.0},
        },
        serve_port,
    )


def client(base_url: str, **kw):
    import openai

    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=kw.pop("timeout", 300), **kw)


def wait_until(fn, timeout: float = 60.0, every: float = 0.5):
    end = time.time() + timeout
    while time.time() < end:
        out = fn()
        if out:
            return out
        time.sleep(every)
    raise TimeoutError("condition not met")
