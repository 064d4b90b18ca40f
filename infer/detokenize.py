"""Incremental detokenization: the text of a growing token list, decoding only its newest tokens.

Decoding the whole output after every token costs O(n) per token, O(n^2) per
generation. As vLLM does, decode a short window (the tokens since the last
released text, plus the ones before them as context) with and without the
new tokens and release the difference, so a tokenizer's leading-space rules
cancel out. Text that ends in an incomplete character (U+FFFD) is held back
until a later token completes it.

The window starts with the prompt's last few tokens (`prompt_context`), as
vLLM's does and as HF's text-generation pipeline cuts the prompt's text off
the whole decode: a SentencePiece tokenizer drops the leading space of a
decode's first word, so a completion decoded alone would lose the space
between the prompt and its first word ("Once upon a time" + "there").
"""

from __future__ import annotations

from typing import Callable, Sequence

INCOMPLETE = "\ufffd"  # what a decoder prints for a partial UTF-8 sequence
PROMPT_CONTEXT = 6  # prompt tokens decoded before the first new one


def prompt_context(decode: Callable[[list[int]], str], prompt_ids: Sequence[int]) -> list[int]:
    """The prompt's last few tokens, the context new text is measured against (none where they end mid-character)."""
    context = [int(i) for i in prompt_ids[-PROMPT_CONTEXT:]]
    return [] if decode(context).endswith(INCOMPLETE) else context


def continuation_text(decode: Callable[[list[int]], str], context: Sequence[int], ids: Sequence[int]) -> str:
    """The text ``ids`` add after ``context``: the whole output at once, as a `Detokenizer` releases it."""
    before, text = decode(list(context)), decode([*context, *ids])
    return text[len(before) :] if text.startswith(before) else decode(list(ids))


class Detokenizer:
    """Released text (``text``) plus the provisional text of tokens held back (``tail``)."""

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int] = ()) -> None:
        """``context``: the tokens before the first new one (`prompt_context`), decoded only as context."""
        self.decode = decode
        self.ids: list[int] = list(context)
        self.text = ""
        self.tail = ""
        self.prefix = 0  # ids[prefix:read] decode to text already released (or the context), kept as context
        self.read = len(self.ids)

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
