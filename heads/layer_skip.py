"""Self-speculative layer skip: the target drafts for itself with some decoder layers left out.

No second model and no training (Draft&Verify, SWIFT): the draft is the
target's own embeddings, the decoder layers it keeps, its final norm and its
lm_head, run on the fast path over the very same weight tensors. Skipping a
layer makes it the identity in the residual stream. `search_layer_skip`
(heads/layer_skip_search.py) picks which layers to skip on calibration prompts.

KV cache. Layers before the first skipped one see exactly the target's
inputs, so their keys/values of committed tokens equal the target's rows.
They are not shared: the `Drafter` protocol hands a drafter the committed
tokens and hidden states, never the target's cache (it is the generation's
row of the scheduler's KV pool), so each generation's
`LayerSkipState` keeps its own cache for every kept layer. What that costs:

- memory: the kept layers' KV rows of the sequence a second time (for the
  layers before the first skipped one, a duplicate of the target's);
- compute: the prompt runs once more through the kept layers, at the first
  proposal (after the first token, so time to first token is unchanged).
  Steady state costs nothing extra: the keys/values a draft round computed
  for tree nodes that the target then accepts are kept (they were computed
  from exactly the committed tokens), so only tokens the draft never ran (a
  fully accepted chain's last node) are run again, together with the next root.

Shape legend: T new tokens, F frontier nodes, L cached slots + F, V vocabulary.
"""

from __future__ import annotations

import itertools
from typing import Iterable

import torch

from specgraft.heads.draft_round import DraftRound
from specgraft.model import TREE_SLOTS, Target, unsupported_reason
from specgraft.specs import format_layer_set
from specgraft.tree import Sampling, Tree, TreePolicy


def check_skip(skip: Iterable[int], num_layers: int) -> tuple[int, ...]:
    """``skip`` as sorted layer indices, or ValueError naming what is wrong with it.

    Raises:
        ValueError: an index that is not an integer in [0, num_layers), one named twice,
            or every layer skipped (nothing would be left to draft with).
    """
    layers = list(skip)
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"skip={layers}: {layer!r} is not a layer index (an integer)")
        if not 0 <= layer < num_layers:
            raise ValueError(f"skip={layers}: layer {layer} is out of range; the target has {num_layers} layers (0..{num_layers - 1})")
    repeated = sorted({layer for layer in layers if layers.count(layer) > 1})
    if repeated:
        raise ValueError(f"skip={layers} names layer{'s' if len(repeated) > 1 else ''} {', '.join(map(str, repeated))} more than once")
    if len(layers) == num_layers:
        raise ValueError(f"skip={layers} skips all {num_layers} layers of the target; keep at least one")
    return tuple(sorted(layers))


class LayerSkip:
    """Drafts with the target's own weights, skipping decoder layers ``skip``.

    Greedy decoding drafts the draft's top-1 (or top-k in a tree); under
    sampling the tree policy draws from and reports the draft's filtered
    distribution, exactly as for `DraftModel`.

    Args:
        target: the frozen target; it must run on the fast path (`FastLlama`).
        skip: decoder layer indices to leave out (0-based; may be empty: then the
            draft is the target itself, a check of the machinery).

    Raises:
        ValueError: a target without the fast path, or a bad ``skip`` (see `check_skip`).
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, target: Target, skip: Iterable[int] = ()) -> None:
        if target.fast is None:
            reason = unsupported_reason(target.model) or "it was loaded with fast=False"
            raise ValueError(
                f"LayerSkip drafts on the fast path (FastLlama), which target {target.name!r} does not run: {reason}"
            )
        self.target = target
        self.skip = check_skip(skip, target.num_layers)
        self.kept = tuple(i for i in range(target.num_layers) if i not in self.skip)
        self.fast = target.fast.subset(self.kept)  # the target's own weight tensors, no copies

    def __repr__(self) -> str:
        return f"LayerSkip(skip=[{format_layer_set(self.skip)}], {len(self.kept)} of {self.target.num_layers} layers kept)"

    def start(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> LayerSkipState:
        return LayerSkipState(self, prompt_ids.flatten().tolist())


class LayerSkipState:
    """One generation's draft cache over the kept layers, and the committed tokens it has not run yet.

    Invariant between rounds: the cache holds the first ``length - len(pending)``
    committed tokens (the root excluded), ``pending`` the rest.
    """

    def __init__(self, drafter: LayerSkip, committed: list[int]) -> None:
        self.fast = drafter.fast
        self.device = drafter.target.device
        self.cache = self.fast.new_cache(max_len=drafter.target.max_context + TREE_SLOTS)
        self.length = len(committed)  # committed tokens, the root excluded
        self.pending = committed  # committed tokens not in the cache yet, oldest first (the prompt at first)
        self.proposed: dict[tuple[int, ...], int] | None = None  # the last round's node token paths -> slots
        self.peak = 0

    def cache_tokens(self) -> int:
        return self.peak

    def propose(
        self, root_token: int, policy: TreePolicy, max_depth: int, sampling: Sampling | None = None
    ) -> Tree:
        if max_depth < 1:
            return Tree.root_only(root_token, self.device)
        round_ = DraftRound(self.length, lambda: self._run_root(root_token), self._run_nodes, self.device)
        tree = policy.grow(round_.step, root_token, max_depth=max_depth, device=self.device, sampling=sampling)
        self.peak = len(self.cache)
        self.proposed = round_.slot_of_path
        return tree

    def commit(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], path: torch.Tensor | None = None) -> None:
        """Keep the accepted nodes' draft keys/values; what the draft never ran becomes pending."""
        accepted = tokens.flatten().tolist()
        if path is not None and self.proposed:
            # The path's nodes that ran are a prefix of it (a node runs after its parent), in increasing slots.
            prefixes = (tuple(accepted[: i + 1]) for i in range(len(accepted)))
            rows = [self.proposed[p] for p in itertools.takewhile(self.proposed.__contains__, prefixes)]
            self.cache.keep(self.length, torch.tensor(rows, device=self.device))
            self.pending = accepted[len(rows) :]
        else:  # not our tree (the root alone, or a composite's other drafter's): nothing of ours ran
            self.pending = self.pending + accepted
        self.proposed = None
        self.length += len(accepted)

    def _run_root(self, root_token: int) -> torch.Tensor:
        """Catch the cache up on pending committed tokens, then run the root: plain causal attention."""
        start = len(self.cache)
        ids = torch.tensor(self.pending + [root_token], device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)
        logits, _ = self.fast.forward(ids[None], self.cache, positions[None], last_only=True)  # (1, 1, V)
        self.pending = []
        return logits[0, -1]

    def _run_nodes(self, tree: Tree, nodes: torch.Tensor, visible: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # visible: (F, L) bool, True where a node may attend (its committed prefix, its ancestors, itself)
        logits, _ = self.fast.forward(tree.tokens[nodes][None], self.cache, positions[None], visible)  # (1, F, V)
        return logits[0]
