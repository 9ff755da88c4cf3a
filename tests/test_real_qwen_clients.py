"""The agent clients on the real Qwen2.5-Coder-1.5B-Instruct (marker qwen and slow: `make test-qwen`,
or `make test-all` with the file in place). Qwen's ``<tool_call>`` and ``</tool_call>`` are single
special tokens of its vocabulary; these are the clients that failed on every forced call before the
call grammar named them as tokens: instructor's TOOLS mode (forced named tool), smolagents'
ToolCallingAgent (every step forced with "required") and openai-agents with tool_choice "required".
Each request goes through a real `kvcache serve` on the file."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Literal

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "clients"))
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

from test_real_qwen import real  # noqa: E402

CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Seoul"]


@pytest.fixture(scope="module")
def qwen_server():
    from test_server import Server

    from kvcache.models.fetch_qwen import qwen_path

    s = Server(str(qwen_path()), "--max-running", "4")
    yield s
    s.close()


@real
def test_instructor_tools_mode_parses_every_answer(qwen_server):
    import instructor
    from client_shapes import City

    client = instructor.from_openai(qwen_server.client(), mode=instructor.Mode.TOOLS)
    model = qwen_server.client().models.list().data[0].id
    ok = []
    for city in CITIES:
        got = client.chat.completions.create(model=model, response_model=City, max_retries=0, temperature=0,
                                             max_tokens=80, messages=[{"role": "user", "content": f"Tell me about {city}."}])
        ok.append(isinstance(got, City) and got.name.lower().startswith(city.lower()[:3]))
    print(f"instructor TOOLS on Qwen2.5-Coder-1.5B: {sum(ok)}/{len(ok)} parsed and named the city")
    assert all(ok), ok


@real
def test_smolagents_tool_calling_agent_finishes(qwen_server):
    import smolagents

    runs: list[str] = []

    @smolagents.tool
    def get_weather(city: str) -> str:
        """The current weather in a city.

        Args:
            city: the city's name
        """
        runs.append(city)
        return "4 degrees celsius and rain"

    model = smolagents.OpenAIServerModel(model_id=qwen_server.client().models.list().data[0].id,
                                         api_base=qwen_server.base + "/v1", api_key="none", max_tokens=96,
                                         temperature=0)
    agent = smolagents.ToolCallingAgent(tools=[get_weather], model=model, max_steps=4, verbosity_level=0)
    answer = agent.run("What is the weather in Oslo?")
    steps = [s for s in agent.memory.steps if type(s).__name__ == "ActionStep"]
    finals = [c for s in steps for c in (s.tool_calls or []) if c.name == "final_answer"]
    print(f"smolagents on Qwen2.5-Coder-1.5B: {len(steps)} steps, tool runs {runs}, answer {answer!r}")
    assert runs and [r.lower() for r in runs][:1] == ["oslo"]
    assert finals, "the agent did not finish by its final_answer tool within 4 steps"
    assert "4" in str(answer) or "rain" in str(answer).lower()


@real
def test_openai_agents_required_runs_its_tool_once_and_answers(qwen_server):
    import agents
    import openai

    agents.set_tracing_disabled(True)
    runs: list = []

    @agents.function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather in a city."""
        runs.append((city, unit))
        return json.dumps({"temperature": 4, "sky": "rain"})

    client = openai.AsyncOpenAI(base_url=qwen_server.base + "/v1", api_key="none", max_retries=0, timeout=300)
    model = agents.OpenAIChatCompletionsModel(model=qwen_server.client().models.list().data[0].id, openai_client=client)
    agent = agents.Agent(name="helper", instructions="You are a helpful assistant.", model=model, tools=[get_weather],
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=96, temperature=0))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Oslo, in celsius?", max_turns=4))
    print(f"openai-agents on Qwen2.5-Coder-1.5B: tool runs {runs}, answer {result.final_output!r}")
    assert len(runs) == 1 and runs[0][0].lower() == "oslo"
    assert isinstance(result.final_output, str) and result.final_output.strip()
