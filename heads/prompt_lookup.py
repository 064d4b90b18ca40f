"""Prompt lookup decoding: draft by copying what followed earlier n-gram matches.

No model and no training: the last ``n`` tokens (n from ``max_ngram`` down to
``min_ngram``) are searched for in the prompt and the generated text, and the
tokens that followed each match become a branch of the tree. Matches that
continue identically share nodes, so several matches form a trie.
"""

from __future__ import annotations

import torch

from specgraft.tree import ROOT_PARENT, Tree, TreePolicy
from specgraft.tree.draw import DraftSampler


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
        self.history = torch.zeros(0, dtype=torch.long)

    def reset(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.history = prompt_ids.detach().flatten().cpu()

    def commit(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.history = torch.cat([self.history, tokens.detach().flatten().cpu()])

    def cache_tokens(self) -> int:
        return 0

    def propose(
        self, root_token: int, policy: TreePolicy | None, max_depth: int, sampler: DraftSampler | None = None
    ) -> Tree:
        """A trie of the continuations after the longest matching suffix.

        ``policy`` and ``sampler`` are not used: copied tokens are point masses,
        which exact verification accepts at any temperature.
        """
        seq = torch.cat([self.history, torch.tensor([root_token])])
        depth = min(self.num_tokens, max_depth)
        branches = self._continuations(seq, depth) if depth > 0 else []
        return _trie(root_token, branches)

    def _continuations(self, seq: torch.Tensor, depth: int) -> list[list[int]]:
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            windows = seq[:-1].unfold(0, n, 1)  # (L - n, n): every earlier n-gram, not the suffix itself
            starts = (windows == seq[-n:]).all(dim=1).nonzero().flatten()
            if starts.numel():
                ends = starts.flip(0)[: self.max_matches] + n  # most recent first
                branches = [seq[e : e + depth].tolist() for e in ends.tolist()]
                branches = [b for b in branches if b]
                if branches:
                    return branches
        return []


def _trie(root_token: int, branches: list[list[int]]) -> Tree:
    """Merge token lists that share prefixes into one tree under the root."""
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
    return Tree(
        tokens=torch.tensor(tokens),
        parents=torch.tensor(parents),
        depth=torch.tensor(depth),
        scores=torch.zeros(len(tokens)),
    )
