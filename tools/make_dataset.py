#!/usr/bin/env python3
"""make_dataset.py — turn text or JSONL into a shardlm SFT token file (HDF5).

Run it with an interpreter that has h5py and numpy, e.g. /usr/bin/python3:

    /usr/bin/python3 tools/make_dataset.py -o data.h5 --split paragraphs notes.txt
    /usr/bin/python3 tools/make_dataset.py -o sft.h5 --append-eos train.jsonl
    /usr/bin/python3 tools/make_dataset.py -o sft.h5 --tokenizer /models/Qwen3-8B chats.jsonl

Inputs: text files (each file, or with --split paragraphs each blank-line
separated paragraph, is one document) and JSONL files (.jsonl, .ndjson, .json)
with one object per line:
    {"text": "..."}                                   loss on every token
    {"prompt": "...", "completion": "..."}            loss on completion tokens only
    {"messages": [{"role": "user", "content": "..."}, ...]}
                                                      loss on assistant turns only
With --tokenizer a tokenizer.json (or its model folder; read by tools/hf_tokenizer.py)
chats are rendered with the model's own chat template when one comes with it
(tools/chat_template.py), else in shardlm's format.

Large sets: documents are streamed to disk as they are tokenized (memory
stays at one block of tokens); --compression gzip writes chunked, compressed
datasets; --eval-output with --eval-fraction or --eval-docs holds documents
out into a second file (a seeded, reproducible choice).

Output layout and the chat template: docs/data.md. Exit status: 0 written,
1 bad input (every problem is reported as FILE:LINE: reason, nothing is
written), 2 bad command line.
"""

import argparse
import hashlib
import json
import os
import re
import struct
import sys
import multiprocessing
import tempfile

try:
    import h5py
    import numpy as np
