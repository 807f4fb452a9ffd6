"""hf_tokenizer.py — shardlm's own reader of Hugging Face `tokenizer.json` files.

Byte-level BPE as Llama 3 / 3.1 / 3.2 and Qwen2 / 2.5 / 3 use it: added (special)
tokens split out first, an optional NFC normalizer, the Split-regex + ByteLevel
pre-tokenizer (or ByteLevel with its own GPT-2 regex), BPE merges by rank
(`ignore_merges` honoured), and the ByteLevel decoder. Needs only Python's
standard library and `regex` (Debian: python3-regex) for the \\p{L} / \\p{N}
classes of the pre-tokenizer patterns. Anything else a tokenizer.json may hold
(WordPiece, Unigram, byte_fallback, other normalizers) is refused by name.

    tok = Tokenizer.load("/models/Qwen3-8B")          # a tokenizer.json or its folder
    ids = tok.encode("Hello <|im_start|>")            # added tokens are matched in the text
    tok.decode(ids) == "Hello <|im_start|>"
    tok.decode_bytes(ids)                             # byte-exact (a token may hold part of a character)

Token ids are what the `tokenizers` package and transformers give with
add_special_tokens=False (tests/scripts/test_tokenizer.sh checks this against
the pure-JS @huggingface/tokenizers on the real Llama 3 and Qwen3 files). The
post-processor (a BOS Llama 3.1's TemplateProcessing adds) is not applied:
shardlm's tools add BOS / EOS themselves, or the chat template writes them.
"""

import json
import os
import unicodedata

try:
    import regex
except ImportError:  # pragma: no cover - depends on the interpreter
    regex = None

# The GPT-2 pre-tokenizer pattern ByteLevel uses when `use_regex` is true.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Pieces longer than this are not remembered (a long whitespace or digit run
# would fill the cache with strings seen once).
CACHE_PIECE_CHARS = 64
CACHE_ENTRIES = 1 << 20


class TokenizerError(Exception):
    """A tokenizer file that cannot be read or is not supported; says which and why."""


