"""The tool definitions and tool results, validated against each API's own types (the
official `openai` and `anthropic` packages' TypedDicts, with pydantic). Pure logic: no stack."""

from __future__ import annotations

import base64
import typing
from typing import Any, Dict

import pytest
from anthropic.types import ToolParam, ToolResultBlockParam
from openai.types.chat import ChatCompletionToolMessageParam, ChatCompletionToolParam
from openai.types.responses import FunctionToolParam
from openai.types.responses.response_input_param import FunctionCallOutput
from pydantic import TypeAdapter

from sandcell import Execution, tools

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()


def valid(shape: Any, obj: Dict[str, Any]) -> None:
    """`obj` validates as the TypedDict `shape` and has no key it does not declare."""
    TypeAdapter(shape).validate_python(obj)
    declared = set(typing.get_type_hints(shape))
    assert set(obj) <= declared, set(obj) - declared


def record(**fields: Any) -> Dict[str, Any]:
    base: Dict[str, Any] = {"job_id": "j1", "tenant": "acme", "status": "succeeded", "stdout": "", "stderr": "", "outputs": [], "artifacts": [], "error": None}
    base.update(fields)
    return base


def with_chart() -> Execution:
    ex = Execution.from_record(record(stdout="growth computed\n", outputs=[
        {"type": "display_data", "data": {"text/plain": "<Figure size 640x480 with 1 Axes>"}, "artifacts": {"image/png": "_display/1.png"}},
        {"type": "execute_result", "data": {"text/plain": "144"}, "artifacts": {}},
    ]))
    ex.results[0].data["image/png"] = PNG  # as load_images fills it in
    ex.results[0].png = PNG
    return ex


def failed() -> Execution:
    tb = ["Traceback (most recent call last):", '  Cell In[1], line 1\n    1 / 0', "ZeroDivisionError: division by zero"]
    return Execution.from_record(record(status="failed", error={"ename": "ZeroDivisionError", "evalue": "division by zero", "traceback": tb}))


def test_the_tool_definitions_are_valid_for_each_api() -> None:
    valid(ChatCompletionToolParam, tools.openai_chat_tool())
    valid(FunctionToolParam, tools.openai_responses_tool())
    valid(ToolParam, tools.anthropic_tool())


def test_the_responses_tool_is_strict_every_property_required_and_nothing_else_allowed() -> None:
    tool = tools.openai_responses_tool()
    assert tool["strict"] is True
    params = tool["parameters"]
    assert params["additionalProperties"] is False
    assert sorted(params["required"]) == sorted(params["properties"])
    for name, prop in params["properties"].items():
        if name != "code":
            assert "null" in prop["type"], name  # optional means nullable in strict mode
        assert "default" not in prop


def test_a_chart_becomes_an_image_block_for_anthropic_and_an_input_image_for_responses() -> None:
    ex = with_chart()
    block = tools.anthropic_result(ex, "toolu_1", session_id="ses_1")
    valid(ToolResultBlockParam, block)
    assert block["is_error"] is False
    assert [c["type"] for c in block["content"]] == ["text", "image"]
    assert block["content"][1]["source"] == {"type": "base64", "media_type": "image/png", "data": PNG}
    text = block["content"][0]["text"]
    assert "growth computed" in text and "value:\n144" in text and "session_id: ses_1" in text and "1 image(s)" in text

    item = tools.openai_responses_result(ex, "call_1")
    valid(FunctionCallOutput, item)
    assert item["output"][1]["image_url"] == "data:image/png;base64," + PNG

    message = tools.openai_chat_result(ex, "call_1")
    valid(ChatCompletionToolMessageParam, message)
    assert "1 image(s)" in message["content"]


def test_a_failure_is_flagged_and_carries_the_traceback() -> None:
    block = tools.anthropic_result(failed(), "toolu_2")
    valid(ToolResultBlockParam, block)
    assert block["is_error"] is True
    text = block["content"][0]["text"]
    assert text.startswith("status: failed")
    assert "ZeroDivisionError: division by zero" in text and "1 / 0" in text


def test_long_output_is_cut_to_the_budget_with_a_marker_keeping_its_end() -> None:
    ex = Execution.from_record(record(stdout="".join("line %d\n" % i for i in range(5000)), status="failed",
                                      error={"ename": "ValueError", "evalue": "bad row", "traceback": ["ValueError: bad row"]}))
    text = tools.render_text(ex, budget=2000)
    assert len(text) <= 2000
    assert "characters cut" in text
    assert text.startswith("status: failed")
    assert text.rstrip().endswith("ValueError: bad row")


@pytest.mark.parametrize("budget", [50, 500])
def test_a_small_budget_is_never_exceeded(budget: int) -> None:
    assert len(tools.render_text(failed(), budget=budget)) <= budget
