"""Text <-> token ids for a Hugging Face model directory, on `tokenizers` and jinja2 alone.

transformers is never imported at run time: it is slow to import and heavy. The chat template is
rendered the way transformers renders it, so prompts match what a user gets from HF tooling.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte -> printable-char map, inverted: byte-level BPE vocab entries spell raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_LEVEL = _byte_level_table()


def _load_json(path: Path) -> dict:
    """{} when the file is absent (the side files are optional); ValueError naming the file when malformed."""
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return obj


def _token_text(value) -> str | None:
    # tokenizer_config stores special tokens as strings or as serialized AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


class Tokenizer:
    """tokenizer.json plus the special-token facts spread over tokenizer_config.json, generation_config.json
    and config.json, resolved once at load."""

    def __init__(self, tok: _HFTokenizer, tokenizer_config: dict, generation_config: dict,
                 model_config: dict, path: Path):
        self._tok = tok
        self.path = path
        self._cfg = tokenizer_config
        self.bos_token = _token_text(tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(tokenizer_config.get("eos_token"))
        self.pad_token = _token_text(tokenizer_config.get("pad_token"))
        self.unk_token = _token_text(tokenizer_config.get("unk_token"))
        self.bos_token_id = self._id(self.bos_token)
        self.add_bos = bool(tokenizer_config.get("add_bos_token", False)) and self.bos_token_id is not None
        eos_id = self._id(self.eos_token)
        # generation_config.json is what HF generate() stops on; config.json stands in when it is absent.
        gen_eos = generation_config.get("eos_token_id", model_config.get("eos_token_id"))
        ids = [i for i in _as_list(gen_eos) if isinstance(i, int)] + ([eos_id] if eos_id is not None else [])
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))
        special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        special |= {i for i in (self.bos_token_id, eos_id, self._id(self.pad_token), self._id(self.unk_token))
                    if i is not None}
        self.all_special_ids: list[int] = sorted(special)
        # Tokens the tokenizer knows, added tokens included (the model's embedding may have more rows).
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: no such file (a model directory needs tokenizer.json)")
        try:
            tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(f"{tok_file}: cannot be parsed as a tokenizer ({e})") from None
        return cls(tok, _load_json(path / "tokenizer_config.json"), _load_json(path / "generation_config.json"),
                   _load_json(path / "config.json"), path)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # Some tokenizer.json post-processors add BOS themselves (Llama 3); never add it twice.
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_text_bytes(self, tid: int) -> tuple[str, list[int]]:
        """(text, UTF-8 bytes) of one token, for logprobs: a token that is part of a multi-byte character
        decodes to U+FFFD, so its raw bytes come from the byte-level BPE spelling."""
        text = self.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            piece = self.id_to_token(tid) or ""
            if piece and all(ch in _BYTE_LEVEL for ch in piece):
                return text, [_BYTE_LEVEL[ch] for ch in piece]
        return text, list(text.encode("utf-8", errors="replace"))

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template: str | None = None, **extra) -> str:
        """Render tokenizer_config's chat_template (or `chat_template`, a request's own) like transformers'
        apply_chat_template(tokenize=False). continue_final_message: the prompt ends where the final
        message's text does (no end-of-turn after it), so the reply continues that message."""
        if chat_template is not None:
            template = compile_template(chat_template)
        else:
            if self._template is None:
                self._template = compile_template(self._chat_template_source())
            template = self._template
        specials = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                       ("pad_token", self.pad_token), ("unk_token", self.unk_token)) if v is not None}
        kwargs = {"tools": None, "documents": None, **specials, **extra}
        text = template.render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return _cut_after_final(text, messages[-1].get("content") or "") if continue_final_message else text

    def _chat_template_source(self) -> str:
        template = self._cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str):
            return template
        jinja_file = self.path / "chat_template.jinja"  # where transformers 5 saves it
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        raise ValueError(f"{self.path / 'tokenizer_config.json'}: no 'chat_template' field "
                         f"(and no {jinja_file.name}); this model has no chat template")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; HF's does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _cut_after_final(text: str, final: str) -> str:
    """The rendered chat up to the end of the final message's text (as transformers does it: the template
    may keep or strip the text's surrounding whitespace)."""
    if not final.strip():
        raise ValueError("continue_final_message needs a final message with text")
    at = text.rfind(final.strip())
    if at < 0:
        raise ValueError("the chat template does not render the final message's text as it is")
    if text[at:at + len(final.lstrip())] == final.lstrip():
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]


@functools.lru_cache(maxsize=16)  # requests that bring their own template tend to bring the same one
def compile_template(source: str) -> jinja2.Template:
    # Templates come with downloaded models: untrusted code, hence the immutable sandbox.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns one token at a time into newly completed text (vLLM's prefix/read-offset technique).

    `ids` is a short window: ids[:read] were already emitted and serve as context, ids[read:] were not.
    Decoding with context keeps word-boundary spaces right for tokenizers whose decode depends on
    neighbours, and text ending in U+FFFD (a UTF-8 sequence split across tokens) is held back until a later
    token completes it. `flush()` at the end releases a tail that never completed (invalid bytes).

    For a prompt that ends on a character boundary: "".join(pushes) + flush() == decode(output ids).
    A prompt ending inside a character (only possible when the client sends token ids) has that character
    completed by the first output bytes; the completed character counts as prompt text and is not emitted.
    """

    CONTEXT = 5  # prompt tokens decoded as context, as in vLLM

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-self.CONTEXT:]) if prompt_ids else []
        self.read = len(self.ids)
        self._context_text = self._decode(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self._decode(self.ids)
        if len(text) <= len(self._context_text) or text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Text still held back at the end of the stream (an invalid UTF-8 tail, or U+FFFD itself)."""
        text = self._decode(self.ids)
        return self._emit(text) if len(text) > len(self._context_text) else ""

    def _emit(self, text: str) -> str:
        new = text[len(self._context_text):]
        # The tokens just emitted become the context for the next ones.
        del self.ids[:self.read]
        self.read = len(self.ids)
        self._context_text = self._decode(self.ids)
        return new
