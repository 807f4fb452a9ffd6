#!/usr/bin/env python3
"""make_prompts.py — turn JSONL prompts into a shardlm RL prompt file (HDF5).

Each prompt is rendered with the model's own chat template and
add_generation_prompt (the text the policy is served and continues), tokenized,
and stored with its reference answer and metadata as text for the rewards:

    /usr/bin/python3 tools/make_prompts.py -o prompts.h5 --tokenizer /models/Qwen3-8B prompts.jsonl

Input lines (blank lines are skipped):
    {"messages": [{"role": "system", ...}, {"role": "user", ...}], "answer": "42", "metadata": {...}}
    {"prompt": "What is 6*7?", "answer": "42"}        the prompt as one user message
Optional "tools" (tool schemas, for templates that take them). "answer" is a
string; "metadata" any JSON value (stored as JSON text).

Layout: docs/data.md ("RL prompt files"). Exit status: 0 written, 1 bad input
(every problem reported as FILE:LINE: reason, nothing written), 2 bad command line.
"""

import argparse
import json
import os
import sys

from make_dataset import (MAX_REPORTED_ERRORS, ByteTokenizer, HFTokenizer, InputError, np, read_json_line,
                          type_name, h5py)
from chat_template import ChatError, check_messages

FORMAT = "shardlm-prompts-1"


def render_prompt(record, where, tokenizer):
    """(text, ids) of one line's prompt; raises InputError."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type_name(record)}")
    template = getattr(tokenizer, "template", None)
    if ("messages" in record) == ("prompt" in record):
        raise InputError(f"{where}: needs exactly one of 'messages' and 'prompt'")
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise InputError(f"{where}: 'prompt' must be a non-empty string")
        if template is None:
            text = record["prompt"]
            return text, [int(i) for i in tokenizer.encode(text)]
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        messages = record["messages"]
    try:
        check_messages(messages, where)
    except ChatError as e:
        raise InputError(str(e)) from None
    if messages[-1]["role"] == "assistant":
        raise InputError(f"{where}: the last message is the assistant's; a prompt ends with the turn the "
                         f"model answers")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InputError(f"{where}: 'tools' must be an array of tool schemas")
    if template is None:
        if tools is not None:
            raise InputError(f"{where}: 'tools' needs the model's chat template, and this tokenizer has none")
        # shardlm's own chat format (docs/data.md): each turn "<|role|>\n", its content and
        # EOS; then the assistant's header.
        if tokenizer.eos_id is None:
            raise InputError(f"{where}: shardlm's chat format ends turns with EOS and the tokenizer has "
                             f"none; name one with --eos-token")
        eos_text = tokenizer.tokenizer.id_to_token(tokenizer.eos_id) if hasattr(tokenizer, "tokenizer") else ""
        ids, text = [], ""
        for m in messages:
            turn = f"<|{m['role']}|>\n{m['content']}"
            ids += [int(i) for i in tokenizer.encode(turn)] + [tokenizer.eos_id]
            text += turn + eos_text
        ids += [int(i) for i in tokenizer.encode("<|assistant|>\n")]
        return text + "<|assistant|>\n", ids
    try:
        return template.encode_prompt(messages, tools, where)
    except ChatError as e:
        raise InputError(str(e)) from None


def stop_token_ids(tokenizer):
    template = getattr(tokenizer, "template", None)
    tokens = template.end_of_turn_tokens() if template is not None else []
    ids = [tokenizer.tokenizer.token_to_id(t) for t in tokens] if tokens else []
    if tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
    return sorted({i for i in ids if i is not None})


def main(argv=None):
    parser = argparse.ArgumentParser(description="Render and tokenize RL prompts into a shardlm prompt file.")
    parser.add_argument("inputs", nargs="+", help="JSONL files")
    parser.add_argument("-o", "--output", required=True, help="HDF5 file to write")
    parser.add_argument("--tokenizer", default="byte", help="'byte', a tokenizer.json, or its model folder")
    parser.add_argument("--chat-template", default="auto",
                        help="'auto' (default): the tokenizer's own template; 'none': shardlm's chat format; "
                             "or a Jinja template file")
    parser.add_argument("--template-var", action="append", metavar="NAME=VALUE",
                        help="a variable for the chat template, VALUE as JSON (e.g. enable_thinking=false "
                             "for Qwen3); repeatable")
    parser.add_argument("--eos-token", help="EOS token string (default: from tokenizer_config.json)")
    args = parser.parse_args(argv)
    try:
        tokenizer = ByteTokenizer() if args.tokenizer == "byte" else \
            HFTokenizer(args.tokenizer, None, args.eos_token, args.chat_template, args.template_var)
    except InputError as e:
        print(f"make_prompts.py: {e}", file=sys.stderr)
        return 1

    errors, ids, texts, answers, metadata = [], [], [], [], []
    for path in args.inputs:
        if not os.path.isfile(path):
            errors.append(f"{path}: input file does not exist")
            continue
        with open(path, "rb") as f:
            for line_number, raw in enumerate(f, start=1):
                where = f"{path}:{line_number}"
                try:
                    record = read_json_line(raw, where)
                    if record is None:
                        continue
                    text, prompt_ids = render_prompt(record, where, tokenizer)
                    answer = record.get("answer", "")
                    if not isinstance(answer, str):
                        raise InputError(f"{where}: 'answer' must be a string, got {type_name(answer)}")
                except InputError as e:
                    errors.append(str(e))
                    continue
                ids.append(prompt_ids)
                texts.append(text)
                answers.append(answer)
                metadata.append(json.dumps(record.get("metadata", {}), ensure_ascii=False, sort_keys=True))
    if not errors and not ids:
        errors.append("no prompt in the inputs; nothing to write")
    if errors:
        for message in errors[:MAX_REPORTED_ERRORS]:
            print(message, file=sys.stderr)
        if len(errors) > MAX_REPORTED_ERRORS:
            print(f"... and {len(errors) - MAX_REPORTED_ERRORS} more", file=sys.stderr)
        print(f"make_prompts.py: {len(errors)} error(s); {args.output} not written", file=sys.stderr)
        return 1

    tokens = np.asarray([i for prompt in ids for i in prompt], dtype=np.int32)
    offsets = np.cumsum([0] + [len(p) for p in ids]).astype(np.int64)
    text_type = h5py.string_dtype("utf-8")
    template = getattr(tokenizer, "template", None)
    tmp = args.output + ".tmp"
    try:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("tokens", data=tokens, track_times=False)
            f.create_dataset("offsets", data=offsets, track_times=False)
            for name, values in (("prompt", texts), ("answer", answers), ("metadata", metadata)):
                f.create_dataset(name, data=np.asarray(values, dtype=object), dtype=text_type, track_times=False)
            f.attrs["format"] = FORMAT
            f.attrs["vocab_size"] = np.int64(max(tokenizer.vocab_size, int(tokens.max()) + 1))
            f.attrs["tokenizer"] = tokenizer.name
            f.attrs["chat_template"] = template.source if template is not None else ""
            f.attrs["stop_token_ids"] = np.asarray(
                stop_token_ids(tokenizer) if args.tokenizer != "byte" else [tokenizer.eos_id], dtype=np.int64)
        os.replace(tmp, args.output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(f"wrote {args.output}: {len(ids)} prompts, {len(tokens)} tokens, "
          f"{sum(1 for a in answers if a)} with answers, tokenizer {tokenizer.name}, "
          f"template {template.where if template is not None else 'none (shardlm chat format)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
