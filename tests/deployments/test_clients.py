"""Agent frameworks against the real Ray Serve app, unchanged: the OpenAI Agents SDK (through its
Chat Completions model) and LangChain's ``ChatOpenAI`` with ``bind_tools`` each run a tool loop --
a call, the tool's result, the next turn -- on the embedded Qwen2.5-Coder-0.5B."""

from __future__ import annotations

import asyncio

import pytest
from serve_fixtures import WEATHER_MESSAGES

pytestmark = [pytest.mark.serve, pytest.mark.timeout(600)]

SYSTEM = WEATHER_MESSAGES[0]["content"]
QUESTION = WEATHER_MESSAGES[1]["content"]


def test_openai_agents_sdk_runs_a_tool_loop(real_app):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # traces would go to api.openai.com
    seen: list[tuple[str, str]] = []

    @agents.function_tool
    def get_current_weather(city: str, unit: str = "celsius") -> str:
        """Get the current weather in a city.

        Args:
            city: The city name.
            unit: celsius or fahrenheit.
        """
        seen.append((city, unit))
        return f"Sunny, 21 degrees {unit} in {city}."

    client = AsyncOpenAI(base_url=real_app, api_key="unused", max_retries=0, timeout=300)
    agent = agents.Agent(
        name="weather",
        instructions=SYSTEM,
        tools=[get_current_weather],
        model=agents.OpenAIChatCompletionsModel(model="real", openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=96),
    )
    result = asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=3))
    assert seen and seen[0][0] == "Paris"  # the SDK parsed the server's call and ran the tool
    kinds = [type(item).__name__ for item in result.new_items]
    assert "ToolCallItem" in kinds and "ToolCallOutputItem" in kinds
    assert kinds.index("ToolCallOutputItem") < len(kinds) - 1  # a turn after the tool's result
    assert isinstance(result.final_output, str)


def test_langchain_bind_tools_runs_a_tool_loop(real_app):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_current_weather(city: str, unit: str = "celsius") -> str:
        """Get the current weather in a city (unit: celsius or fahrenheit)."""
        return f"Sunny, 21 degrees {unit} in {city}."

    llm = ChatOpenAI(base_url=real_app, api_key="unused", model="real", temperature=0, max_tokens=96, max_retries=0)
    bound = llm.bind_tools([get_current_weather])
    messages = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    first = bound.invoke(messages)
    assert first.tool_calls and first.tool_calls[0]["name"] == "get_current_weather"
    assert first.tool_calls[0]["args"]["city"] == "Paris" and first.tool_calls[0]["id"].startswith("call_")
    messages.append(first)
    for call in first.tool_calls:
        messages.append(ToolMessage(get_current_weather.invoke(call["args"]), tool_call_id=call["id"]))
    second = bound.invoke(messages)  # the server renders the call and its result into the prompt
    assert second.content or second.tool_calls
    assert second.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"]
    # streamed the same way: LangChain merges the argument fragments into the same call
    merged = None
    for piece in bound.stream(messages[:2]):
        merged = piece if merged is None else merged + piece
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in first.tool_calls]
