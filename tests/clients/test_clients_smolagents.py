"""smolagents' ToolCallingAgent (Hugging Face's agent library) on `kvcache serve` through its
``OpenAIServerModel``: it sends every step with tool_choice "required" and ends by calling its own
``final_answer`` tool, so a server whose forced calls fail cannot run it at all. The agent runs its
tool (or its final answer) at every step, each forced call parsed; past its step budget it asks for
an answer on its own. Every request is one the server owes an answer."""

from __future__ import annotations

import pytest
from client_server import need
from client_wire import KEY


@pytest.fixture(scope="module")
def smolagents():
    return need("smolagents")


def _agent(smolagents, server, runs: list, openai_client):
    @smolagents.tool
    def get_weather(city: str) -> str:
        """The current weather in a city.

        Args:
            city: the city's name
        """
        runs.append(city)
        return "4 degrees celsius and rain"

    model = smolagents.OpenAIServerModel(model_id=server.model, api_base=server.url, api_key=KEY,
                                         max_tokens=64, temperature=0)
    model.client = openai_client  # the suite's recording transport
    return smolagents.ToolCallingAgent(tools=[get_weather], model=model, max_steps=3, verbosity_level=0)


def test_tool_calling_agent_runs_its_tool_and_finishes(smolagents, server, openai_client, wire):
    runs: list = []
    agent = _agent(smolagents, server, runs, openai_client)
    with wire.explains():
        answer = agent.run("What is the weather in Oslo? Call get_weather, then give the final answer.")
    chats = wire.chats()
    assert chats and all(c.request.get("tool_choice") == "required" for c in chats[:1])
    # each step's forced call was parsed (a step past max_steps is the agent's own fallback answer)
    steps = [s for s in agent.memory.steps if type(s).__name__ == "ActionStep"
             and type(getattr(s, "error", None)).__name__ != "AgentMaxStepsError"]
    assert steps and all(s.tool_calls for s in steps), [getattr(s, "error", None) for s in steps]
    assert not any(getattr(s, "error", None) and "pars" in str(s.error).lower() for s in steps)
    assert answer is not None
    assert runs or any(c.name == "final_answer" for s in steps for c in s.tool_calls)
    wire.assert_owed(min_chats=len(chats))
