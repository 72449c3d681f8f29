"""A ``run_code`` tool for LLM APIs, and the tool result each API accepts for an `Execution`.

    from sandcell import Sandbox, tools

    tool = tools.anthropic_tool()                      # or openai_chat_tool(), openai_responses_tool()
    ...                                                # the model calls it with {"code": ..., "session_id": ...}
    execution = sandbox.run_code(args["code"], args.get("language") or "python")
    block = tools.anthropic_result(execution, tool_use_id)   # text + charts as image blocks

The text a model sees is bounded (``budget`` characters, default 8,000) with an explicit marker
where something was cut; a failed run is flagged (``is_error`` for Anthropic; the text starts with
the status) and carries the traceback, so the model can fix its code.
"""

from __future__ import annotations

import base64
from typing import Any, Dict, List, Optional

from ._models import Execution

NAME = "run_code"
DESCRIPTION = (
    "Run code in a sandboxed Jupyter-like kernel (Python with numpy, pandas, matplotlib, scipy, "
    "reportlab; or bash) and get back what it printed, the value of its last expression, charts "
    "as images, and the full traceback if it failed. Variables, imports and files persist between "
    "calls that pass the same session_id (from an earlier result); without one the code runs in a "
    "fresh, throwaway sandbox. There is no network."
)
DEFAULT_BUDGET = 8000
_IMAGES = ("image/png", "image/jpeg")


def parameters(strict: bool = False) -> Dict[str, Any]:
    """The tool's JSON Schema. ``strict`` (OpenAI's strict mode): every property required,
    optional ones nullable."""
    optional = ["string", "null"] if strict else "string"
    schema: Dict[str, Any] = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "The code to run."},
            "language": {
                "type": optional,
                "enum": ["python", "bash", None] if strict else ["python", "bash"],
                "description": "python (default) or bash.",
            },
            "session_id": {
                "type": optional,
                "description": "Run in this session (keeps its variables and files); omit or null for a new one.",
            },
        },
        "required": ["code", "language", "session_id"] if strict else ["code"],
        "additionalProperties": False,
    }
    return schema


def openai_chat_tool() -> Dict[str, Any]:
    """For OpenAI Chat Completions (``tools=[...]``)."""
    return {"type": "function", "function": {"name": NAME, "description": DESCRIPTION, "parameters": parameters()}}


def openai_responses_tool() -> Dict[str, Any]:
    """For the OpenAI Responses API, in strict mode."""
    return {"type": "function", "name": NAME, "description": DESCRIPTION, "parameters": parameters(strict=True), "strict": True}


def anthropic_tool() -> Dict[str, Any]:
    """For Anthropic tool use (``tools=[...]``)."""
    return {"name": NAME, "description": DESCRIPTION, "input_schema": parameters()}


def _cut(text: str, budget: int) -> str:
    if len(text) <= budget:
        return text
    marker = "\n[... %d characters cut; the output was longer than this tool's %d-character budget ...]\n" % (len(text) - budget, budget)
    if len(marker) * 2 > budget:  # a tiny budget: the shortest marker that fits, or none
        marker = "\n[cut]\n" if budget >= 14 else ""
    head = budget - len(marker)
    # Keep the start and the end: a traceback's last lines are the ones that matter.
    return text[: head // 2] + marker + text[len(text) - (head - head // 2):]


def render_text(execution: Execution, session_id: Optional[str] = None, budget: int = DEFAULT_BUDGET) -> str:
    """The run as text for a model: status, stdout, stderr, the last value, the error with its
    traceback; at most ``budget`` characters."""
    parts: List[str] = []
    status = execution.status
    parts.append("status: %s" % status + ("" if status == "succeeded" else " (the code did not complete; fix it and try again)"))
    if session_id:
        parts.append("session_id: %s" % session_id)
    stdout, stderr = "".join(execution.logs.stdout), "".join(execution.logs.stderr)
    if stdout:
        parts.append("stdout:\n" + stdout.rstrip("\n"))
    if stderr:
        parts.append("stderr:\n" + stderr.rstrip("\n"))
    for r in execution.results:
        if r.text is not None and not any(m in r.data for m in _IMAGES):
            parts.append(("value:\n" if r.is_main_result else "display:\n") + r.text)
    images = sum(1 for r in execution.results for m in _IMAGES if r.data.get(m))
    if images:
        parts.append("%d image(s) produced" % images)
    files = [a.path for a in execution.artifacts if a.kind != "display"]
    if files:
        parts.append("files: " + ", ".join(files))
    if execution.error is not None:
        e = execution.error
        parts.append("error: %s: %s\n%s" % (e.name, e.value, e.traceback))
    return _cut("\n\n".join(p for p in parts if p), budget)


def _images(execution: Execution) -> List[Dict[str, str]]:
    out = []
    for r in execution.results:
        for mime in _IMAGES:
            data = r.data.get(mime)
            if data:
                base64.b64decode(data, validate=True)  # never hand an API a broken image
                out.append({"media_type": mime, "data": data})
    return out


def openai_chat_result(execution: Execution, tool_call_id: str, session_id: Optional[str] = None, budget: int = DEFAULT_BUDGET) -> Dict[str, Any]:
    """The ``tool`` message answering a Chat Completions tool call (text only: that API takes
    no images in tool messages, so charts are counted in the text)."""
    return {"role": "tool", "tool_call_id": tool_call_id, "content": render_text(execution, session_id, budget)}


def openai_responses_result(execution: Execution, call_id: str, session_id: Optional[str] = None, budget: int = DEFAULT_BUDGET) -> Dict[str, Any]:
    """The ``function_call_output`` input item answering a Responses API call: the text, and
    each chart as an ``input_image``."""
    output: List[Dict[str, Any]] = [{"type": "input_text", "text": render_text(execution, session_id, budget)}]
    for img in _images(execution):
        output.append({"type": "input_image", "image_url": "data:%s;base64,%s" % (img["media_type"], img["data"]), "detail": "auto"})
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def anthropic_result(execution: Execution, tool_use_id: str, session_id: Optional[str] = None, budget: int = DEFAULT_BUDGET) -> Dict[str, Any]:
    """The ``tool_result`` block answering an Anthropic ``tool_use``: the text, each chart as an
    image block, and ``is_error`` when the code did not succeed."""
    content: List[Dict[str, Any]] = [{"type": "text", "text": render_text(execution, session_id, budget)}]
    for img in _images(execution):
        content.append({"type": "image", "source": {"type": "base64", "media_type": img["media_type"], "data": img["data"]}})
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content, "is_error": execution.status != "succeeded"}
