"""The drafter protocol: what the engine asks of anything that proposes tokens.

A drafter holds what every generation shares (weights, settings); each
generation holds its own `DraftState` (caches, features, n-gram index), so
many generations can run over one loaded head without seeing each other.
The engine owns the committed sequence and talks to a drafter in three calls:

- ``drafter.start(prompt_ids, hidden)`` once the target has prefilled a prompt,
  giving the generation's own `DraftState`;
- ``state.propose(root_token, policy, max_depth, sampling)`` for a candidate tree whose
  root is the last committed token (the one the target has not run yet);
- ``state.commit(tokens, hidden, path)`` with the accepted path's tokens (root
  first), now in the target's cache, the target's hidden states at those
  positions, and the path's node indices in the tree the state proposed this
  step (None when the tree verified was not its proposal: the root alone, or
  a composite's other drafter's).

Trained heads, small draft models and prompt lookup all implement it; none
subclasses anything.

A `BatchDrafter` (Medusa, EAGLE, EAGLE-3) can also draft for many
generations at once: ``drafter.propose_batch(requests, rows)`` grows one tree
per `DraftRequest` and runs its neural work once per tree level for all of
them. A scheduler gives such a drafter's states their caches as rows of one
batched cache (``new_rows``, then ``start(..., cache=row's view)``), as it does
for the target; ``state.propose`` is the same code with one request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from specgraft.model import BatchedKVCache, StaticKVCache
from specgraft.model.staging import staged
from specgraft.tree import Chain, Sampling, StaticTree, Tree, TreePolicy, grow_chains
from specgraft.tree.policies import grow_static


@runtime_checkable
class DraftState(Protocol):
    """One generation's drafting state: created by `Drafter.start`, used by that generation only."""

    def propose(
        self, root_token: int, policy: TreePolicy, max_depth: int, sampling: Sampling | None = None
    ) -> Tree:
        """A tree rooted at ``root_token``, at most ``max_depth`` deep.

        ``sampling`` is None or greedy under greedy decoding (children are top-k); otherwise it
        filters the draft distribution exactly as the target's and draws sampled children.
        """

    def commit(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], path: torch.Tensor | None = None) -> None:
        """Accepted path tokens (K,), root first; hidden: layer -> (K, H); path: (K,) their node indices in
        the tree this state proposed this step, or None when the tree verified was not its proposal.

        Commits without a path may come joined, one for several steps (their tokens and states concatenated, in
        order; the engine keeps those of a row that does not draft until it next does): a state treats a run of
        them as one commit of them all."""

    def cache_tokens(self) -> int:
        """Most KV positions held since the last commit, a proposal's draft tree included (0: no cache)."""


