"""Reasoning output: text between `<think>` and `</think>` goes to `reasoning_content` (and `reasoning`).

`qwen3`: reasoning only when the reply opens with `<think>` (with `enable_thinking: false` the template
closes the think block in the prompt and the reply is all content). `deepseek_r1`: the template opens
the block, so the reply is reasoning from its first token until `</think>`; a reply that never closes it
is all reasoning. Streaming holds back text that may be the start of a tag split across tokens.
"""

from __future__ import annotations

from trnd.api.tools import _held

PARSERS = ("qwen3", "deepseek_r1")
THINK, END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, name: str):
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning_parser {name!r} (one of {', '.join(PARSERS)})")
        self.name = name
        # start: before the reply's first text; think: inside; content: after </think> (or never thought)
        self.state = "start"
        self._pending = ""
        self._strip = False  # drop the newlines that follow a tag

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) newly known."""
        text = self._pending + text
        self._pending = ""
        reasoning = content = ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(THINK):
                    text, self.state, self._strip = stripped[len(THINK):], "think", True
                elif not final and (not stripped or THINK.startswith(stripped)):
                    self._pending = text
                    return reasoning, content
                else:
                    self.state = "think" if self.name == "deepseek_r1" else "content"
                continue
            if self._strip:
                text = text.lstrip("\n")
                if not text:
                    break
                self._strip = False
            if self.state == "think":
                at = text.find(END)
                if at >= 0:
                    reasoning += text[:at]
                    text, self.state, self._strip = text[at + len(END):], "content", True
                    continue
                keep = 0 if final else _held(text, END)
                reasoning += text[:len(text) - keep]
                self._pending = text[len(text) - keep:]
                return reasoning, content
            content += text
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.push("", final=True)
