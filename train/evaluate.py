"""Evaluation of a draft head: per-depth accuracy, simulated tau, and the real mean accepted length.

Per-depth accuracy is teacher-forced on the target's own greedy path: at a
held-out position the target's next `depth` greedy tokens are computed, the
drafter drafts a chain forced onto them, and depth d counts a top-1 (top-5)
hit when the target's d-th token is the drafter's first (among its first
five) choice there. This works for every drafter with a step function.

The same forced chains give the simulated tau (SpecForge's "simulated
acceptance length"): greedy verification of a chain accepts the drafter's
top-1 tokens up to its first miss, and along the target's own path the
drafter's top-1 at depth d is what it would have drafted had depths 1..d-1
been accepted. So 1 + the leading top-1 hits of a forced chain is exactly
the length a greedy chain of that depth commits there, without generating.
The mean accepted length comes from running `SpeculativeGenerator` greedily.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from specgraft.heads import as_drafter
from specgraft.heads.base import Drafter
from specgraft.infer import SpeculativeGenerator
from specgraft.model import Target
from specgraft.tree import Sampling, Tree, TreeBuilder, TreePolicy, parse_tree_spec


@dataclass
class ForcedChain:
    """A tree policy that drafts a chain along given tokens and records the drafter's log-probs at each depth."""

    tokens: Sequence[int]
    recorded: list[torch.Tensor] = field(default_factory=list)

    @property
    def max_depth(self) -> int:
        return len(self.tokens)

    def grow(
        self,
        step,
        root_token: int,
        max_depth: int | None = None,
        device: torch.device | str = "cpu",
        sampling: Sampling | None = None,
    ) -> Tree:
        builder = TreeBuilder(root_token, device)
        last = torch.zeros(1, dtype=torch.long, device=device)
        for token in self.tokens[: max_depth if max_depth is not None else None]:
            logp = step(builder.tree(), last)[0]  # (V,)
            self.recorded.append(logp)
            last = builder.add(torch.tensor([token], device=device), last, logp[token][None])
        return builder.tree()


@torch.inference_mode()
def greedy_path(target: Target, prefix: Sequence[int], depth: int) -> list[int]:
    """The target's next ``depth`` greedy tokens after ``prefix``."""
    ids = torch.tensor([list(prefix)], device=target.device)
    out = target.model.generate(ids, do_sample=False, max_new_tokens=depth, min_new_tokens=depth, eos_token_id=None)
    return out[0, ids.shape[1] :].tolist()


def depth_accuracy(
    drafter: Drafter,
    target: Target,
    sequences: Sequence[Sequence[int]],
    *,
    depth: int = 5,
    positions: int = 4,
    chain_depth: int | None = None,
) -> dict[str, list[float] | float]:
    """Teacher-forced top-1 / top-5 accuracy per depth on the target's greedy path, and the simulated tau of a
    greedy chain ``chain_depth`` deep (default ``depth``; see module doc)."""
    chain_depth = depth if chain_depth is None else chain_depth
    depth = max(depth, chain_depth)
    hits1, hits5, counts = [0] * depth, [0] * depth, [0] * depth
    accepted, chains = 0, 0
    for seq in sequences:
        seq = list(seq)
        if len(seq) < 4:
            continue
        cuts = torch.linspace(2, len(seq) - 2, positions).long().unique().tolist()
        for cut in cuts:
            prefix = seq[:cut]
            with torch.inference_mode():
                out = target.forward(
                    torch.tensor([prefix], device=target.device),
                    target.new_cache(),
                    torch.arange(cut, device=target.device)[None],
                    hidden_layers=tuple(drafter.hidden_layers),
                )
            root = int(out.logits[0, -1].argmax())
            path = greedy_path(target, prefix + [root], depth)
            state = drafter.start(torch.tensor(prefix, device=target.device), {i: h[0] for i, h in out.hidden.items()})
            policy = ForcedChain(path)
            state.propose(root, policy, depth)
            leading = True
            for d, logp in enumerate(policy.recorded):
                top5 = logp.topk(5).indices.tolist()
                hits1[d] += int(top5[0] == path[d])
                hits5[d] += int(path[d] in top5)
                counts[d] += 1
                leading = leading and top5[0] == path[d]
                accepted += int(leading and d < chain_depth)
            chains += 1
    reached = [d for d in range(depth) if counts[d]]  # a drafter may draft fewer levels (Medusa: its heads)
    return {
        "top1": [hits1[d] / counts[d] for d in reached],
        "top5": [hits5[d] / counts[d] for d in reached],
        "simulated_tau": 1 + accepted / chains if chains else 0.0,
    }


def mean_accepted_length(
    target: Target, drafter: Drafter, tree: TreePolicy, prompts: Sequence[str | Sequence[int]], max_new_tokens: int
) -> dict[str, float]:
    """Greedy speculative decoding over ``prompts``: tau over all steps, and throughput."""
    gen = SpeculativeGenerator(target, drafter, tree=tree)
    committed = calls = tokens = 0
    seconds = 0.0
    for prompt in prompts:
        stats = gen.generate(prompt, max_new_tokens=max_new_tokens).stats
        committed += stats.mean_accepted_length * stats.target_calls  # as GenerationStats counts tau
        calls += stats.target_calls
        tokens += stats.new_tokens - 1
        seconds += (stats.new_tokens - 1) / stats.tokens_per_s if stats.tokens_per_s else 0.0
    return {"mean_accepted_length": committed / calls if calls else 0.0, "tokens_per_s": tokens / seconds if seconds else 0.0}


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """First turns of a Spec-Bench / MT-bench jsonl, or lines of a plain text file."""
    path = Path(path)
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                prompts.append(json.loads(line)["turns"][0])
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
                raise ValueError(f"{path}:{number}: expected a JSON object with 'turns' ({err})") from None
        else:
            prompts.append(line)
    return prompts[:limit]


def make_head_evaluator(
    target: Target,
    *,
    prompts: Sequence[str],
    heldout: Sequence[Sequence[int]],
    tree: str = "chain:5",
    max_new_tokens: int = 128,
    depth: int = 5,
) -> Callable[[nn.Module], dict[str, float]]:
    """A callback for the trainer: head module -> metrics (per-depth accuracy, simulated tau of a chain as deep
    as ``tree``, real tau on ``prompts``)."""
    policy = parse_tree_spec(tree)

    def evaluate(head: nn.Module) -> dict[str, float]:
        was_training = head.training
        head.eval()
        try:
            drafter = as_drafter(head, target)
            metrics: dict[str, float] = {}
            if heldout:
                acc = depth_accuracy(drafter, target, heldout, depth=depth, chain_depth=policy.max_depth)
                for d, (a1, a5) in enumerate(zip(acc["top1"], acc["top5"]), start=1):
                    metrics[f"depth{d}_top1"] = a1
                    metrics[f"depth{d}_top5"] = a5
                metrics["simulated_tau"] = acc["simulated_tau"]
            if prompts:
                metrics.update(mean_accepted_length(target, drafter, policy, prompts, max_new_tokens))
            return metrics
        finally:
            head.train(was_training)

    return evaluate
