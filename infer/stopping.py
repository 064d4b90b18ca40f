"""When a generation ends: token budget, end-of-sequence ids, stop strings."""

from __future__ import annotations

from typing import Sequence

from specgraft.infer.detokenize import Detokenizer


class StopRule:
    """Decides, token by token, whether the generation is over.

    The token that triggers a stop is kept, as in transformers' ``generate``:
    an EOS id ends the output, and so does the token that completes a stop string.
    Stop strings are matched on the generation's incrementally detokenized
    text (``text``, a `Detokenizer`), so each token costs the same however
    long the output. The rule feeds every kept token to ``text``, so the same
    detokenizer also serves a stream's text.

    Raises:
        ValueError: stop strings without a detokenizer (the target has no tokenizer).
    """

    def __init__(
        self,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        text: Detokenizer | None = None,
    ) -> None:
        if stop_strings and text is None:
            raise ValueError("stop strings need a tokenizer to decode the output")
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset(eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.text = text
        self.longest_stop = max(map(len, self.stop_strings), default=0)
        self.generated: list[int] = []
        self.done = False

    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def accept(self, tokens: Sequence[int]) -> list[int]:
        """Append tokens until a rule fires; returns the ones kept (and fed to ``text``)."""
        kept = []
        for token in tokens:
            if self.done:
                break
            kept.append(token)
            self.generated.append(token)
            if token in self.eos or len(self.generated) >= self.max_new_tokens or self._hits_stop_string(token):
                self.done = True
        if self.text is not None and not self.stop_strings:  # with stop strings each token went in one by one
            self.text.add(kept)
        return kept

    def _hits_stop_string(self, token: int) -> bool:
        """Does the text this token added, with the text just before it, contain a stop string?"""
        if not self.stop_strings:
            return False
        delta = self.text.add([token])
        # A match ends in the new text (the released delta, or the held-back tail) and may start
        # up to len(stop) - 1 characters before it.
        released = self.text.text
        window = released[max(0, len(released) - len(delta) - self.longest_stop + 1) :] + self.text.tail
        return any(s in window for s in self.stop_strings)
