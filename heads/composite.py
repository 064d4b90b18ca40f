"""A composite drafter: one drafter first, another where the first finds nothing.

Why: prompt lookup costs nothing and is often right for many tokens at once
(code edits, summaries, answers that quote the question), but most steps of a
chat find no match. A head (or any drafter) fills those steps. Both states see
every commit, so each stays in step with the sequence; the second only pays
for its forward passes on the steps it drafts (its catch-up on the pairs
committed meanwhile runs in one forward then).

Exactness: which drafter proposes is decided from the committed sequence
alone (did the first one find a continuation?), never from this step's draws,
so each step's tree is one drafter's proposal and verification stays exact.
"""

from __future__ import annotations

import torch

from specgraft.heads.base import Drafter, DraftState
from specgraft.tree import Sampling, Tree, TreePolicy


class Composite:
    """Drafts with ``first``; where its tree holds only the root, with ``then``.

    ``first`` drafts at most as deep as the tree policy (a chain:3 also caps
    prompt lookup at 3 tokens), so a tree sized by the target's cost curve
    stays that size whichever drafter fills it; ``first_depth`` sets its own
    cap instead. Why: a head pays a forward per draft token and a lookup
    copies for free, so on a target whose verification costs the same for 2
    and 4 tokens the best head tree is often one token deep while the best
    lookup chain is three.

        sg.Composite(sg.PromptLookup(max_matches=1), sg.load_drafter("runs/eagle3/head", target), first_depth=3)
    """

    def __init__(self, first: Drafter, then: Drafter, *, first_depth: int | None = None) -> None:
        if first_depth is not None and first_depth < 1:
            raise ValueError(f"first_depth must be >= 1 or None (the tree policy's depth), got {first_depth}")
        self.first, self.then, self.first_depth = first, then, first_depth
        self.hidden_layers = tuple(dict.fromkeys(first.hidden_layers + then.hidden_layers))

    def start(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> CompositeState:
        return CompositeState(
            self.first.start(prompt_ids, hidden), self.then.start(prompt_ids, hidden), first_depth=self.first_depth
        )


class CompositeState:
    """Both drafters' states for one generation; counts the steps each drafted."""

    def __init__(self, first: DraftState, then: DraftState, *, first_depth: int | None = None) -> None:
        self.first, self.then, self.first_depth = first, then, first_depth
        self.drafted_by_first = 0
        self.drafted_by_then = 0
        self.proposer: DraftState | None = None  # whose tree this step's is, until the commit

    def propose(self, root_token: int, policy: TreePolicy, max_depth: int, sampling: Sampling | None = None) -> Tree:
        cap = policy.max_depth if self.first_depth is None else self.first_depth
        tree = self.first.propose(root_token, policy, min(max_depth, cap), sampling)
        if len(tree.tokens) > 1:
            self.drafted_by_first += 1
            self.proposer = self.first
            return tree
        self.drafted_by_then += 1
        self.proposer = self.then
        return self.then.propose(root_token, policy, max_depth, sampling)

    def commit(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], path: torch.Tensor | None = None) -> None:
        """Both states see every commit; only the one whose tree was verified gets its path."""
        proposer, self.proposer = (self.proposer if path is not None else None), None
        self.first.commit(tokens, hidden, path if proposer is self.first else None)
        self.then.commit(tokens, hidden, path if proposer is self.then else None)

    def cache_tokens(self) -> int:
        return self.first.cache_tokens() + self.then.cache_tokens()
