#!/usr/bin/env python3
"""calculator.py — a calculator tool as an environment (env.program; docs/rl.md
"Environments"), for tools/make_calc_task.py's word problems in Qwen3's
tool-call format.

After each assistant turn: the turn's tool calls (`<tool_call>{"name":
"calculator", "arguments": {"expression": "437 + 285"}}</tool_call>`) are run and
their results handed back as tool messages, rendered with the model's own chat
template so that the episode's ids are what apply_chat_template gives the
whole chat (tools/chat_template.py encode_observation). A turn without a tool
call is the answer: the episode ends with reward 1 when its last number equals
the problem's answer, else 0. A tool call that cannot be run (not JSON, another
tool, a bad expression) gets an error message as its result and counts as a
tool error.

Each episode's metrics: tool_calls, tool_errors, tool_success (1 when the
episode made a call and every call ran), correct. The chat of an episode comes
from its prompt's metadata (messages, tools), as make_calc_task.py writes them.

    env.program = "python3 tools/envs/calculator.py --tokenizer runs/calc-sft/export"
"""

import argparse
import ast
import json
import operator
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from chat_template import ChatError, ChatTemplate, parse_tool_calls  # noqa: E402
from hf_tokenizer import Tokenizer  # noqa: E402

END_OF_TURN = "<|im_end|>"
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression):
    """The value of an integer expression of + - * and parentheses; ValueError otherwise."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and abs(node.value) < 10 ** 12:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only integers, + - * and parentheses")
    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("the expression must be a string of at most 200 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError("not an expression") from None
    return value(tree.body)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="the model folder with tokenizer.json and its chat template")
    a = p.parse_args()
    tokenizer = Tokenizer.load(a.tokenizer)
    template = ChatTemplate.from_folder(a.tokenizer, tokenizer)
    episodes = {}  # episode -> {"messages", "tools", "calls", "errors"}
    for line in sys.stdin:
        m = json.loads(line)
        name = m["episode"]
        e = episodes.pop(name, None) or {"messages": list(m["metadata"]["messages"]),
                                          "tools": m["metadata"].get("tools"), "calls": 0, "errors": 0}
        text = m["text"][:-len(END_OF_TURN)] if m["text"].endswith(END_OF_TURN) else m["text"]
        e["messages"].append({"role": "assistant", "content": text})
        calls, errors = parse_tool_calls(text)
        answer = {"episode": name}
        if (calls or errors) and not m.get("end"):
            results = []
            for tool, arguments in calls:
                try:
                    if tool != "calculator":
                        raise ValueError(f"no tool named {tool!r}")
                    results.append(str(calculate(arguments.get("expression"))))
                except ValueError as err:
                    results.append(f"error: {err}")
                    e["errors"] += 1
            results += [f"error: {err}" for err in errors]
            e["calls"] += len(calls) + len(errors)
            e["errors"] += len(errors)
            observation = [{"role": "tool", "content": r} for r in results]
            try:
                answer["observation"] = template.encode_observation(e["messages"], observation, e["tools"])
                e["messages"] += observation
                episodes[name] = e
            except ChatError:  # the turn cannot be continued as the template renders it: the episode ends
                answer["reward"] = 0.0
        else:
            numbers = re.findall(r"-?\d+", text.split("</think>")[-1])
            correct = not m.get("end") and bool(numbers) and numbers[-1] == m["answer"].strip()
            answer["reward"] = float(correct)
        if "reward" in answer:
            answer["metrics"] = {"tool_calls": e["calls"], "tool_errors": e["errors"],
                                 "tool_success": int(e["calls"] > 0 and e["errors"] == 0),
                                 "correct": int(answer["reward"] > 0)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
