"""tokenizer_cases.py — tools/hf_tokenizer.py and tools/chat_template.py against
references nobody here wrote (tools/node/reference.mjs: @huggingface/tokenizers
and @huggingface/jinja), on one real model's tokenizer files. Prints PASS/FAIL
lines; called by tests/scripts/test_tokenizer.sh.

    python3 tokenizer_cases.py MODEL_DIR NAME WORK_DIR
"""

import json
import os
import random
import subprocess
import sys
import unicodedata

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from hf_tokenizer import Tokenizer  # noqa: E402
from chat_template import ChatTemplate, ChatError, parse_tool_calls  # noqa: E402

failed = 0


def report(ok, name, detail=""):
    global failed
    print(("PASS " if ok else "FAIL ") + name)
    if not ok:
        failed += 1
        if detail:
            print("  " + detail[:2000].replace("\n", "\n  "))


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def corpus(tok):
    """(name, text) pairs: every kind of text a tokenizer meets (prose, code, numbers, scripts, emoji,
    broken UTF-8, added tokens) and random mixes of them."""
    texts = []
    with open(os.path.join(ROOT, "inputs", "data", "tiny.txt"), encoding="utf-8") as f:
        texts.append(("english prose", f.read()))
    for rel in ("tools/make_dataset.py", "src/main.cpp", "Makefile"):
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            texts.append((f"code {rel}", f.read()[:20000]))
    texts += [
        ("numbers", "3.14159 1234567890 1,000,000 0x1F 1e-9 -42 007 12345678901234567890 ١٢٣٤ ４５６ Ⅻ ½ 2²"),
        ("contractions", "I'm you're he'll it's we've they'd DON'T IT'S O'Neil 'tis rock'n'roll l'été"),
        ("whitespace runs", "a  b   c\t\t d\n\n\n e \r\n f\r\r\n   leading\ntrailing   \n \n\t\n  \u00a0 \u3000x"
                            "\u2028y\u0085z \u200b\u200bw\x0b\x0c v          end      "),
        ("only spaces", "        "),
        ("only newlines", "\n\n\n\n"),
        ("CJK", "机器学习是人工智能的一个分支。日本語のテキスト、カタカナとひらがな。한국어 문장입니다. 繁體中文測試"),
        ("emoji", "🤗 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ 😀😃😄 🧑🏿‍🚀 #️⃣ ©️ a🤗b"),
        ("combining marks", "e\u0301 a\u0308 n\u0303 Zalgo: Z\u0324\u0354\u0367\u0311a\u0356\u032d\u0308l\u036e"
                            "\u0312g\u0301o \u0915\u094d\u0937 \u0e01\u0e34 \u05e9\u05c1\u05b8 caf\u00e9 cafe\u0301 "
                            "\u1100\u1161\u11a8 \u212b \u2126"),
        ("accents and scripts", "Ça va? Straße ÆØÅ Ελληνικά Русский текст עברית العربية हिन्दी ไทย"),
        ("punctuation", "!!! ??? ... --- ''' \"\"\" ((( ))) {{}} [[ ]] <<>> @#$%^&*_+=|\\/~`"),
        ("invalid UTF-8", b"abc\xff\xfe def \xc3\x28 \xed\xa0\x80 \xf8\x88\x80\x80\x80 \xc0\xaf end".decode(
            "utf-8", "replace")),
        ("partial UTF-8", b"cut \xe6\x9c\xba\xe5\x99 mid \xf0\x9f\xa4 end \xe4".decode("utf-8", "replace")),
        ("replacement chars", "\ufffd\ufffd x\ufffdy"),
        ("control chars", "\x00\x01\x02\x1b[31mred\x1b[0m\x7f\x1c\x1d\x1e\x1f"),
        ("long word", "a" * 300 + " " + "ab" * 150 + " " + "9" * 70),
        ("empty", ""),
    ]
    specials = sorted(tok.added)
    texts.append(("every added token, separated", " x ".join(specials)))
    texts.append(("every added token, adjacent", "".join(specials)))
    texts.append(("every added token inside words", "".join(f"ab{s}cd\n" for s in specials)))
    texts.append(("broken added tokens", " ".join(s[:-1] + " " + s[1:] for s in specials[:40])))
    # Fuzz: random mixes of the characters tokenizers disagree on.
    pool = list("aZ0 9 \t\n\r'sStTdDmM.,;!?-_()[]{}<>|/\\\"") + ["  ", "\n\n", "’", "é", "e\u0301", "机", "器",
                                                                   "🤗", "👍🏽", "\u00a0", "\u3000", "١",
                                                                   "ſ", "K", "ǅ", "\u200d", "\ufffd", "<|"]
    rng = random.Random(28)
    for i in range(200):
        texts.append((f"fuzz {i}", "".join(rng.choice(pool) for _ in range(rng.randint(1, 60)))))
    return texts


