"""A two-tool agent loop against `strata-jax serve`, run by the OpenAI Agents SDK (its chat-completions
model class), as an agent framework user would.  Run by scripts/agent_loop.sh in the SDK's own venv.

The agent has two function tools (weather, local time).  The first turn must call a tool
(`tool_choice="required"`: a small model is not trained for tools; the SDK then resets the choice to
`auto`, so the loop ends when the model answers in text), the tool results go back as `tool` messages,
and the run goes to the end.  Printed per model turn: the tool calls, the prompt tokens and how many
of them the server took from its cache; the script fails unless every turn after the first reports
cached prompt tokens > 0 and at least one tool ran.
"""

from __future__ import annotations

import asyncio
import json
import sys

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

CALLS: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city right now."""
    CALLS.append(f"get_weather({city!r})")
    return json.dumps({"city": city, "sky": "clear", "celsius": 21})


@function_tool
def get_time(timezone: str) -> str:
    """The local time in a timezone."""
    CALLS.append(f"get_time({timezone!r})")
    return json.dumps({"timezone": timezone, "time": "14:05"})


async def main(url: str, model_name: str) -> int:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=url, api_key="unused")
    agent = Agent(
        name="assistant",
        instructions="You answer questions about cities. Use the tools to look things up.",
        model=OpenAIChatCompletionsModel(model=model_name, openai_client=client),
        tools=[get_weather, get_time],
        model_settings=ModelSettings(tool_choice="required", max_tokens=96, temperature=0.2),
    )
    result = await Runner.run(
        agent, "What is the weather in Lisbon, and what time is it there?", max_turns=6, run_config=RunConfig()
    )
    ok = bool(CALLS)
    for i, response in enumerate(result.raw_responses):
        usage = response.usage
        cached = usage.input_tokens_details.cached_tokens if usage.input_tokens_details else 0
        kinds = [type(item).__name__ for item in response.output]
        print(f"turn {i + 1}: {kinds} prompt tokens {usage.input_tokens}, cached {cached}")
        if i > 0 and not cached:
            ok = False
    print("tools called:", ", ".join(CALLS) or "none")
    print("final answer:", result.final_output)
    print("OK" if ok else "FAILED: a turn after the first took nothing from the cache, or no tool ran")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2])))
