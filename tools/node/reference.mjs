// reference.mjs — what implementations nobody here wrote make of a test request, for
// tests/scripts/test_tokenizer.sh: token ids from @huggingface/tokenizers (pure JS) and
// chat templates rendered by @huggingface/jinja (transformers.js' Jinja).
//   node tools/node/reference.mjs REQUEST.json > ANSWER.json
// REQUEST: {"tokenizer_dir": DIR (tokenizer.json + tokenizer_config.json),
//           "encode": [text, ...], "decode": [[id, ...], ...],
//           "render": [{"messages": [...], "tools": [...] | null, "add_generation_prompt": bool}, ...]}
// ANSWER:  {"encode": [[id, ...], ...], "decode": [text, ...], "render": [text | {"error": message}, ...],
//           "render_ids": [[id, ...] (the rendered text's tokens) | null, ...]}
import fs from "node:fs";
import path from "node:path";
import { Tokenizer } from "@huggingface/tokenizers";
import { Template } from "@huggingface/jinja";

const request = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const dir = request.tokenizer_dir;
const tokenizerJson = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8"));
const config = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8"));
const tokenizer = new Tokenizer(tokenizerJson, config);

const answer = { encode: [], decode: [], render: [], render_ids: [] };
for (const text of request.encode ?? []) {
  answer.encode.push(tokenizer.encode(text, { add_special_tokens: false }).ids);
}
for (const ids of request.decode ?? []) {
  answer.decode.push(ids.length === 0 ? "" : tokenizer.decode(ids, { skip_special_tokens: false, clean_up_tokenization_spaces: false }));
}
if ((request.render ?? []).length > 0) {
  const template = new Template(config.chat_template);
  const text = (t) => (t && typeof t === "object" ? t.content : t);
  const specials = {};
  for (const key of ["bos_token", "eos_token", "unk_token", "pad_token"]) {
    if (config[key] != null) specials[key] = text(config[key]);
  }
  for (const chat of request.render) {
    try {
      const rendered = template.render({ ...specials, messages: chat.messages, tools: chat.tools ?? null,
                                         add_generation_prompt: chat.add_generation_prompt ?? false });
      answer.render.push(rendered);
      answer.render_ids.push(tokenizer.encode(rendered, { add_special_tokens: false }).ids);
    } catch (e) {
      answer.render.push({ error: String(e.message ?? e) });
      answer.render_ids.push(null);
    }
  }
}
process.stdout.write(JSON.stringify(answer));