except ImportError as missing:  # pragma: no cover - depends on the interpreter
    sys.exit(f"make_dataset.py: {missing}; run it with an interpreter that has h5py and numpy "
             f"(e.g. /usr/bin/python3 tools/make_dataset.py ...)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_tokenizer import Tokenizer, TokenizerError, load_tokenizer_config, token_text  # noqa: E402
from chat_template import ChatError, ChatTemplate, check_messages, parse_template_variables  # noqa: E402

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
MAX_REPORTED_ERRORS = 50
COPY_BLOCK = 1 << 24  # elements moved at a time from the staging files into HDF5


class InputError(Exception):
    """A problem with one input, already formatted as 'FILE[:LINE]: reason'."""


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 = BOS, 257 = EOS; vocab_size 258."""

    name = "byte"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


class HFTokenizer:
    """A Hugging Face tokenizer.json (or the model folder that holds one) read by
    shardlm's own tools/hf_tokenizer.py, with the chat template that comes with it
    (chat_template.jinja, chat_template.json or tokenizer_config.json beside it)."""

    def __init__(self, path, bos_token, eos_token, chat_template="auto", template_vars=None):
        try:
            self.tokenizer = Tokenizer.load(path)
            folder = os.path.dirname(self.tokenizer.path)
            config = load_tokenizer_config(folder)
            self.template = None
            if chat_template != "none":
                self.template = ChatTemplate.from_folder(
                    folder, self.tokenizer, None if chat_template == "auto" else chat_template)
            if self.template is not None:
                self.template.variables = parse_template_variables(template_vars)
            elif template_vars:
                raise ChatError(f"{path}: --template-var is given but there is no chat template")
        except (TokenizerError, ChatError) as e:
            raise InputError(str(e)) from None
        self.name = self.tokenizer.path
        self.vocab_size = self.tokenizer.vocab_size
        self.bos_id = self._special_id(bos_token, token_text(config.get("bos_token")), "--bos-token", path)
        self.eos_id = self._special_id(eos_token, token_text(config.get("eos_token")), "--eos-token", path)

    def _special_id(self, flag_value, config_value, flag, path):
        token = flag_value if flag_value is not None else config_value
        if token is None:
            return None
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise InputError(f"{path}: token {token!r} (from {flag} or tokenizer_config.json) "
                             f"is not in the vocabulary")
        return token_id

    def encode(self, text):
        return np.asarray(self.tokenizer.encode(text), dtype=np.int32)


class Builder:
    """Turns records into documents: (ids int32, loss mask uint8), or None for a
    document with fewer than 2 tokens."""

    def __init__(self, tokenizer, prepend_bos, append_eos):
        self.tok = tokenizer
        self.template = getattr(tokenizer, "template", None)
        self.prepend_bos = prepend_bos
        self.append_eos = append_eos

    def special(self, which, where):
        token_id = self.tok.bos_id if which == "BOS" else self.tok.eos_id
        if token_id is None:
            raise InputError(f"{where}: the tokenizer has no {which} token; name one with "
                             f"--{which.lower()}-token")
        return np.asarray([token_id], dtype=np.int32)

    def document(self, pieces, where):
        """pieces: list of (ids, loss 0/1 or a per-token mask). Adds BOS as asked."""
        if self.prepend_bos:
            bos = self.special("BOS", where)
            if not (pieces and len(pieces[0][0]) and pieces[0][0][0] == bos[0]):  # a template may write it
                pieces = [(bos, 0)] + pieces
        ids = np.concatenate([p for p, _ in pieces]) if pieces else np.zeros(0, np.int32)
        mask = np.concatenate([np.full(len(p), loss, np.uint8) if np.isscalar(loss) else
                               np.asarray(loss, np.uint8) for p, loss in pieces]) if pieces else np.zeros(0, np.uint8)
        if len(ids) < 2:  # nothing to predict; the reader would skip it anyway
            return None
        return ids.astype(np.int32), mask

    def text(self, text, where):
        pieces = [(self.tok.encode(text), 1)]
        if self.append_eos:
            pieces.append((self.special("EOS", where), 1))
        return self.document(pieces, where)

    def prompt_completion(self, prompt, completion, where):
        pieces = [(self.tok.encode(prompt), 0), (self.tok.encode(completion), 1)]
        if self.append_eos:
            pieces.append((self.special("EOS", where), 1))
        return self.document(pieces, where)

    def chat(self, messages, tools, where):
        if self.template is not None:
            try:
                ids, mask = self.template.encode_chat(messages, tools, where)
            except ChatError as e:
                raise InputError(str(e)) from None
            return self.document([(np.asarray(ids, np.int32), mask)], where)
        if tools is not None:
            raise InputError(f"{where}: 'tools' needs the model's chat template, and this tokenizer has none")
        # shardlm's own format: each turn is "<|role|>\n" (no loss), the content,
        # then EOS as end of turn; content and EOS carry loss on assistant turns only.
        eos = self.special("EOS", where)
        pieces = []
        for message in messages:
            loss = 1 if message["role"] == "assistant" else 0
            pieces.append((self.tok.encode(f"<|{message['role']}|>\n"), 0))
            pieces.append((self.tok.encode(message["content"]), loss))
            pieces.append((eos, loss))
        return self.document(pieces, where)


def type_name(value):
    return {dict: "object", list: "array", str: "string", bool: "boolean",
            int: "number", float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def parse_record(record, where, builder):
    """Checks one JSONL object and returns its document; raises InputError."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type_name(record)}")
    kinds = [k for k in ("text", "prompt", "completion", "messages") if k in record]
    if "messages" in record:
        others = [k for k in kinds if k != "messages"]
        if others:
            raise InputError(f"{where}: has both 'messages' and {others[0]!r}; use one form per line")
        messages = record["messages"]
        try:
            check_messages(messages, where)
        except ChatError as e:
            raise InputError(str(e)) from None
        if not any(m["role"] == "assistant" for m in messages):
            raise InputError(f"{where}: 'messages' has no assistant turn, so nothing would carry loss")
        tools = record.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise InputError(f"{where}: 'tools' must be an array of tool schemas")
        return builder.chat(messages, tools, where)
    if "prompt" in record or "completion" in record:
        if "text" in record:
            raise InputError(f"{where}: has both 'text' and prompt/completion; use one form per line")
        for key in ("prompt", "completion"):
            if key not in record:
                raise InputError(f"{where}: has {'prompt' if key == 'completion' else 'completion'!r} "
                                 f"but no {key!r}")
            if not isinstance(record[key], str):
                raise InputError(f"{where}: {key!r} must be a string, got {type_name(record[key])}")
        if not record["completion"]:
            raise InputError(f"{where}: 'completion' is empty, so nothing would carry loss")
        return builder.prompt_completion(record["prompt"], record["completion"], where)
    if "text" in record:
        if not isinstance(record["text"], str):
            raise InputError(f"{where}: 'text' must be a string, got {type_name(record['text'])}")
        return builder.text(record["text"], where)
    found = ", ".join(repr(k) for k in record) or "none"
    raise InputError(f"{where}: expected 'text', 'prompt' and 'completion', or 'messages'; "
                     f"found keys: {found}")