def chats(name):
    """(label, messages, tools, expected loss runs or None)."""
    qwen = name == "qwen3"
    end = "<|im_end|>" if qwen else "<|eot_id|>"
    think = "<think>\n\n</think>\n\n" if qwen else ""
    weather = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}}, "required": ["city"]}}}]
    cases = [
        ("single turn", [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
         None, [think + "4" + end]),
        ("system prompt", [{"role": "system", "content": "You are terse."},
                           {"role": "user", "content": "Name a colour."},
                           {"role": "assistant", "content": "Blue."}], None, [think + "Blue." + end]),
        ("multi-turn", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 你好"},
                        {"role": "user", "content": "Count to 3"}, {"role": "assistant", "content": "1 2 3"}],
         None, ["Hello! 你好" + end, think + "1 2 3" + end]),
        ("empty content", [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
         None, [think + end]),
        ("assistant first", [{"role": "assistant", "content": "How can I help?"},
                             {"role": "user", "content": "Tell me a joke"},
                             {"role": "assistant", "content": "No."}], None,
         ["How can I help?" + end, think + "No." + end]),
        ("combining marks content", [{"role": "user", "content": "Cafe\u0301?"},
                                     {"role": "assistant", "content": "cafe\u0301 Z\u0324\u0354 ok"},
                                     {"role": "user", "content": "again"},
                                     {"role": "assistant", "content": "e\u0301"}], None,
         [("caf\u00e9" if qwen else "cafe\u0301") + " Z\u0324\u0354 ok" + end,
          think + ("\u00e9" if qwen else "e\u0301") + end]),
        ("whitespace and emoji content", [{"role": "user", "content": "  spaced \n\n out  "},
                                          {"role": "assistant", "content": "\n 🤗 done \n"}], None, None),
    ]
    if qwen:
        cases += [
            ("reasoning content", [{"role": "user", "content": "Why?"},
                                   {"role": "assistant", "content": "<think>\nBecause.\n</think>\n\nSo."}],
             None, ["<think>\nBecause.\n</think>\n\nSo." + end]),
            ("tool calls", [{"role": "system", "content": "Use tools."},
                            {"role": "user", "content": "Weather in Paris?"},
                            {"role": "assistant", "content": "",
                             "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                             "arguments": {"city": "Paris"}}}]},
                            {"role": "tool", "content": "{\"temp_c\": 21}"},
                            {"role": "tool", "content": "second result"},
                            {"role": "assistant", "content": "It is 21°C in Paris."}], weather,
             ["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>" + end,
              think + "It is 21°C in Paris." + end]),
            # Thinking before each tool call and answer: the turns after the last user
            # message keep their think blocks, so an episode's ids continue (an empty
            # think block is dropped from a turn that is not the last).
            ("tool calls, thinking", [{"role": "user", "content": "Weather in Paris?"},
                                      {"role": "assistant", "content": "<think>\nAsk the tool.\n</think>\n\n",
                                       "tool_calls": [{"type": "function", "function": {
                                           "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                                      {"role": "tool", "content": "{\"temp_c\": 21}"},
                                      {"role": "assistant", "content": "<think>\nWarm.\n</think>\n\nIt is 21°C."}],
             weather, ["<think>\nAsk the tool.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", "
                       "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>" + end,
                       "<think>\nWarm.\n</think>\n\nIt is 21°C." + end]),
        ]
    return cases


def run_reference(request, work, label):
    path = os.path.join(work, f"request-{label}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(request, f, ensure_ascii=False)
    script = os.path.join(ROOT, "tools", "node", "reference.mjs")
    out = subprocess.run(["node", script, path], capture_output=True, text=True)
    if out.returncode != 0:
        report(False, f"{label}: node reference ran", out.stderr[-2000:])
        return None
    return json.loads(out.stdout)


def loss_runs(tok, ids, mask):
    runs, current = [], []
    for token_id, m in zip(ids, mask):
        if m:
            current.append(token_id)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


def main():
    model_dir, name, work = sys.argv[1:4]
    tok = Tokenizer.load(model_dir)
    template = ChatTemplate.from_folder(model_dir, tok)
    texts = corpus(tok)
    decode_ids = [[i] for i in range(0, tok.vocab_size, 7)] + [[i] for i in sorted(tok.id_to_added)]
    # Pieces of characters: the first byte-tokens of a 4-byte emoji and of a CJK character.
    decode_ids += [tok.encode("🤗")[:k] for k in range(1, len(tok.encode("🤗")) + 1)]
    decode_ids += [tok.encode(" 机器学习")[:k] for k in range(1, len(tok.encode(" 机器学习")) + 1)]
    ours_encoded = [tok.encode(text) for _, text in texts]
    decode_ids += ours_encoded
    chat_cases = chats(name)
    render_requests = []
    for _, messages, tools, _ in chat_cases:
        for agp in (False, True):
            render_requests.append({"messages": messages, "tools": tools, "add_generation_prompt": agp})
    # The prompt each chat's last assistant turn answers (what an RL prompt file holds).
    for _, messages, tools, _ in chat_cases:
        render_requests.append({"messages": messages[:-1] or messages, "tools": tools,
                                "add_generation_prompt": True})
    answer = run_reference({"tokenizer_dir": model_dir, "encode": [t for _, t in texts], "decode": decode_ids,
                            "render": render_requests}, work, name)
    if answer is None:
        return 1

    # -------------------------------------------------------------- encode
    mismatched = [(label, ours, ref) for (label, _), ours, ref in zip(texts, ours_encoded, answer["encode"])
                  if ours != ref]
    total_tokens = sum(len(ids) for ids in ours_encoded)
    detail = ""
    if mismatched:
        label, ours, ref = mismatched[0]
        i = first_difference(ours, ref)
        detail = f"{len(mismatched)} texts differ; first: {label!r} at token {i}: ours {ours[i:i + 8]} reference {ref[i:i + 8]}"
    report(not mismatched, f"{name}: encode equals @huggingface/tokenizers token for token on {len(texts)} texts "
                           f"({total_tokens} tokens)", detail)
    for label in ("invalid UTF-8", "partial UTF-8", "CJK", "emoji", "combining marks", "whitespace runs",
                  "every added token, adjacent", "code tools/make_dataset.py"):
        k = [t[0] for t in texts].index(label)
        report(ours_encoded[k] == answer["encode"][k] and len(ours_encoded[k]) > 0,
               f"{name}: {label}: {len(ours_encoded[k])} tokens equal the reference")
    specials = sorted(tok.added)
    k = [t[0] for t in texts].index("every added token, adjacent")
    want = [tok.added[s].id for s in specials]
    report(ours_encoded[k] == want, f"{name}: each of the {len(specials)} added tokens is one id",
           f"ours {ours_encoded[k][:10]} want {want[:10]}")

    # -------------------------------------------------------------- decode
    ours_decoded = [tok.decode(ids) for ids in decode_ids]
    bad = [(ids, o, r) for ids, o, r in zip(decode_ids, ours_decoded, answer["decode"]) if o != r]
    report(not bad, f"{name}: decode equals the reference on {len(decode_ids)} id lists "
                    f"(every 7th id alone, every added token, partial characters, the corpus)",
           f"{len(bad)} differ; first ids {bad[0][0][:8]}: ours {bad[0][1][:80]!r} reference {bad[0][2][:80]!r}"
           if bad else "")
    norm = (lambda s: unicodedata.normalize("NFC", s)) if tok.nfc else (lambda s: s)
    broken = [label for (label, text), ids in zip(texts, ours_encoded) if tok.decode(ids) != norm(text)]
    report(not broken, f"{name}: decode(encode(text)) == text{' (NFC)' if tok.nfc else ''} for all {len(texts)} texts",
           f"not round-tripped: {broken[:5]}")
    rare = next(c for c in "🦜𓀀𝔘🂡" if len(tok.encode(c)) > 1)
    pieces = tok.encode(rare)
    head = tok.decode_bytes(pieces[:1])
    report(tok.decode(pieces[:1]) == "\ufffd" and 0 < len(head) < 4 and rare.encode().startswith(head)
           and tok.decode_bytes(pieces) == rare.encode() and tok.decode(pieces) == rare,
           f"{name}: a partial character decodes to U+FFFD, its bytes exactly ({rare}: {len(pieces)} tokens, "
           f"the first holds {len(head)} of its 4 bytes)")

    # -------------------------------------------------------------- chat templates
    if template is None:
        report(False, f"{name}: has a chat template")
        return 1
    renders = answer["render"]
    n = len(chat_cases)
    for c, (label, messages, tools, expected) in enumerate(chat_cases):
        for j, agp in enumerate((False, True)):
            ref = renders[2 * c + j]
            if name == "qwen3" and label == "whitespace and emoji content":
                # @huggingface/jinja 0.5.11's str.lstrip('\n') strips every kind of whitespace;
                # jinja2, which transformers renders with, strips only the newlines Python's does.
                assert isinstance(ref, str) and "</think>\n\n🤗 done" in ref
                ref = ref.replace("</think>\n\n🤗 done", "</think>\n\n 🤗 done")
            try:
                ours = template.render(messages, tools=tools, add_generation_prompt=agp)
            except ChatError as e:
                ours = {"error": str(e)}
            report(ours == ref, f"{name}: chat '{label}' renders as @huggingface/jinja does "
                                f"(add_generation_prompt={agp}, {len(ours) if isinstance(ours, str) else 0} chars)",
                   f"ours {ours!r}\nreference {ref!r}")
        ref_prompt = renders[2 * n + c]
        ours_prompt, prompt_ids = template.encode_prompt(messages[:-1] or messages, tools)
        report(ours_prompt == ref_prompt and prompt_ids == answer["render_ids"][2 * n + c],
               f"{name}: chat '{label}' RL prompt (add_generation_prompt) equals the reference")
        ids, mask = template.encode_chat(messages, tools)
        runs = loss_runs(tok, ids, mask)
        ok_ids = ids == answer["render_ids"][2 * c]
        if name == "qwen3" and label == "whitespace and emoji content":  # see above
            ok_ids = tok.decode(ids) == renders[2 * c].replace("</think>\n\n🤗 done", "</think>\n\n 🤗 done")
        if expected is not None:
            report(ok_ids and runs == expected,
                   f"{name}: chat '{label}': {len(ids)} tokens equal the reference's, loss on exactly "
                   f"{sum(mask)} tokens: {runs!r}", f"runs {runs!r}\nwant {expected!r}")
        else:
            content = messages[-1]["content"]
            report(ok_ids and len(runs) == 1 and content.strip() in runs[0] and runs[0].endswith(
                "<|im_end|>" if name == "qwen3" else "<|eot_id|>"),
                   f"{name}: chat '{label}': loss on the assistant's text and end of turn only: {runs!r}")

    # ------------------------------------------- episodes: prompt, drawn turns, observations
    # An environment's episode as the policy sees it: the prompt (add_generation_prompt),
    # each assistant turn as drawn (the template's rendering of it when it is the
    # last, its end-of-turn token included) and each observation's ids
    # (ChatTemplate.encode_observation) between them, concatenated, against the
    # reference's tokens of the whole chat; the loss mask on the drawn turns only.
    episodes = {"llama3": ["multi-turn"], "llama3_1": ["multi-turn"],
                "qwen3": ["tool calls, thinking"]}
    for c, (label, messages, tools, _) in enumerate(chat_cases):
        if label not in episodes.get(name, []):
            continue
        ids, mask = template.encode_episode(messages, tools)
        ref = answer["render_ids"][2 * c]
        whole_ids, whole_mask = template.encode_chat(messages, tools)
        rest = tok.decode(ref[len(ids):])
        report(ids == ref[:len(ids)] and not any(whole_mask[len(ids):]) and mask == whole_mask[:len(ids)],
               f"{name}: episode '{label}': prompt + drawn turns + observation ids = the reference's tokens of the "
               f"whole chat ({len(ids)} of {len(ref)}; after the last turn the template writes {rest!r}), the loss "
               f"mask exactly on the drawn turns ({sum(mask)} tokens)", f"first difference at {first_difference(ids, ref)}")
    if name == "qwen3":
        # A user turn after an assistant turn: Qwen3's template drops the empty think block it
        # wrote into that turn when it was the last, so the policy's ids cannot be continued.
        label, messages, tools, _ = next(x for x in chat_cases if x[0] == "multi-turn")
        try:
            template.encode_observation(messages[:2], messages[2:3], tools)
            report(False, f"{name}: a user observation after a turn with a think block is refused")
        except ChatError as e:
            report("otherwise once it goes on" in str(e) and "<think>" in str(e),
                   f"{name}: a user observation after a turn with a think block is refused, naming what changes",
                   str(e))
    calls, errors = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                     '</tool_call><tool_call>{"name": 3}</tool_call>')
    report(calls == [("get_weather", {"city": "Paris"})] and len(errors) == 1,
           f"{name}: parse_tool_calls reads Qwen3's <tool_call> format: {calls}, {errors}")
    return 0


if __name__ == "__main__":
    status = main()
    sys.exit(1 if failed or status else 0)