@runtime_checkable
class Drafter(Protocol):
    #: HF hidden_states indices of the target that the drafter reads (empty: none).
    hidden_layers: tuple[int, ...]

    def start(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> DraftState:
        """A fresh state for one generation. prompt_ids: (S,); hidden: layer -> (S, H) target states."""


@dataclass
class DraftRequest:
    """One generation's share of a batched draft phase: the arguments of `DraftState.propose`, its state and row.

    Attributes:
        state: the generation's `DraftState`, from the batch drafter's ``start``.
        root_token, policy, max_depth, sampling: as `DraftState.propose` takes them (max_depth >= 1).
        row: the state's row of the batched cache passed beside the requests (0 without one).
        root_tensor: ``root_token`` as a (1,) tensor on the device where the engine has it there (nothing to copy).
    """

    state: DraftState
    root_token: int
    policy: TreePolicy
    max_depth: int
    sampling: Sampling | None = None
    row: int = 0
    root_tensor: torch.Tensor | None = None


def root_tokens(requests: Sequence[DraftRequest], device: torch.device) -> torch.Tensor:
    """(R,) the requests' root tokens on ``device``: their device copies where all have one, else staged in one copy."""
    if all(r.root_tensor is not None for r in requests):
        return torch.cat([r.root_tensor for r in requests]).to(device)
    return staged(device, [r.root_token for r in requests])[0]


def shared_top_k_static(requests: Sequence[DraftRequest]) -> bool:
    """Whether every request grows one `StaticTree`, each child its listed rank of the top-k (greedy rows, or a top-k
    draw): the trees `grow_static` grows for all rows at once."""
    policy = requests[0].policy
    return type(policy) is StaticTree and all(r.policy == policy for r in requests) and all(
        policy.draw == "top-k" or r.sampling is None or r.sampling.greedy for r in requests)


def grow_by_depth(requests: Sequence[DraftRequest], logp: torch.Tensor) -> list[Tree]:
    """Each request's tree from per-depth draft distributions that do not depend on the parent (Medusa's heads,
    DFlash's block slots): ``logp`` (B, D, V), row b's depth-d children drawn from ``logp[b, d - 1]``; at most D deep.

    Chains, and a top-k static tree shared by every row, are grown for every row at once on the device
    (`grow_chains`, `grow_static`); other trees row by row."""
    if all(type(r.policy) is Chain for r in requests):
        levels = iter(range(1, logp.shape[1]))
        return grow_chains(root_tokens(requests, logp.device), logp[:, 0], lambda _: logp[:, next(levels)],
                           [r.policy for r in requests], [min(r.max_depth, logp.shape[1]) for r in requests],
                           [r.sampling for r in requests])
    policy = requests[0].policy
    if shared_top_k_static(requests):
        levels = iter(range(1, logp.shape[1]))
        depths = [min(r.max_depth, logp.shape[1], policy.max_depth) for r in requests]
        return grow_static(root_tokens(requests, logp.device), logp[:, 0], lambda *_: logp[:, next(levels)][:, None],
                           policy, depths)[0]
    trees = []
    for request, row_logp in zip(requests, logp):

        def step(tree: Tree, frontier: torch.Tensor, row_logp=row_logp) -> torch.Tensor:
            return row_logp[tree.depth[frontier]]  # a node at depth d has children at depth d + 1

        depth = min(request.max_depth, row_logp.shape[0])
        trees.append(request.policy.grow(
            step, request.root_token, max_depth=depth, device=row_logp.device, sampling=request.sampling
        ))
    return trees


@runtime_checkable
class BatchDrafter(Drafter, Protocol):
    """A drafter that drafts many generations' trees together, its neural work batched per tree level."""

    def new_rows(self, rows: int, max_len: int) -> BatchedKVCache | None:
        """A batched draft cache of ``rows`` rows of ``max_len`` slots for a scheduler (None: the drafter keeps no cache)."""

    def draft_slots(self, policy: TreePolicy) -> int | None:
        """The most slots of a row of `new_rows`' cache that drafting a tree of ``policy`` takes beyond the row's
        committed tokens, whatever the other rows draft (0: it caches committed tokens only; None: a policy it cannot
        bound). Rows of ``max_len`` tokens and this many more never overflow: a scheduler sizes its draft pools so
        and refuses a larger tree."""

    def start(
        self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor], cache: StaticKVCache | None = None
    ) -> DraftState:
        """As `Drafter.start`; ``cache``: a row of `new_rows`' cache for the state to keep its draft cache in."""

    def propose_batch(self, requests: Sequence[DraftRequest], rows: BatchedKVCache | None = None) -> list[Tree]:
        """One tree per request, in order. ``rows``: the cache from `new_rows` whose row ``request.row`` each
        state keeps its cache in; None only for a single request whose state has its own cache."""


@dataclass
class TrainBatch:
    """What a head trains on: a batch of sequences with the frozen target's view of them.

    Shape legend: B sequences, T positions, V vocabulary, H hidden.

    Attributes:
        input_ids: (B, T) token ids (right-padded).
        loss_mask: (B, T) 1.0 where position t's token is one the model should learn
            to predict (assistant tokens, not padding), else 0.0.
        hidden: HF hidden_states index -> (B, T, H) target states (the layers the head asked for).
        target_logits: (B, T, V) the target's logits at every position (predicting position t + 1); None for
            a head whose `uses_target_logits` is False.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: dict[int, torch.Tensor]
    target_logits: torch.Tensor | None


def uses_target_logits(head: object) -> bool:
    """Whether ``head``'s loss reads `TrainBatch.target_logits` (a head says False with a ``uses_target_logits``
    attribute; the (B, T, V) logits are then neither computed nor rebuilt)."""
    return bool(getattr(head, "uses_target_logits", True))


@runtime_checkable
class TrainableHead(Protocol):
    """A draft head the trainer can fit: an nn.Module that owns its loss.

    The trainer runs one loop for every head: it builds a `TrainBatch` from
    the frozen target and calls ``loss``; heads never fork the loop.
    """

    hidden_layers: tuple[int, ...]

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar training loss and named float metrics for logging."""