def read_json_line(raw, where):
    """The JSON value of one JSONL line, None for a blank line; raises InputError."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None


def jobs(paths, kinds, split):
    """(kind, where, payload) in input order: one per JSONL line, one per text document."""
    for path, kind in zip(paths, kinds):
        if kind == "jsonl":
            with open(path, "rb") as f:
                for line_number, raw in enumerate(f, start=1):
                    yield ("line", f"{path}:{line_number}", raw)
            continue
        try:
            with open(path, encoding="utf-8") as f:
                content = f.read()
        except UnicodeDecodeError as e:
            yield ("error", path, f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})")
            continue
        if split == "paragraphs":
            documents = [p.strip() for p in re.split(r"\n[ \t]*\n", content)]
        else:
            documents = [content.strip()]
        for document in documents:
            if document:
                yield ("text", path, document)


# The builder a worker process uses (set before the pool forks, so workers share it).
WORKER_BUILDER = None


def run_job(job):
    """One job to ("doc", ids, mask), ("short",), ("blank",) or ("error", message)."""
    kind, where, payload = job
    try:
        if kind == "error":
            raise InputError(payload)
        if kind == "line":
            record = read_json_line(payload, where)
            if record is None:
                return ("blank",)
            document = parse_record(record, where, WORKER_BUILDER)
            if document is not None and "completion" in record and not WORKER_BUILDER.append_eos:
                return ("doc", document[0], document[1], "no-eos")
        else:
            document = WORKER_BUILDER.text(payload, where)
    except InputError as e:
        return ("error", str(e))
    if document is None:
        return ("short",)
    return ("doc", document[0], document[1])


class TokenFileWriter:
    """Streams documents to staging files beside OUT, then writes OUT.tmp
    (tokens, offsets, loss_mask when any target has no loss) and renames it.
    Memory: the offsets (8 bytes per document) and one copy block."""

    def __init__(self, path, compression, level, chunk_tokens):
        self.path = path
        self.compression = compression
        self.level = level
        self.chunk_tokens = chunk_tokens
        folder = os.path.dirname(os.path.abspath(path))
        self.tokens_file = tempfile.NamedTemporaryFile(dir=folder, prefix=".tokens.", delete=False)
        self.mask_file = tempfile.NamedTemporaryFile(dir=folder, prefix=".mask.", delete=False)
        self.offsets = [0]
        self.max_id = -1
        self.loss_targets = 0
        self.mask_needed = False  # some target carries no loss

    def add(self, ids, mask):
        self.tokens_file.write(ids.astype("<i4").tobytes())
        self.mask_file.write(mask.astype(np.uint8).tobytes())
        self.offsets.append(self.offsets[-1] + len(ids))
        self.max_id = max(self.max_id, int(ids.max()))
        targets = mask[1:]  # a document's first token is never a target
        self.loss_targets += int(targets.sum())
        self.mask_needed = self.mask_needed or bool(np.any(targets == 0))

    @property
    def documents(self):
        return len(self.offsets) - 1

    @property
    def tokens(self):
        return self.offsets[-1]

    def discard(self):
        for f in (self.tokens_file, self.mask_file):
            f.close()
            if os.path.exists(f.name):
                os.unlink(f.name)

    def _dataset(self, f, name, source, dtype, count):
        options = {"track_times": False}  # the same inputs give byte-identical files
        if self.compression == "gzip" and count > 0:
            options.update(chunks=(min(self.chunk_tokens, count),), compression="gzip",
                           compression_opts=self.level, shuffle=dtype.itemsize > 1)
        dset = f.create_dataset(name, shape=(count,), dtype=dtype, **options)
        if count == 0:
            return
        staged = np.memmap(source, dtype=dtype, mode="r", shape=(count,))
        block = COPY_BLOCK
        if self.compression == "gzip":  # whole chunks per write
            block = max(self.chunk_tokens, block // self.chunk_tokens * self.chunk_tokens)
        for start in range(0, count, block):
            dset[start:start + block] = staged[start:start + block]
        del staged

    def finish(self, tokenizer_name, tokenizer_vocab_size, chat_template=None):
        for f in (self.tokens_file, self.mask_file):
            f.close()
        vocab_size = max(int(tokenizer_vocab_size), self.max_id + 1)
        tmp = self.path + ".tmp"
        try:
            with h5py.File(tmp, "w") as f:
                self._dataset(f, "tokens", self.tokens_file.name, np.dtype("<i4"), self.tokens)
                f.create_dataset("offsets", data=np.asarray(self.offsets, dtype=np.int64), track_times=False)
                if self.mask_needed:
                    self._dataset(f, "loss_mask", self.mask_file.name, np.dtype(np.uint8), self.tokens)
                f.attrs["vocab_size"] = np.int64(vocab_size)
                f.attrs["tokenizer"] = tokenizer_name
                if chat_template is not None:
                    f.attrs["chat_template"] = chat_template
            os.replace(tmp, self.path)
        finally:
            self.discard()
            if os.path.exists(tmp):
                os.unlink(tmp)
        return vocab_size


def document_draw(seed, index):
    """A uniform number in [0, 1) for (seed, document index): the held-out choice."""
    digest = hashlib.blake2b(struct.pack("<qq", seed, index), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


class Splitter:
    """Sends each document to the training writer or holds it out for eval.

    --eval-fraction F: document i is held out when its draw (seed, i) < F.
    --eval-docs N: exactly N documents (or all if fewer), a uniform seeded
    choice kept as a reservoir (Algorithm R); the ones it lets go go to
    training. Held-out documents keep their input order."""

    def __init__(self, train, held_out, fraction, count, seed):
        self.train = train
        self.held_out = held_out  # the eval file's writer (--eval-fraction streams into it)
        self.fraction = fraction
        self.count = count
        self.seed = seed
        self.index = 0
        self.held = []  # --eval-docs: the reservoir, (index, ids, mask)

    def add(self, ids, mask):
        i = self.index
        self.index += 1
        if self.fraction is not None:
            if document_draw(self.seed, i) < self.fraction:
                self.held_out.add(ids, mask)
            else:
                self.train.add(ids, mask)
            return
        if len(self.held) < self.count:
            self.held.append((i, ids, mask))
            return
        slot = int(document_draw(self.seed, i) * (i + 1))  # uniform in [0, i]
        if slot < self.count:
            _, out_ids, out_mask = self.held[slot]
            self.held[slot] = (i, ids, mask)
            self.train.add(out_ids, out_mask)
        else:
            self.train.add(ids, mask)

    def finish(self):
        for _, ids, mask in sorted(self.held, key=lambda item: item[0]):
            self.held_out.add(ids, mask)
        self.held = []


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Tokenize text/JSONL into a shardlm token file (tokens, offsets, loss_mask).")
    parser.add_argument("inputs", nargs="+", help="text or JSONL files")
    parser.add_argument("-o", "--output", required=True, help="HDF5 file to write")
    parser.add_argument("--format", choices=("auto", "text", "jsonl"), default="auto",
                        help="input kind; auto: .jsonl/.ndjson/.json are JSONL, the rest text")
    parser.add_argument("--split", choices=("file", "paragraphs"), default="file",
                        help="text inputs: one document per file, or per blank-line separated paragraph")
    parser.add_argument("--tokenizer", default="byte",
                        help="'byte' (default; ids 0..255 bytes, 256 BOS, 257 EOS), a tokenizer.json, "
                             "or the model folder holding one")
    parser.add_argument("--chat-template", default="auto",
                        help="chats: 'auto' (default) renders them with the tokenizer's own chat template "
                             "when it has one, else in shardlm's format; 'none' always shardlm's format; "
                             "or a Jinja template file")
    parser.add_argument("--template-var", action="append", metavar="NAME=VALUE",
                        help="a variable for the chat template, VALUE as JSON (e.g. enable_thinking=false "
                             "for Qwen3); repeatable")
    parser.add_argument("--workers", type=int,
                        help="tokenizing processes (default: the cores this process may use, at most 32, for a tokenizer.json; "
                             "1 for byte)")
    parser.add_argument("--bos-token", help="BOS token string for a tokenizer.json tokenizer")
    parser.add_argument("--eos-token", help="EOS token string for a tokenizer.json tokenizer")
    parser.add_argument("--prepend-bos", action="store_true", help="start every document with BOS")
    parser.add_argument("--append-eos", action="store_true",
                        help="end text and prompt/completion documents with EOS (which carries loss)")
    parser.add_argument("--max-docs", type=int, help="stop after this many documents")
    parser.add_argument("--compression", choices=("none", "gzip"), default="none",
                        help="none: contiguous datasets (default; fastest to read); gzip: chunked, "
                             "byte-shuffled and deflated")
    parser.add_argument("--compression-level", type=int, default=4, help="gzip level 1..9 (default 4)")
    parser.add_argument("--chunk-tokens", type=int, default=65536,
                        help="elements per chunk with --compression gzip (default 65536)")
    parser.add_argument("--eval-output", help="HDF5 file for the held-out documents")
    parser.add_argument("--eval-fraction", type=float, help="hold out about this fraction of documents")
    parser.add_argument("--eval-docs", type=int, help="hold out exactly this many documents")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the held-out choice (default 0)")
    args = parser.parse_args(argv)
    if args.max_docs is not None and args.max_docs < 1:
        parser.error("--max-docs must be at least 1")
    if not 1 <= args.compression_level <= 9:
        parser.error("--compression-level must be between 1 and 9")
    if args.chunk_tokens < 1:
        parser.error("--chunk-tokens must be at least 1")
    if (args.eval_fraction is None) == (args.eval_docs is None):
        if args.eval_output:
            parser.error("--eval-output needs one of --eval-fraction or --eval-docs")
    elif not args.eval_output:
        parser.error("--eval-fraction and --eval-docs need --eval-output")
    if args.eval_fraction is not None and not 0 < args.eval_fraction < 1:
        parser.error("--eval-fraction must be between 0 and 1 (exclusive)")
    if args.eval_docs is not None and args.eval_docs < 1:
        parser.error("--eval-docs must be at least 1")
    if args.eval_output and os.path.abspath(args.eval_output) == os.path.abspath(args.output):
        parser.error("--eval-output must differ from --output")
    if args.workers is not None and args.workers < 1:
        parser.error("--workers must be at least 1")

    try:
        tokenizer = ByteTokenizer() if args.tokenizer == "byte" else \
            HFTokenizer(args.tokenizer, args.bos_token, args.eos_token, args.chat_template, args.template_var)
    except InputError as e:
        print(f"make_dataset.py: {e}", file=sys.stderr)
        return 1
    train = TokenFileWriter(args.output, args.compression, args.compression_level, args.chunk_tokens)
    held_out = TokenFileWriter(args.eval_output, args.compression, args.compression_level, args.chunk_tokens) \
        if args.eval_output else None
    splitter = Splitter(train, held_out, args.eval_fraction, args.eval_docs, args.split_seed) if held_out else None
    global WORKER_BUILDER
    WORKER_BUILDER = Builder(tokenizer, args.prepend_bos, args.append_eos)
    try:
        return run(args, tokenizer, splitter.add if splitter else train.add, train, splitter)
    finally:
        train.discard()
        if held_out:
            held_out.discard()


def run(args, tokenizer, sink, train, splitter):
    errors = []
    paths, kinds = [], []
    for path in args.inputs:
        if not os.path.isfile(path):
            errors.append(f"{path}: input file does not exist")
            continue
        kind = args.format
        if kind == "auto":
            kind = "jsonl" if path.lower().endswith(JSONL_SUFFIXES) else "text"
        paths.append(path)
        kinds.append(kind)

    # Documents are tokenized by a pool of forked processes (they share the
    # tokenizer built above) and come back in input order.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = args.workers or (1 if args.tokenizer == "byte" else min(cores, 32))
    pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else None
    results = pool.imap(run_job, jobs(paths, kinds, args.split), chunksize=64) if pool else \
        map(run_job, jobs(paths, kinds, args.split))
    documents = skipped_short = without_eos = 0
    try:
        for result in results:
            if args.max_docs is not None and documents >= args.max_docs:
                break
            if result[0] == "doc":
                documents += 1
                without_eos += len(result) > 3
                sink(result[1], result[2])
            elif result[0] == "short":
                skipped_short += 1
            elif result[0] == "error":
                errors.append(result[1])
    finally:
        if pool:
            pool.terminate()
            pool.join()

    if not errors and documents == 0:
        errors.append("no document with at least 2 tokens in the inputs; nothing to write")
    if splitter:
        splitter.finish()
    if not errors and splitter and splitter.held_out.documents == 0:
        errors.append(f"no document was held out for {args.eval_output} ({documents} documents, "
                      f"--eval-fraction {args.eval_fraction}); raise the fraction or use --eval-docs")
    if not errors and splitter and train.documents == 0:
        errors.append(f"every document was held out for {args.eval_output}; nothing is left to train on")
    if errors:
        for message in errors[:MAX_REPORTED_ERRORS]:
            print(message, file=sys.stderr)
        if len(errors) > MAX_REPORTED_ERRORS:
            print(f"... and {len(errors) - MAX_REPORTED_ERRORS} more", file=sys.stderr)
        print(f"make_dataset.py: {len(errors)} error(s); {args.output} not written", file=sys.stderr)
        return 1

    if without_eos:
        print(f"make_dataset.py: note: {without_eos} prompt/completion documents end without EOS, so the model "
              f"is not taught to stop; add --append-eos, or give them as chats ({{\"messages\": [...]}}), "
              f"which the model's chat template ends as it serves them", file=sys.stderr)
    skipped = f", {skipped_short} skipped (< 2 tokens)" if skipped_short else ""
    storage = f"gzip {args.compression_level}, chunks of {args.chunk_tokens}" if args.compression == "gzip" \
        else "contiguous"
    outputs = [(args.output, train)] + ([(args.eval_output, splitter.held_out)] if splitter else [])
    for path, writer in outputs:
        documents, tokens, loss = writer.documents, writer.tokens, writer.loss_targets
        template = getattr(tokenizer, "template", None)
        vocab_size = writer.finish(tokenizer.name, tokenizer.vocab_size, template.source if template else None)
        print(f"wrote {path}: {documents} documents{skipped if writer is train else ''}, {tokens} tokens, "
              f"{loss} loss targets, vocab_size {vocab_size}, tokenizer {tokenizer.name}, {storage}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
