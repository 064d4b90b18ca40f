"""Incremental detokenization: the text of a growing token list, decoding only its newest tokens.

Decoding the whole output after every token costs O(n) per token, O(n^2) per
generation. As vLLM does, decode a short window (the tokens since the last
released text, plus the ones before them as context) with and without the
new tokens and release the difference, so a tokenizer's leading-space rules
cancel out. Text that ends in an incomplete character (U+FFFD) is held back
until a later token completes it.
"""

from __future__ import annotations

from typing import Callable, Sequence

INCOMPLETE = "\ufffd"  # what a decoder prints for a partial UTF-8 sequence


class Detokenizer:
    """Released text (``text``) plus the provisional text of tokens held back (``tail``)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self.tail = ""
        self.prefix = 0  # ids[prefix:read] decode to text already released, kept as context
        self.read = 0

    def add(self, tokens: Sequence[int]) -> str:
        """Append tokens; return the newly released text (empty while held back)."""
        self.ids.extend(tokens)
        before = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        if text.endswith(INCOMPLETE) or not text.startswith(before):
            self.tail = text[len(before) :] if text.startswith(before) else text
            return ""
        delta = text[len(before) :]
        self.tail = ""
        if delta:
            self.text += delta
            self.prefix, self.read = self.read, len(self.ids)
        return delta
