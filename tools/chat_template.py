"""chat_template.py — a model's own Jinja chat template, rendered as transformers'
apply_chat_template renders it, and the assistant-only loss mask of a chat.

The environment is the one transformers builds: a sandboxed, immutable jinja2
environment with trim_blocks and lstrip_blocks, the loopcontrols extension,
`{% generation %} ... {% endgeneration %}` blocks (they mark what the assistant
writes), a `tojson` filter that is json.dumps with ensure_ascii=False, and the
globals `raise_exception(message)` and `strftime_now(format)`. The template
sees `messages`, `tools`, `add_generation_prompt`, the tokenizer's special
tokens (`bos_token`, `eos_token`, ...) as strings, and the variables a caller
sets in `variables` (what apply_chat_template's extra keyword arguments are,
e.g. Qwen3's `enable_thinking`). `strftime_now` reads SOURCE_DATE_EPOCH when it
is set, so a template that writes today's date makes the same data every day.

Which tokens carry loss, in the rendered text:
- a template with generation blocks: what they enclose;
- any other template: for assistant message i, from the end of the prompt the
  template renders for messages[:i] with add_generation_prompt when it is a
  prefix of the whole chat's text; else, where the two part after the header
  (Qwen3 with enable_thinking=false prompts with an empty think block that
  earlier turns do not keep), from the last line end or added token they
  share; else (a chat that opens with the assistant) after the first
  generation prompt found in the text. Up to and including the
  template's end-of-turn token: the first special token the template writes
  after an assistant's content (probed once; `<|eot_id|>`, `<|im_end|>`) or the
  tokenizer's EOS, whichever comes first. What follows it (a newline) is the
  next turn's. A token carries loss when any of its characters does (as
  transformers' return_assistant_tokens_mask does).
"""

import json
import os
import unicodedata
from datetime import datetime, timezone

try:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:  # pragma: no cover - depends on the interpreter
    jinja2 = None
    Extension = object

from hf_tokenizer import TokenizerError, load_tokenizer_config, token_text

ROLES = ("system", "user", "assistant", "tool")
PROBE_QUESTION = "shardlm-probe-question"
PROBE_ANSWER = "shardlm-probe-answer"


class ChatError(Exception):
    """A chat the template cannot render, or a template that cannot be used."""


class GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}`: records the character span of
    what the block renders while `spans` is a list (else renders it unchanged)."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.spans = None
        self.rendered_chars = 0  # characters the template has yielded so far

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_record", []), [], [], body).set_lineno(lineno)

    def _record(self, caller):
        text = caller()
        if self.spans is not None:
            self.spans.append((self.rendered_chars, self.rendered_chars + len(text)))
        return text


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes <, >, & and ' for HTML; transformers' does not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    # Templates that write today's date (Llama 3.2) make data that changes by the day;
    # SOURCE_DATE_EPOCH (the reproducible-builds convention) pins it.
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch else datetime.now()
    return when.strftime(fmt)


def parse_template_variables(items):
    """["enable_thinking=false", "name=\"x\""] -> {"enable_thinking": False, "name": "x"}; a
    value that is not JSON is taken as a string. Raises ChatError."""
    variables = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ChatError(f"--template-var {item!r}: expected NAME=VALUE (VALUE as JSON, e.g. enable_thinking=false)")
        try:
            variables[key] = json.loads(value)
        except json.JSONDecodeError:
            variables[key] = value
    return variables


def find_chat_template(folder):
    """(template source, where it came from) for a tokenizer folder, or (None, None).

    Looked for as transformers does: chat_template.jinja, then chat_template.json,
    then tokenizer_config.json's "chat_template" (a string, or a list of named
    templates of which "default" is used)."""
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read(), jinja_path
    json_path = os.path.join(folder, "chat_template.json")
    if os.path.isfile(json_path):
        try:
            with open(json_path, encoding="utf-8") as f:
                source = json.load(f).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ChatError(f"{json_path}: not a JSON object with 'chat_template' ({e})") from None
        if isinstance(source, str):
            return source, json_path
    config_path = os.path.join(folder, "tokenizer_config.json")
    try:
        source = load_tokenizer_config(folder).get("chat_template")
    except TokenizerError as e:
        raise ChatError(str(e)) from None
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise ChatError(f"{config_path}: chat_template is a list without a 'default' template "
                            f"(names: {', '.join(map(str, named))})")
        source = named["default"]
    if source is None:
        return None, None
    if not isinstance(source, str):
        raise ChatError(f"{config_path}: chat_template must be a string or a list of named templates")
    return source, config_path + ":chat_template"


def check_messages(messages, where):
    """Raises ChatError naming the message that is not {role, content, ...}."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"{where}: 'messages' must be a non-empty array of "
                        f"{{\"role\": ..., \"content\": ...}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatError(f"{where}: messages[{i}] must be an object with a string 'role'")
        if message["role"] not in ROLES:
            raise ChatError(f"{where}: messages[{i}] has role {message['role']!r}; "
                            f"expected one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ChatError(f"{where}: messages[{i}] ({message['role']}) needs a string 'content' "
                            f"(it may be empty)")
        calls = message.get("tool_calls")
        if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)):
            raise ChatError(f"{where}: messages[{i}]: 'tool_calls' must be an array on an assistant message")


class ChatTemplate:
    """A compiled chat template with the tokenizer it writes tokens for."""

    def __init__(self, source, where, tokenizer, config):
        if jinja2 is None:
            raise ChatError(f"{where}: chat templates need the Python module 'jinja2' "
                            f"(Debian: apt-get install python3-jinja2)")
        self.source = source
        self.where = where
        self.tokenizer = tokenizer
        self.env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                 extensions=[GenerationBlocks, "jinja2.ext.loopcontrols"])
        self.env.filters["tojson"] = _tojson
        self.env.globals["raise_exception"] = _raise_exception
        self.env.globals["strftime_now"] = _strftime_now
        try:
            self.template = self.env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatError(f"{where}: template line {e.lineno}: {e.message}") from None
        self.tracker = self.env.extensions[GenerationBlocks.identifier]
        self.has_generation_blocks = self._uses_generation_blocks()
        # The special tokens a template sees, as transformers passes them.
        self.special = {}
        for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
            value = token_text(config.get(key))
            if value is not None:
                self.special[key] = value
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            self.special["additional_special_tokens"] = [token_text(t) for t in extra]
        self._end_of_turn = None
        self.variables = {}  # extra template variables (--template-var), e.g. enable_thinking

    @classmethod
    def from_folder(cls, folder, tokenizer, source_path=None):
        """The template of a tokenizer folder (or the file `source_path`), or None."""
        config = load_tokenizer_config(folder)
        if source_path is not None:
            if not os.path.isfile(source_path):
                raise ChatError(f"{source_path}: chat template file does not exist")
            with open(source_path, encoding="utf-8") as f:
                source, where = f.read(), source_path
        else:
            source, where = find_chat_template(folder)
            if source is None:
                return None
        return cls(source, where, tokenizer, config)

    def _uses_generation_blocks(self):
        try:
            parsed = self.env.parse(self.source)
        except jinja2.exceptions.TemplateSyntaxError:
            return False
        return any(isinstance(node.call, nodes.Call) and isinstance(node.call.node, nodes.ExtensionAttribute)
                   and node.call.node.name == "_record" for node in parsed.find_all(nodes.CallBlock))

    # ------------------------------------------------------------------ rendering

    def render(self, messages, tools=None, add_generation_prompt=False, spans=None, where=None, **extra):
        """The chat as text. With `spans` a list, generation blocks append their
        (start, end) character spans to it. `where` prefixes an error."""
        context = dict(self.special)
        context.update(self.variables)
        context.update(messages=messages, tools=tools, documents=None,
                       add_generation_prompt=add_generation_prompt, **extra)
        pieces = []
        self.tracker.spans = spans
        self.tracker.rendered_chars = 0
        try:
            for piece in self.template.generate(**context):
                pieces.append(piece)
                self.tracker.rendered_chars += len(piece)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError(f"{where + ': ' if where else ''}the chat template ({self.where}) failed: {e}") from None
        finally:
            self.tracker.spans = None
        return "".join(pieces)

    def end_of_turn_tokens(self):
        """The template's end-of-turn token (first special token after a probe
        assistant answer) and the tokenizer's EOS."""
        if self._end_of_turn is None:
            found = []
            eos = self.special.get("eos_token")
            try:
                text = self.render([{"role": "user", "content": PROBE_QUESTION},
                                    {"role": "assistant", "content": PROBE_ANSWER}])
            except ChatError:
                text = ""
            after = text.find(PROBE_ANSWER)
            if after >= 0:
                ids, ends = self.tokenizer.encode_with_offsets(text)
                for token_id, end in zip(ids, ends):
                    if end > after + len(PROBE_ANSWER) and self.tokenizer.is_special(token_id):
                        found.append(self.tokenizer.id_to_token(token_id))
                        break
            if eos and eos not in found:
                found.append(eos)
            self._end_of_turn = found
        return self._end_of_turn

    def generation_prompt(self):
        """What add_generation_prompt adds after a user turn ('' if the template
        writes the same either way)."""
        question = [{"role": "user", "content": PROBE_QUESTION}]
        without = self.render(question)
        with_prompt = self.render(question, add_generation_prompt=True)
        if with_prompt.startswith(without) and len(with_prompt) > len(without):
            return with_prompt[len(without):]
        return ""  # the template ignores add_generation_prompt (it always writes the header)

    def assistant_spans(self, messages, tools=None, where="chat"):
        """(text, [(start, end)]): the whole chat and the character spans that carry loss."""
        check_messages(messages, where)
        if self.has_generation_blocks:
            spans = []
            text = self.render(messages, tools=tools, spans=spans, where=where)
            return text, [s for s in spans if s[1] > s[0]]
        text = self.render(messages, tools=tools, where=where)
        end_tokens = self.end_of_turn_tokens()
        spans = []
        searched_from = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = None
            try:
                prompt = self.render(messages[:i], tools=tools, add_generation_prompt=True)
            except ChatError:
                prompt = None
            common = 0
            if prompt is not None and not text.startswith(prompt):
                # The prompt may differ from the chat after the assistant's header (Qwen3 with
                # enable_thinking=false prompts with an empty think block that history does
                # not keep): where both still agree past the earlier messages is the start.
                try:
                    before = self.render(messages[:i], tools=tools)
                except ChatError:
                    before = None
                if before is not None and text.startswith(before):
                    # Back to the end of a line or of an added token, so that a header is
                    # never cut in the middle ("<|" of two different tokens).
                    common = len(os.path.commonprefix([text, prompt]))
                    while common > len(before) and text[common - 1] != "\n" and not any(
                            text.endswith(token, 0, common) for token in self.tokenizer.added):
                        common -= 1
                    common = common if common > len(before) else 0
            if prompt is not None and text.startswith(prompt) and len(prompt) >= searched_from:
                start = len(prompt)
            elif common >= searched_from and common > 0:
                start = common
            else:
                header = self.generation_prompt() or (prompt if i == 0 else "")
                at = text.find(header, searched_from) if header else -1
                if at < 0:
                    raise ChatError(f"{where}: messages[{i}] (assistant): the prompt the chat template "
                                    f"renders before it is not where the whole chat has it, so its "
                                    f"loss cannot be placed")
                start = at + len(header)
            best = None
            for token in end_tokens:
                at = text.find(token, start)
                if at >= 0 and (best is None or at < best):
                    best = at + len(token)
            if best is not None:
                end = best
            else:  # a template that writes no end-of-turn token: the turn ends where its rendering does
                try:
                    turn = self.render(messages[:i + 1], tools=tools)
                except ChatError:
                    turn = None
                if turn is None or not text.startswith(turn) or len(turn) < start:
                    raise ChatError(f"{where}: messages[{i}] (assistant): no end-of-turn token "
                                    f"({', '.join(end_tokens) or 'none known'}) after it in the rendered chat")
                end = len(turn)
            spans.append((start, end))
            searched_from = end
        return text, spans

    def encode_chat(self, messages, tools=None, where="chat"):
        """(ids, mask): the rendered chat's tokens and 1 where they carry loss."""
        text, spans = self.assistant_spans(messages, tools, where)
        if self.tokenizer.nfc:
            normalized = unicodedata.normalize("NFC", text)
            if normalized != text:
                # Tokenize the normalized text (what the tokenizer would see anyway) so that
                # every token has its own offsets; the spans' ends are at the template's own
                # text (headers, special tokens), where the normalized prefix is a prefix.
                spans = [(len(unicodedata.normalize("NFC", text[:a])), len(unicodedata.normalize("NFC", text[:b])))
                         for a, b in spans]
                text = normalized
        ids, ends = self.tokenizer.encode_with_offsets(text)
        mask = [0] * len(ids)
        k = 0
        for start, end in spans:
            while k < len(ids) and ends[k] <= start:
                k += 1
            j = k
            while j < len(ids):
                token_start = ends[j - 1] if j > 0 else 0
                if token_start >= end:
                    break
                mask[j] = 1
                j += 1
        return ids, mask

    def encode_prompt(self, messages, tools=None, where="prompt"):
        """(text, ids) of messages followed by the generation prompt (RL prompts)."""
        check_messages(messages, where)
        text = self.render(messages, tools=tools, add_generation_prompt=True, where=where)
        return text, self.tokenizer.encode(text)

    def encode_observation(self, messages, observation, tools=None, where="observation"):
        """The ids an environment hands the policy after its turn: what follows the
        last assistant message of `messages` (its end-of-turn token, where the
        policy stopped, included in that turn) through `observation` (tool results,
        a user message: a list of messages) to the next assistant turn's
        generation prompt. The prompt's ids, then each drawn turn and each
        observation's, are the ids apply_chat_template gives the whole chat
        (tests/scripts/lib/tokenizer_cases.py). Raises ChatError when the
        template renders the earlier turns otherwise once the chat goes on
        (Qwen3 drops the think blocks of turns before the last user message: a
        user turn after a turn that thought, or whose empty think block the
        template wrote, cannot continue it)."""
        check_messages(list(messages) + list(observation), where)
        if not messages or messages[-1].get("role") != "assistant":
            raise ChatError(f"{where}: the chat so far must end with the assistant's turn")
        if not observation:
            raise ChatError(f"{where}: no messages to observe")
        ids, mask = self.encode_chat(messages, tools, where)
        last = max((i for i, m in enumerate(mask) if m), default=-1) + 1  # the end of the assistant's last turn
        _, whole = self.encode_prompt(list(messages) + list(observation), tools, where)
        if last == 0 or whole[:last] != ids[:last]:
            k = next((i for i in range(min(last, len(whole))) if whole[i] != ids[i]), min(last, len(whole)))
            raise ChatError(f"{where}: the template renders the chat so far otherwise once it goes on (from token "
                            f"{k}: {self.tokenizer.decode(ids[k:k + 12])!r} becomes "
                            f"{self.tokenizer.decode(whole[k:k + 12])!r}); the policy's ids cannot be continued")
        return whole[last:]

    def encode_episode(self, messages, tools=None, where="episode"):
        """(ids, mask) of a chat as an environment's episode builds it: the prompt
        (the messages before the first assistant turn, with the generation
        prompt), then each assistant turn as the policy draws it (its last loss
        run when it is the chat's last message: its text and end-of-turn token)
        and each observation's ids (encode_observation) between the turns; the
        mask is 1 on the drawn turns only. Ends with the last assistant turn."""
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not turns or turns[0] == 0:
            raise ChatError(f"{where}: an episode starts with a prompt and holds at least one assistant turn")
        ids = list(self.encode_prompt(messages[:turns[0]], tools, where)[1])
        mask = [0] * len(ids)
        prev = None
        for a in turns:
            if prev is not None:
                obs = self.encode_observation(messages[:prev + 1], messages[prev + 1:a], tools, where)
                ids += obs
                mask += [0] * len(obs)
            drawn_ids, drawn_mask = self.encode_chat(messages[:a + 1], tools, where)
            end = max(i for i, m in enumerate(drawn_mask) if m) + 1
            start = end
            while start > 0 and drawn_mask[start - 1]:
                start -= 1
            ids += drawn_ids[start:end]
            mask += [1] * (end - start)
            prev = a
        return ids, mask


def parse_tool_calls(text):
    """The tool calls of an assistant turn in Qwen3's (and Qwen2.5's) format,
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, in order: a list of
    (name, arguments) for the well-formed ones and a list of error strings for
    the others (not JSON, no name, arguments not an object, an unclosed tag)."""
    calls, errors = [], []
    rest = text
    while True:
        start = rest.find("<tool_call>")
        if start < 0:
            break
        end = rest.find("</tool_call>", start)
        if end < 0:
            errors.append("a <tool_call> without its </tool_call>")
            break
        body = rest[start + len("<tool_call>"):end].strip()
        rest = rest[end + len("</tool_call>"):]
        try:
            call = json.loads(body)
        except ValueError as e:
            errors.append(f"not JSON ({e}): {body[:80]!r}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            errors.append(f"no \"name\": {body[:80]!r}")
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            errors.append(f"\"arguments\" of {call['name']} is not an object: {body[:80]!r}")
            continue
        calls.append((call["name"], arguments))
    return calls, errors
