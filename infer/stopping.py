"""When a generation ends: token budget, end-of-sequence ids, stop strings."""

from __future__ import annotations

from typing import Callable, Sequence


class StopRule:
    """Decides, token by token, whether the generation is over.

    The token that triggers a stop is kept, as in transformers' ``generate``:
    an EOS id ends the output, and so does the token that completes a stop string.
    """

    def __init__(
        self,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        if stop_strings and decode is None:
            raise ValueError("stop strings need a tokenizer to decode the output")
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset(eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.decode = decode
        self.generated: list[int] = []
        self.done = False

    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def accept(self, tokens: Sequence[int]) -> list[int]:
        """Append tokens until a rule fires; returns the ones kept."""
        kept = []
        for token in tokens:
            if self.done:
                break
            kept.append(token)
            self.generated.append(token)
            if token in self.eos or len(self.generated) >= self.max_new_tokens or self._hits_stop_string():
                self.done = True
        return kept

    def _hits_stop_string(self) -> bool:
        if not self.stop_strings:
            return False
        text = self.decode(self.generated)
        return any(s in text for s in self.stop_strings)
