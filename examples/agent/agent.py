"""The agent loop sandcell exists for: the model writes code, sandcell runs it, the output or
the traceback goes back, the model fixes its code and tries again — for Anthropic and OpenAI.

    pip install "./clients/python" anthropic openai
    export SANDCELL_AMQP_URL=... SANDCELL_DATABASE_URL=...     # from sandcell-admin tenant create
    ANTHROPIC_API_KEY=... python examples/agent/agent.py anthropic "What is the 20th Fibonacci number? Compute it."
    OPENAI_API_KEY=...    python examples/agent/agent.py openai    "Plot 5% yearly growth of 100 over 10 years."

`run_anthropic` / `run_openai` take any client object with the official SDK's interface (the
tests pass a scripted one), so the loop is the same code whoever answers.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Dict, List, Optional

from sandcell import Sandbox, tools

SYSTEM = "You solve tasks by writing Python and running it with the run_code tool. Read the output; if the code failed, fix it and run it again."


def _run_tool(sb: Sandbox, args: Dict[str, Any]) -> Any:
    # One sandbox for the whole conversation: the model's session_id, if any, is this one.
    return sb.run_code(args["code"], args.get("language") or "python", timeout=60)


def run_anthropic(client: Any, task: str, sb: Sandbox, model: str = "claude-sonnet-4-5", max_turns: int = 8,
                  log: Callable[[str], None] = print) -> str:
    """Loop until the model answers without a tool call; its final text."""
    messages: List[Dict[str, Any]] = [{"role": "user", "content": task}]
    for _ in range(max_turns):
        reply = client.messages.create(model=model, max_tokens=2048, system=SYSTEM, tools=[tools.anthropic_tool()], messages=messages)
        messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]})
        calls = [b for b in reply.content if b.type == "tool_use"]
        if not calls:
            return "".join(b.text for b in reply.content if b.type == "text")
        results = []
        for call in calls:
            log("run_code:\n%s" % call.input["code"])
            execution = _run_tool(sb, call.input)
            log("-> %s" % execution.status)
            results.append(tools.anthropic_result(execution, call.id, sb.session_id))
        messages.append({"role": "user", "content": results})
    raise RuntimeError("no answer within %d turns" % max_turns)


def run_openai(client: Any, task: str, sb: Sandbox, model: str = "gpt-4.1", max_turns: int = 8,
               log: Callable[[str], None] = print) -> str:
    """The same loop on OpenAI Chat Completions."""
    messages: List[Dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, tools=[tools.openai_chat_tool()], messages=messages)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return str(message.content or "")
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            log("run_code:\n%s" % args["code"])
            execution = _run_tool(sb, args)
            log("-> %s" % execution.status)
            messages.append(tools.openai_chat_result(execution, call.id, sb.session_id))
    raise RuntimeError("no answer within %d turns" % max_turns)


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("anthropic", "openai"):
        sys.exit("usage: agent.py anthropic|openai TASK")
    provider, task = argv
    with Sandbox.create(keep_alive=300) as sb:
        if provider == "anthropic":
            import anthropic

            answer = run_anthropic(anthropic.Anthropic(), task, sb)
        else:
            import openai

            answer = run_openai(openai.OpenAI(), task, sb)
    print(answer)


if __name__ == "__main__":
    main()
