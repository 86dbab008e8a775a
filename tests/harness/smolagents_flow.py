"""smolagents' ``CodeAgent`` with ``executor_type="e2b"`` (its ``E2BExecutor``, over the
``e2b-code-interpreter`` SDK) against an aenv node, driven by a scripted model (no LLM):
run in the harness's own venv (tests/harness/smolagents.lock) with only the E2B_*
variables set. Prints one JSON line: what the agent answered and saw.

The script's steps: a first cell that defines state and prints; a second that uses the
state across cells, imports pandas and fails on purpose (the error goes back to the model
as an observation); a third that calls ``final_answer`` (smolagents sends that tool's
code into the sandbox and reads the answer back from an exception it raises there)."""
from __future__ import annotations

import json
import sys

from smolagents import CodeAgent
from smolagents.models import ChatMessage, MessageRole, Model
from smolagents.monitoring import TokenUsage

STEPS = [
    "Thought: set up state.\n<code>\nrows = [3, 4, 5]\nprint('rows', sum(rows))\n</code>",
    "Thought: use it, then fail.\n<code>\nimport pandas as pd\ntotal = int(pd.Series(rows).sum()) * 2\n"
    "print('total', total)\nraise ValueError('on purpose')\n</code>",
    "Thought: answer.\n<code>\nfinal_answer({'total': total, 'python': __import__('sys').version_info[0]})\n</code>",
]


class ScriptedModel(Model):
    """Answers the agent's steps in order, recording what each prompt showed it."""

    def __init__(self) -> None:
        super().__init__(model_id="scripted")
        self.seen: list[str] = []

    def generate(self, messages, stop_sequences=None, response_format=None, tools_to_call_from=None, **kwargs):
        last = messages[-1]
        content = last.content if hasattr(last, "content") else last["content"]
        self.seen.append(json.dumps(content, default=str)[-2000:])
        step = STEPS[min(len(self.seen) - 1, len(STEPS) - 1)]
        return ChatMessage(role=MessageRole.ASSISTANT, content=step,
                           token_usage=TokenUsage(input_tokens=1, output_tokens=1))


def main() -> int:
    model = ScriptedModel()
    with CodeAgent(tools=[], model=model, executor_type="e2b", max_steps=5, verbosity_level=0) as agent:
        answer = agent.run("Sum the rows, double it, and answer.")
        sandbox_id = agent.python_executor.sandbox.sandbox_id
    print(json.dumps({"answer": answer, "steps": len(model.seen), "sandbox": sandbox_id,
                      "observations": model.seen[1:]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
