"""examples/agent/agent.py with the model replaced by a scripted one that sends a failing cell
first and the fix second: the loop must hand the traceback back, run the fix, and end with the
model's answer. sandcell is real (the stack); what the loop sends each API is validated against
the official packages' own types."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Dict, List

from anthropic.types import Message, MessageParam
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam
from pydantic import TypeAdapter

from sandcell import Client, Sandbox

spec = importlib.util.spec_from_file_location("agent", Path(__file__).resolve().parents[3] / "examples" / "agent" / "agent.py")
assert spec is not None and spec.loader is not None
agent = importlib.util.module_from_spec(spec)
spec.loader.exec_module(agent)

FAILING = "total = sum(range(1, 11))\ntotal / zero"
FIX = "total / 2"


class ScriptedAnthropic:
    """Answers like Anthropic's Messages API: a failing cell, then the fix, then the answer."""

    def __init__(self) -> None:
        self.requests: List[Dict[str, Any]] = []
        self.messages = self

    def create(self, **request: Any) -> Message:
        TypeAdapter(List[MessageParam]).validate_python(request["messages"])
        self.requests.append(json.loads(json.dumps(request["messages"])))
        turn = len(self.requests)
        if turn == 1:
            content: List[Dict[str, Any]] = [{"type": "tool_use", "id": "toolu_1", "name": "run_code", "input": {"code": FAILING}}]
        elif turn == 2:
            content = [{"type": "text", "text": "Let me fix that."}, {"type": "tool_use", "id": "toolu_2", "name": "run_code", "input": {"code": FIX}}]
        else:
            content = [{"type": "text", "text": "The answer is 27.5."}]
        stop = "tool_use" if turn < 3 else "end_turn"
        return Message.model_validate({"id": "msg_%d" % turn, "type": "message", "role": "assistant", "model": "scripted", "content": content,
                                       "stop_reason": stop, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})


class ScriptedOpenAI:
    """The same script, as OpenAI's Chat Completions."""

    def __init__(self) -> None:
        self.requests: List[List[Dict[str, Any]]] = []
        self.chat = self
        self.completions = self

    def create(self, **request: Any) -> ChatCompletion:
        TypeAdapter(List[ChatCompletionMessageParam]).validate_python(request["messages"])
        self.requests.append(json.loads(json.dumps(request["messages"])))
        turn = len(self.requests)
        message: Dict[str, Any] = {"role": "assistant", "content": None}
        if turn < 3:
            code = FAILING if turn == 1 else FIX
            message["tool_calls"] = [{"id": "call_%d" % turn, "type": "function", "function": {"name": "run_code", "arguments": json.dumps({"code": code})}}]
        else:
            message["content"] = "The answer is 27.5."
        return ChatCompletion.model_validate({"id": "c%d" % turn, "object": "chat.completion", "created": 0, "model": "scripted",
                                              "choices": [{"index": 0, "finish_reason": "tool_calls" if turn < 3 else "stop", "message": message}]})


def test_the_anthropic_loop_sends_the_traceback_back_and_the_fix_runs(client: Client) -> None:
    model = ScriptedAnthropic()
    with Sandbox.create(keep_alive=60, client=client) as sb:
        answer = agent.run_anthropic(model, "Halve the sum of 1..10.", sb, log=lambda _: None)
    assert answer == "The answer is 27.5."
    first_result = model.requests[1][-1]["content"][0]
    assert first_result["type"] == "tool_result" and first_result["is_error"] is True
    assert "NameError" in first_result["content"][0]["text"] and "zero" in first_result["content"][0]["text"]
    fixed = model.requests[2][-1]["content"][0]
    assert fixed["is_error"] is False and "value:\n27.5" in fixed["content"][0]["text"]


def test_the_openai_loop_sends_the_traceback_back_and_the_fix_runs(client: Client) -> None:
    model = ScriptedOpenAI()
    with Sandbox.create(keep_alive=60, client=client) as sb:
        answer = agent.run_openai(model, "Halve the sum of 1..10.", sb, log=lambda _: None)
    assert answer == "The answer is 27.5."
    first_result = model.requests[1][-1]
    assert first_result["role"] == "tool" and first_result["tool_call_id"] == "call_1"
    assert first_result["content"].startswith("status: failed") and "NameError" in first_result["content"]
    assert "value:\n27.5" in model.requests[2][-1]["content"]
