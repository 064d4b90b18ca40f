"""Prompt lookup decoding: draft by copying what followed earlier n-gram matches.

No model and no training: the last ``n`` tokens (n from ``max_ngram`` down to
``min_ngram``) are searched for in the prompt and the generated text, and the
tokens that followed each match become a branch of the tree. Matches that
continue identically share nodes, so several matches form a trie.
"""

from __future__ import annotations

import torch

from specgraft.tree import ROOT_PARENT, Sampling, Tree, TreePolicy


class PromptLookup:
    """Drafts continuations of repeated n-grams.

    Args:
        max_ngram: longest suffix to match.
        num_tokens: tokens copied after a match (tree depth), capped by the engine.
        min_ngram: shortest suffix to match.
        max_matches: most matches turned into branches (the most recent first).
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, num_tokens: int = 8, *, min_ngram: int = 1, max_matches: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if num_tokens < 1 or max_matches < 1:
            raise ValueError(f"num_tokens and max_matches must be >= 1, got {num_tokens} and {max_matches}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_tokens, self.max_matches = num_tokens, max_matches

    def start(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> PromptLookupState:
        return PromptLookupState(self, prompt_ids)


class PromptLookupState:
    """One generation's history and its n-gram index, extended by the commits when it next proposes: a row the
    engine does not let draft (its tree sized to nothing under load) indexes nothing step by step.

    Indexing costs about 1.5 us a token (an entry per n-gram length), more than the rest of a plain row's step
    work here; a commit only keeps its tokens (a small tensor each), so a row that drafts again after a long
    stretch indexes the stretch then, in one go.
    """

    def __init__(self, lookup: PromptLookup, prompt_ids: torch.Tensor) -> None:
        self.lookup = lookup
        self._history: list[int] = []
        # n-gram -> ends (index after its last token) of its occurrences in the history, oldest first.
        self.ends: dict[tuple[int, ...], list[int]] = {}
        # Tokens not indexed yet, the prompt's first: indexed when it first proposes (a 30-token prompt took 45 us,
        # 16 rows 0.7 ms of a batch's first step, for rows that under load never draft).
        self.pending: list[torch.Tensor] = [prompt_ids]

    @property
    def history(self) -> list[int]:
        self._fold()
        return self._history

    def commit(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], path: torch.Tensor | None = None) -> None:
        self.pending.append(tokens)

    def cache_tokens(self) -> int:
        return 0

    def _fold(self) -> None:
        if self.pending:
            tokens = torch.cat([t.detach().flatten() for t in self.pending]).tolist()
            self.pending = []
            self._extend(tokens)

    def _extend(self, tokens: list[int]) -> None:
        lo, hi, history, ends = self.lookup.min_ngram, self.lookup.max_ngram, self._history, self.ends
        for token in tokens:
            history.append(token)
            end = len(history)
            for n in range(lo, min(hi, end) + 1):
                ends.setdefault(tuple(history[end - n :]), []).append(end)

    def propose(
        self, root_token: int, policy: TreePolicy | None, max_depth: int, sampling: Sampling | None = None
    ) -> Tree:
        """A trie of the continuations after the longest matching suffix.

        ``policy`` and ``sampling`` are not used: copied tokens are point masses,
        which exact verification accepts at any temperature.
        """
        self._fold()
        depth = min(self.lookup.num_tokens, max_depth)
        branches = self._continuations(root_token, depth) if depth > 0 else []
        return _trie(root_token, branches)

    def _continuations(self, root_token: int, depth: int) -> list[list[int]]:
        """What followed the most recent earlier occurrences of the longest recurring suffix of history + root."""
        history, size = self._history, len(self._history)
        _, ends = self._longest_match(root_token)
        recent = ends[: -self.lookup.max_matches - 1 : -1]  # most recent first
        # A continuation may run into the root itself: history + [root] read without copying history.
        return [history[e : e + depth] + [root_token] * (e + depth > size) for e in recent]

    def _longest_match(self, root_token: int) -> tuple[int, list[int]]:
        """(n, the ends of its earlier occurrences) for the longest suffix of history + root, n tokens long, that
        occurred before; (0, []) where none did."""
        history, size = self._history, len(self._history)
        for n in range(min(self.lookup.max_ngram, size), self.lookup.min_ngram - 1, -1):
            ends = self.ends.get((*history[size - n + 1 :], root_token))  # the suffix ends at the root
            if ends:
                return n, ends
        return 0, []


def _trie(root_token: int, branches: list[list[int]]) -> Tree:
    """Merge token lists that share prefixes into one tree under the root."""
    if not branches:
        return Tree.root_only(root_token)
    tokens, parents, depth = [root_token], [ROOT_PARENT], [0]
    child: dict[tuple[int, int], int] = {}
    for branch in branches:
        node = 0
        for token in branch:
            key = (node, token)
            if key not in child:
                child[key] = len(tokens)
                tokens.append(token)
                parents.append(node)
                depth.append(depth[node] + 1)
            node = child[key]
    tokens_, parents_, depth_ = torch.tensor([tokens, parents, depth])  # one tensor made, not three
    return Tree(tokens=tokens_, parents=parents_, depth=depth_, scores=torch.zeros(len(tokens)))
