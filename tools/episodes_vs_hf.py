#!/usr/bin/env python3
"""episodes_vs_hf.py — environment episodes as the policy sees them against a
chat template renderer nobody here wrote, episode by episode.

An episode's ids are built the way the inference rank and an environment build
them (tools/chat_template.py ChatTemplate.encode_episode): the prompt with the
generation prompt, each assistant turn as drawn (its text and end-of-turn
token), each observation's ids (encode_observation: tool results or a user
message) between them. They must be the first ids of the reference's rendering
of the whole chat (the rest is what the template writes after the last turn:
nothing, a newline, or, in Llama 3's first template, the next assistant header),
and the loss mask must be exactly the assistant turns.

The episode set, seeded:
  qwen3   calculator episodes (tools/make_calc_task.py's problems): one call then
          the answer; a call whose result is an error, then a second call; two
          calls in one turn with two results; tool results with Unicode, JSON
          and newlines; every turn thinks (Qwen3 keeps non-empty think blocks)
  llama3  conversations of 2-4 user/assistant rounds (system prompt or not),
          texts with Unicode, newlines and spaces; each user turn after the
          first is the observation

    python3 tools/episodes_vs_hf.py --tokenizer DIR --name qwen3 --reference transformers
    /usr/bin/python3 tools/episodes_vs_hf.py --tokenizer DIR --name llama3 --reference node

--reference transformers: AutoTokenizer.apply_chat_template (the GPU machine);
node: @huggingface/tokenizers and @huggingface/jinja (tools/node/reference.mjs).
Prints a line per failure and a summary; exits 1 when any episode differs.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from chat_template import ChatTemplate  # noqa: E402
from hf_tokenizer import Tokenizer  # noqa: E402
from make_calc_task import SYSTEM, TOOLS, problem  # noqa: E402

WORDS = ["the", "answer", "is", "maybe", "Paris", "naïve", "café", "日本語", "机器学习", "🤗", "x = 3",
         "(a + b)", "don't", "  two  spaces", "tab\there", "line\nbreak", "{\"k\": 1}", "end."]


def text(rng, lo=1, hi=12):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def call(expression):
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def think(what):
    # Stripped: @huggingface/jinja's str.lstrip('\n') strips every kind of whitespace
    # (jinja2, which transformers renders with, only newlines), so a thought that
    # starts with a space would differ in the node reference alone.
    return f"<think>\n{what.strip()}\n</think>\n\n"


def qwen3_episode(rng, k):
    question, expression, answer = problem(rng)
    m = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    kind = k % 4
    if kind == 0:  # one call, then the answer
        m += [{"role": "assistant", "content": think("I will use the calculator."), "tool_calls": [call(expression)]},
              {"role": "tool", "content": str(answer)}]
    elif kind == 1:  # an error, then a second call
        m += [{"role": "assistant", "content": think("Try it."), "tool_calls": [call(expression + " +")]},
              {"role": "tool", "content": "error: the expression ends after '+'"},
              {"role": "assistant", "content": think("Fix the expression."), "tool_calls": [call(expression)]},
              {"role": "tool", "content": str(answer)}]
    elif kind == 2:  # two calls in one turn, two results
        m += [{"role": "assistant", "content": think("Check it twice."),
               "tool_calls": [call(expression), call(f"({expression}) * 1")]},
              {"role": "tool", "content": str(answer)}, {"role": "tool", "content": str(answer)}]
    else:  # a result with Unicode, JSON and newlines
        m += [{"role": "assistant", "content": think(text(rng)), "tool_calls": [call(expression)]},
              {"role": "tool", "content": json.dumps({"value": answer, "note": text(rng)}, ensure_ascii=False)
               + "\n" + text(rng)}]
    m.append({"role": "assistant", "content": think(f"The calculator says {answer}.")
              + f"The answer is {answer}. {text(rng, 0, 4)}".rstrip()})
    return m, TOOLS


def llama3_episode(rng, k):
    m = [{"role": "system", "content": text(rng)}] if k % 2 else []
    for _ in range(rng.randint(2, 4)):
        m += [{"role": "user", "content": text(rng)}, {"role": "assistant", "content": text(rng)}]
    return m, None


def transformers_ids(folder, episodes):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    out = []
    for messages, tools in episodes:
        ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=False)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding by default
            ids = ids["input_ids"]
        out.append([int(i) for i in ids])
    return out


def node_ids(folder, episodes):
    request = {"tokenizer_dir": folder, "render": [{"messages": m, "tools": t, "add_generation_prompt": False}
                                                   for m, t in episodes]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
        json.dump(request, f, ensure_ascii=False)
    try:
        out = subprocess.run(["node", os.path.join(HERE, "node", "reference.mjs"), f.name], capture_output=True,
                             text=True, check=True)
    finally:
        os.unlink(f.name)
    return json.loads(out.stdout)["render_ids"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="folder with tokenizer.json and tokenizer_config.json")
    p.add_argument("--name", required=True, choices=["qwen3", "llama3"])
    p.add_argument("--reference", required=True, choices=["transformers", "node"])
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    tok = Tokenizer.load(a.tokenizer)
    template = ChatTemplate.from_folder(a.tokenizer, tok)
    rng = random.Random(a.seed)
    make = qwen3_episode if a.name == "qwen3" else llama3_episode
    episodes = [make(rng, k) for k in range(a.episodes)]
    refs = (transformers_ids if a.reference == "transformers" else node_ids)(a.tokenizer, episodes)
    bad = 0
    rests = {}
    tokens = loss_tokens = observations = 0
    for k, ((messages, tools), ref) in enumerate(zip(episodes, refs)):
        ids, mask = template.encode_episode(messages, tools)
        _, whole_mask = template.encode_chat(messages, tools)
        rest = tok.decode(ref[len(ids):]) if ref is not None else None
        ok = (ref is not None and ids == ref[:len(ids)] and mask == whole_mask[:len(ids)]
              and not any(whole_mask[len(ids):]))
        if not ok:
            bad += 1
            i = next((j for j in range(min(len(ids), len(ref or []))) if ids[j] != ref[j]), None)
            print(f"FAIL episode {k}: {len(ids)} ids, reference {len(ref or [])}; first difference at {i}; "
                  f"after the episode the reference writes {rest!r}")
        else:
            rests[rest] = rests.get(rest, 0) + 1
        tokens += len(ids)
        loss_tokens += sum(mask)
        observations += sum(1 for j in range(1, len(mask)) if mask[j] == 0 and mask[j - 1] == 1)
    summary = {"name": a.name, "reference": a.reference, "episodes": len(episodes), "differ": bad,
               "tokens": tokens, "loss_tokens": loss_tokens, "observations": observations,
               "after_last_turn": rests}
    print(("PASS" if bad == 0 else "FAIL") + f" {a.name}: {len(episodes) - bad} of {len(episodes)} episodes' ids equal "
          f"{a.reference}'s rendering of the whole chat, loss mask on the assistant turns only "
          f"({tokens} ids, {loss_tokens} with loss, {observations} observations)")
    print(json.dumps(summary))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
