#!/usr/bin/env python3
"""make_calc_task.py — arithmetic word problems solved with a calculator tool in
Qwen3's tool-call format, for RL with an environment (tools/envs/calculator.py).

A problem ("Ann has 437 apples. She buys 285 more. How many apples does Ann have
now?") is a user message; the chat offers one tool, `calculator`, whose argument
is an expression. A solved chat, as the SFT data holds it:

    assistant  <think>\\nI will use the calculator.\\n</think>\\n\\n
               <tool_call>\\n{"name": "calculator", "arguments": {"expression": "437 + 285"}}\\n</tool_call>
    tool       722
    assistant  <think>\\nThe calculator says 722.\\n</think>\\n\\nThe answer is 722.

Every assistant turn thinks: Qwen3's template keeps a turn's think block in
the history only when it is not empty, so a turn that thought can be continued
exactly (tools/chat_template.py encode_observation).

Writes, into --out-dir, JSONL for tools/make_dataset.py and tools/make_prompts.py:
    sft.jsonl       solved chats (messages, tools)
    prompts.jsonl   the RL problems: messages (system + user), tools, answer, and the
                    messages and tools again in metadata, for the environment
    heldout.jsonl   problems held out for the evaluation, the same form

    /usr/bin/python3 tools/make_calc_task.py --out-dir runs/calc-task
"""

import argparse
import json
import os
import random

TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
SYSTEM = "Solve the problem. Use the calculator for the arithmetic, then give the answer."
NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]
ITEMS = ["apples", "books", "coins", "marbles", "stamps", "cards", "shells", "pens"]


def problem(rng):
    """(question, expression, answer)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return (f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?",
                f"{a} + {b}", a + b)
    if kind == 1:
        a = rng.randint(200, 999)
        b = rng.randint(100, a - 1)
        return (f"{name} has {a} {item} and gives {b} away. How many {item} does {name} have left?",
                f"{a} - {b}", a - b)
    a, b = rng.randint(12, 99), rng.randint(3, 9)
    return f"A box holds {a} {item}. How many {item} are in {b} boxes?", f"{a} * {b}", a * b


def prompt_messages(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def solved(question, expression, answer):
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return prompt_messages(question) + [
        {"role": "assistant", "content": "<think>\nI will use the calculator.\n</think>\n\n", "tool_calls": [call]},
        {"role": "tool", "content": str(answer)},
        {"role": "assistant", "content": f"<think>\nThe calculator says {answer}.\n</think>\n\nThe answer is {answer}."}]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--sft", type=int, default=20000)
    p.add_argument("--prompts", type=int, default=4096)
    p.add_argument("--heldout", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    rng = random.Random(a.seed)
    seen = set()

    def fresh():
        while True:
            q, e, n = problem(rng)
            if q not in seen:
                seen.add(q)
                return q, e, n

    with open(os.path.join(a.out_dir, "sft.jsonl"), "w") as f:
        for _ in range(a.sft):
            f.write(json.dumps({"messages": solved(*fresh()), "tools": TOOLS}) + "\n")
    for name, count in (("prompts", a.prompts), ("heldout", a.heldout)):
        with open(os.path.join(a.out_dir, f"{name}.jsonl"), "w") as f:
            for _ in range(count):
                q, _, n = fresh()
                m = prompt_messages(q)
                f.write(json.dumps({"messages": m, "tools": TOOLS, "answer": str(n),
                                    "metadata": {"messages": m, "tools": TOOLS}}) + "\n")
    print(f"wrote {a.out_dir}/sft.jsonl ({a.sft} chats), prompts.jsonl ({a.prompts}), heldout.jsonl ({a.heldout})")


if __name__ == "__main__":
    main()
