"""Prompt lookup decoding: draft by copying what followed earlier n-gram matches.

No model and no training: the last ``n`` tokens (n from ``max_ngram`` down to
``min_ngram``) are searched for in the prompt and the generated text, and the
tokens that followed each match become a branch of the tree. Matches that
continue identically share nodes, so several matches form a trie.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specgraft.heads.base import DraftRequest
from specgraft.model.staging import staged
from specgraft.tree import ROOT_PARENT, Sampling, Tree, TreePolicy
from specgraft.tree.tree import ANCESTOR_BITS, ancestor_bits


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

    def start(
        self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor], cache: None = None
    ) -> PromptLookupState:
        return PromptLookupState(self, prompt_ids)

    def new_rows(self, rows: int, max_len: int) -> None:
        return None  # no draft cache: a state is its history

    def draft_slots(self, policy: TreePolicy) -> int:
        return 0  # (no draft cache)

    def propose_batch(self, requests: Sequence[DraftRequest], rows: None = None) -> list[Tree]:
        """Every request's trie, searched on the host and copied to the device in one staged copy (a tensor a
        trie would be a blocking copy each)."""
        tries = [r.state.branches(r.root_token, r.max_depth) for r in requests]
        structures = [_trie_lists(r.root_token, branches) for r, branches in zip(requests, tries)]
        flat = staged(requests[0].state.device, *(values for structure in structures for values in structure))
        return [Tree.from_host(*flat[4 * k : 4 * k + 4], parent_list=parents, depth_list=depth)
                for k, (_, parents, depth, _) in enumerate(structures)]


class PromptLookupState:
    """One generation's history and its n-gram index, extended by the commits when it next proposes: a row the
    engine does not let draft (its tree sized to nothing under load) indexes nothing step by step.

    Indexing costs about 1.5 us a token (an entry per n-gram length), more than the rest of a plain row's step
    work here; a commit only keeps its tokens (a small tensor each), so a row that drafts again after a long
    stretch indexes the stretch then, in one go.
    """

    def __init__(self, lookup: PromptLookup, prompt_ids: torch.Tensor) -> None:
        self.lookup = lookup
        self.device = prompt_ids.device  # the engine's: where its tries go
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

    def commit_listed(self, tokens: list[int]) -> None:
        """`commit` of tokens the engine has on the host already (it read the step's choices back): the history
        is the host's, so nothing is read from the device for it."""
        self.pending.append(tokens)

    def cache_tokens(self) -> int:
        return 0

    def _fold(self) -> None:
        if self.pending:
            tokens = [x for t in self.pending for x in (t if isinstance(t, list) else t.detach().flatten().tolist())]
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
        return _trie(root_token, self.branches(root_token, max_depth))

    def branches(self, root_token: int, max_depth: int) -> list[list[int]]:
        """The continuations `propose` merges into its trie (none where it may not draft or nothing matches)."""
        self._fold()
        depth = min(self.lookup.num_tokens, max_depth)
        return self._continuations(root_token, depth) if depth > 0 else []

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
    tokens, parents, depth, bits = _trie_lists(root_token, branches)
    tensors = torch.tensor([tokens, parents, depth, bits]).unbind()  # one tensor made, not four
    return Tree.from_host(*tensors, parent_list=parents, depth_list=depth)


def _trie_lists(root_token: int, branches: list[list[int]]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(tokens, parents, depth, ancestor bits) of the trie merging ``branches`` under the root (the root alone
    where none); node i's ancestors (itself included) are the set bits of ``bits[i]`` (see `Tree.from_host`)."""
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
    # Past ANCESTOR_BITS nodes an int cannot hold them: zeros, and the tree derives its ancestors itself
    bits = ancestor_bits(parents) if len(tokens) <= ANCESTOR_BITS else [0] * len(tokens)
    return tokens, parents, depth, bits