def byte_to_char_table():
    """The ByteLevel alphabet: every byte is shown as one printable character.

    Printable Latin-1 bytes (! .. ~, ¡ .. ¬, ® .. ÿ) stand for themselves; the
    other 68 bytes, in increasing order, take U+0100, U+0101, ... ."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = byte_to_char_table()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
# str.translate table from Latin-1 code points (one per byte) to the alphabet.
LATIN1_TO_ALPHABET = {b: ord(c) for b, c in BYTE_TO_CHAR.items()}


def find_tokenizer_files(path):
    """(tokenizer.json, folder) from a tokenizer.json path or a model folder."""
    if os.path.isdir(path):
        candidate = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(candidate):
            raise TokenizerError(f"{path}: folder has no tokenizer.json")
        return candidate, path
    if not os.path.isfile(path):
        raise TokenizerError(f"{path}: tokenizer file does not exist")
    return path, os.path.dirname(os.path.abspath(path))


class AddedToken:
    __slots__ = ("id", "content", "special", "lstrip", "rstrip", "normalized")

    def __init__(self, entry, where):
        try:
            self.id = int(entry["id"])
            self.content = str(entry["content"])
        except (KeyError, TypeError, ValueError):
            raise TokenizerError(f"{where}: an added_tokens entry needs 'id' and 'content': {entry!r}") from None
        self.special = bool(entry.get("special", False))
        self.lstrip = bool(entry.get("lstrip", False))
        self.rstrip = bool(entry.get("rstrip", False))
        self.normalized = bool(entry.get("normalized", not self.special))
        if entry.get("single_word"):
            raise TokenizerError(f"{where}: added token {self.content!r} has single_word = true, "
                                 f"which this reader does not support")


class Tokenizer:
    """A byte-level BPE tokenizer.json: encode, decode, and the vocabulary."""

    def __init__(self, spec, where="tokenizer.json"):
        if regex is None:
            raise TokenizerError(f"{where}: tokenizers need the Python module 'regex' "
                                 f"(Debian: apt-get install python3-regex)")
        self.where = where
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
            raise TokenizerError(f"{where}: not a tokenizer.json (no 'model' object)")
        self._read_model(spec["model"])
        self._read_normalizer(spec.get("normalizer"))
        self._read_pre_tokenizer(spec.get("pre_tokenizer"))
        self._read_decoder(spec.get("decoder"))
        self._read_added_tokens(spec.get("added_tokens") or [])
        self.cache = {}

    @classmethod
    def load(cls, path):
        """From a tokenizer.json or the folder that holds one."""
        json_path, _ = find_tokenizer_files(path)
        try:
            with open(json_path, encoding="utf-8") as f:
                spec = json.load(f)
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{json_path}: invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{json_path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        tok = cls(spec, json_path)
        tok.path = json_path
        return tok

    # ------------------------------------------------------------------ reading

    def _read_model(self, model):
        where = self.where
        kind = model.get("type", "BPE" if "merges" in model else None)
        if kind != "BPE":
            raise TokenizerError(f"{where}: model type {kind!r} is not supported (only byte-level BPE)")
        if model.get("byte_fallback"):
            raise TokenizerError(f"{where}: BPE with byte_fallback (SentencePiece-style, Llama 2) "
                                 f"is not supported")
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise TokenizerError(f"{where}: BPE with a subword prefix or suffix is not supported")
        if model.get("dropout"):
            raise TokenizerError(f"{where}: BPE dropout is not supported")
        vocab = model.get("vocab")
        if not isinstance(vocab, dict) or not vocab:
            raise TokenizerError(f"{where}: model.vocab must be a non-empty object")
        self.vocab = vocab  # alphabet string -> id
        self.ignore_merges = bool(model.get("ignore_merges", False))
        self.ranks = {}
        for rank, merge in enumerate(model.get("merges") or []):
            pair = merge.split(" ", 1) if isinstance(merge, str) else merge
            if len(pair) != 2:
                raise TokenizerError(f"{where}: model.merges[{rank}] is not a pair: {merge!r}")
            self.ranks.setdefault((pair[0], pair[1]), rank)

    def _read_normalizer(self, normalizer):
        self.nfc = False
        if normalizer is None:
            return
        kind = normalizer.get("type")
        if kind == "NFC":
            self.nfc = True
        elif kind == "Sequence" and not normalizer.get("normalizers"):
            pass
        else:
            raise TokenizerError(f"{self.where}: normalizer {kind!r} is not supported (none or NFC)")

    def _read_pre_tokenizer(self, pre):
        where = self.where
        steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
        pattern = None
        byte_level = False
        for step in steps:
            kind = step.get("type")
            if kind == "Split":
                if pattern is not None or byte_level:
                    raise TokenizerError(f"{where}: only one Split, before ByteLevel, is supported")
                if step.get("behavior") != "Isolated" or step.get("invert"):
                    raise TokenizerError(f"{where}: Split with behavior {step.get('behavior')!r} "
                                         f"invert {step.get('invert')!r} is not supported (Isolated only)")
                source = step.get("pattern", {})
                if "Regex" in source:
                    pattern = source["Regex"]
                elif "String" in source:
                    pattern = regex.escape(source["String"])
                else:
                    raise TokenizerError(f"{where}: Split pattern {source!r} has no Regex or String")
            elif kind == "ByteLevel":
                byte_level = True
                if step.get("add_prefix_space"):
                    raise TokenizerError(f"{where}: ByteLevel add_prefix_space = true is not supported")
                if step.get("use_regex", True):
                    if pattern is not None:
                        raise TokenizerError(f"{where}: a Split followed by ByteLevel use_regex is not supported")
                    pattern = GPT2_PATTERN
            else:
                raise TokenizerError(f"{where}: pre-tokenizer {kind!r} is not supported "
                                     f"(Split and ByteLevel only)")
        if not byte_level:
            raise TokenizerError(f"{where}: no ByteLevel pre-tokenizer; only byte-level BPE is supported")
        try:
            self.split_pattern = regex.compile(pattern or r"(?s).+")
        except regex.error as e:
            raise TokenizerError(f"{where}: the Split pattern does not compile: {e}") from None

    def _read_decoder(self, decoder):
        if decoder is not None and decoder.get("type") != "ByteLevel":
            raise TokenizerError(f"{self.where}: decoder {decoder.get('type')!r} is not supported (ByteLevel)")

    def _read_added_tokens(self, entries):
        self.added = {}  # content -> AddedToken
        self.id_to_added = {}
        for entry in entries:
            token = AddedToken(entry, self.where)
            self.added[token.content] = token
            self.id_to_added[token.id] = token
        self.id_to_piece = {i: s for s, i in self.vocab.items()}
        biggest = max(max(self.vocab.values()), max(self.id_to_added, default=-1))
        self.vocab_size = biggest + 1
        # Bytes of every id, for decoding: vocabulary pieces through the alphabet,
        # added tokens as their UTF-8 text.
        self.id_bytes = [b""] * self.vocab_size
        for piece, i in self.vocab.items():
            try:
                self.id_bytes[i] = bytes(CHAR_TO_BYTE[c] for c in piece)
            except KeyError:
                self.id_bytes[i] = piece.encode("utf-8")
        for i, token in self.id_to_added.items():
            self.id_bytes[i] = token.content.encode("utf-8")
        if self.added:
            # Longest first, so that a token that starts another is not matched early.
            contents = sorted(self.added, key=lambda s: (-len(s), s))
            self.added_pattern = regex.compile("|".join(regex.escape(c) for c in contents))
        else:
            self.added_pattern = None

    # ------------------------------------------------------------------ lookups

    def token_to_id(self, token):
        if token in self.added:
            return self.added[token].id
        return self.vocab.get(token)

    def id_to_token(self, token_id):
        if token_id in self.id_to_added:
            return self.id_to_added[token_id].content
        return self.id_to_piece.get(token_id)

    def is_special(self, token_id):
        token = self.id_to_added.get(token_id)
        return token is not None and token.special

    def special_tokens(self):
        return [t.content for t in self.id_to_added.values() if t.special]

    # ------------------------------------------------------------------ encoding

    def _segments(self, text):
        """(is_added, text) pieces: added tokens matched in the text, lstrip /
        rstrip taking the whitespace beside them as theirs."""
        if self.added_pattern is None:
            return [(False, text)]
        segments = []
        start = 0
        for match in self.added_pattern.finditer(text):
            token = self.added[match.group()]
            before = text[start:match.start()]
            if token.lstrip:
                before = before.rstrip()
            if before:
                segments.append((False, before))
            segments.append((True, token))
            start = match.end()
            if token.rstrip:
                while start < len(text) and text[start].isspace():
                    start += 1
        if start < len(text):
            segments.append((False, text[start:]))
        return segments

    def _bpe(self, word):
        """Ids of one pre-token, already in the byte alphabet."""
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        parts = list(word)
        ranks = self.ranks
        while len(parts) > 1:
            best = None
            best_rank = None
            for i in range(len(parts) - 1):
                rank = ranks.get((parts[i], parts[i + 1]))
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = (parts[i], parts[i + 1]), rank
            if best is None:
                break
            merged = best[0] + best[1]
            out = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == best[0] and parts[i + 1] == best[1]:
                    out.append(merged)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            parts = out
        try:
            return [self.vocab[p] for p in parts]
        except KeyError as e:
            raise TokenizerError(f"{self.where}: piece {e.args[0]!r} is not in the vocabulary "
                                 f"(the file's merges and vocab disagree)") from None

    def _piece_ids(self, piece):
        """Ids of one pre-token (text), remembered for short pieces."""
        got = self.cache.get(piece)
        if got is None:
            word = piece.encode("utf-8", "surrogatepass").decode("latin-1").translate(LATIN1_TO_ALPHABET)
            got = self._bpe(word)
            if len(piece) <= CACHE_PIECE_CHARS:
                if len(self.cache) >= CACHE_ENTRIES:
                    self.cache.clear()
                self.cache[piece] = got
        return got

    def _encode_plain(self, text, ids):
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        cache = self.cache
        for piece in self.split_pattern.findall(text):
            got = cache.get(piece)
            ids.extend(got if got is not None else self._piece_ids(piece))

    def encode(self, text):
        """Token ids of `text`; added tokens written in it are matched."""
        ids = []
        for is_added, part in self._segments(text):
            if is_added:
                ids.append(part.id)
            else:
                self._encode_plain(part, ids)
        return ids

    def encode_with_offsets(self, text):
        """(ids, ends): ends[k] is the character offset in `text` where token k's
        text ends (for a token that holds part of a character, the end of that
        character). Used to place loss masks."""
        ids = []
        ends = []
        position = 0
        for is_added, part in self._segments(text):
            if is_added:
                position = text.index(part.content, position) + len(part.content)
                ids.append(part.id)
                ends.append(position)
                continue
            position = text.index(part, position)
            normalized = unicodedata.normalize("NFC", part) if self.nfc else part
            if normalized != part:
                # Characters changed by NFC cannot be placed one by one; the
                # segment's tokens all end at its end.
                before = len(ids)
                self._encode_plain(part, ids)
                ends.extend([position + len(part)] * (len(ids) - before))
                position += len(part)
                continue
            for match in self.split_pattern.finditer(part):
                piece = match.group()
                piece_ids = self._piece_ids(piece)
                if len(piece_ids) == 1:
                    ids.append(piece_ids[0])
                    ends.append(position + match.end())
                    continue
                if piece.isascii():  # characters are bytes
                    at = position + match.start()
                    for token_id in piece_ids:
                        at += len(self.id_bytes[token_id])
                        ids.append(token_id)
                        ends.append(at)
                    continue
                # Walk the piece's bytes to find where each token ends in characters.
                char_ends = []
                for k, ch in enumerate(piece):
                    char_ends.extend([k + 1] * len(ch.encode("utf-8", "surrogatepass")))
                consumed = 0
                for token_id in piece_ids:
                    consumed += len(self.id_bytes[token_id])
                    ids.append(token_id)
                    ends.append(position + match.start() + char_ends[consumed - 1])
            position += len(part)
        return ids, ends

    # ------------------------------------------------------------------ decoding

    def decode_bytes(self, ids, skip_special_tokens=False):
        """The bytes the ids stand for, exactly (possibly not valid UTF-8)."""
        out = bytearray()
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise TokenizerError(f"{self.where}: token id {token_id} is outside the vocabulary "
                                     f"(0..{self.vocab_size - 1})")
            if skip_special_tokens and self.is_special(token_id):
                continue
            out += self.id_bytes[token_id]
        return bytes(out)

    def decode(self, ids, skip_special_tokens=False):
        """Text of the ids; bytes that are not valid UTF-8 become U+FFFD, one per
        maximal invalid sequence (as the `tokenizers` package decodes)."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", "replace")


def load_tokenizer_config(folder):
    """tokenizer_config.json beside a tokenizer.json ({} when there is none)."""
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return config


def token_text(value):
    """A special token as tokenizer_config.json writes it: "tok" or {"content": "tok"}."""
    if isinstance(value, dict):
        return value.get("content")
    return value
