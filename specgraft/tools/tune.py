"""``specgraft tune-tree``: measure this device and this drafter, then size the tree.

Four measurements feed `specgraft.infer.adaptive.sizing.size_tree`:

1. verification cost T(n)/T(1) for n tree nodes on a real prefix, cached per
   model, dtype, device and thread count (it depends on nothing else);
2. one draft round's cost relative to T(1);
3. the engine's own cost: a plain decoding step and a one-draft speculative
   step, timed interleaved; what the latter spends beyond its forward and
   draft round is the per-step overhead of speculating;
4. acceptance per depth and sibling rank from greedy decoding of calibration
   prompts with a chain, recording the drafter's top-R tokens at each depth:
   the target's own token at depth d (known from what the step committed)
   either sits at some rank among them or is a miss.

The model ranks every tree size; the predicted-fastest tree of each depth is
then timed for real on the calibration prompts next to plain decoding, and
the fastest measured one is written.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from specgraft.heads import Drafter
from specgraft.infer import Scheduler, Tokens, TreeChoice, interpolate, size_tree
from specgraft.model import Target
from specgraft.progress import progress_bar
from specgraft.tools.bench import run_interleaved
from specgraft.tools.bench_runners import engine_runner
from specgraft.tools.prompts import BenchPrompt
from specgraft.tree import Chain, Tree, TreeBuilder, TreePolicy, tree_attention_mask, tree_from_spec, tree_position_ids

VERIFY_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96)
PREFIX_TOKENS = 128  # a typical mid-generation cache length for the cost curve
RANKS = 8  # sibling ranks recorded per depth


def cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specgraft"
    root.mkdir(parents=True, exist_ok=True)
    return root / "verify_cost.json"


def _star_tree(n: int, device) -> Tree:
    """Root plus n - 1 children: n nodes verified with a real 4D mask."""
    return Tree(
        tokens=torch.arange(n, device=device) % 7 + 3,
        parents=torch.tensor([-1] + [0] * (n - 1), device=device),
        depth=torch.tensor([0] + [1] * (n - 1), device=device),
        scores=torch.zeros(n, device=device),
    )


def measure_verify_cost(target: Target, sizes: Sequence[int] = VERIFY_SIZES, repeats: int = 15, use_cache: bool = True) -> dict[int, float]:
    """n -> median forward time of n tree nodes after PREFIX_TOKENS, relative to n = 1 (interleaved)."""
    path_kind = "fast" if getattr(target, "fast", None) is not None else "hf"  # the two forwards cost differently
    key = f"{target.name}|{target.dtype}|{target.device}|{path_kind}|threads={torch.get_num_threads()}"
    path = cache_file()
    cached = json.loads(path.read_text()) if path.is_file() else {}
    if use_cache and key in cached and all(str(n) in cached[key] for n in sizes):
        return {n: cached[key][str(n)] for n in sizes}
    ids = torch.arange(PREFIX_TOKENS, device=target.device)[None] % target.vocab_size
    cache = target.new_cache()
    target.forward(ids, cache, torch.arange(PREFIX_TOKENS, device=target.device)[None])
    times: dict[int, list[float]] = {n: [] for n in sizes}
    trees = {n: _star_tree(n, target.device) for n in sizes}
    for _ in range(repeats + 1):  # the first round warms up
        for n in sizes:
            tree = trees[n]
            mask = None if n == 1 else tree_attention_mask(tree, PREFIX_TOKENS, target.dtype)
            start = time.perf_counter()
            target.forward(tree.tokens[None], cache, tree_position_ids(tree, PREFIX_TOKENS), mask)
            times[n].append(time.perf_counter() - start)
            cache.crop(PREFIX_TOKENS)
    # Minima are the least disturbed runs on a shared machine; a bigger tree never costs less.
    base = min(times[1][1:])
    result, floor = {}, 0.0
    for n in sizes:
        floor = max(floor, min(times[n][1:]) / base)
        result[n] = floor
    cached[key] = {str(n): v for n, v in result.items()} | {"t1_s": base}
    path.write_text(json.dumps(cached, indent=2))
    return result


@dataclass
class RecordingChain:
    """A chain policy that also records the drafter's top-R tokens at every depth."""

    depth: int
    ranks: int = RANKS
    recorded: list[list[int]] = field(default_factory=list)

    @property
    def max_depth(self) -> int:
        return self.depth

    def grow(self, step, root_token, max_depth=None, device="cpu", sampling=None) -> Tree:
        self.recorded = []
        builder = TreeBuilder(root_token, device)
        last = torch.zeros(1, dtype=torch.long, device=device)
        for _ in range(min(self.depth, max_depth or self.depth)):
            logp = step(builder.tree(), last)[0]
            top = logp.topk(min(self.ranks, logp.shape[-1]))
            self.recorded.append(top.indices.tolist())
            last = builder.add(top.indices[:1], last, builder.tree().scores[last] + top.values[:1])
        return builder.tree()


def measure_acceptance(
    target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], *, depth: int = 6, max_new_tokens: int = 64
) -> list[list[float]]:
    """acceptance[d][r]: P(the target's token at depth d + 1 is the drafter's rank-r token | parent kept)."""
    hits = [[0] * RANKS for _ in range(depth)]
    reached = [0] * depth
    policy = RecordingChain(depth)
    for ids in progress_bar(prompts, desc="calibrating acceptance", leave=False):
        sched = _one_row(target, drafter, policy, ids, max_new_tokens)
        sched.submit(ids, max_new_tokens, eos_token_id=())
        prefilled = False
        while not sched.idle:
            for event in sched.step():
                if not isinstance(event, Tokens):
                    continue
                if not prefilled:  # the prefill's token: no draft behind it
                    prefilled = True
                    continue
                # The step kept the target's own choices: depth d's is token_ids[d - 1], known
                # for every depth the chain reached with all earlier depths accepted.
                for d, ranked in enumerate(policy.recorded[: len(event.token_ids)]):
                    reached[d] += 1
                    token = event.token_ids[d]
                    if token in ranked:
                        hits[d][ranked.index(token)] += 1
    return [[h / reached[d] if reached[d] else 0.0 for h in hits[d]] for d in range(depth)]


def _one_row(target: Target, drafter: Drafter | None, tree: TreePolicy, ids: Sequence[int], max_new_tokens: int) -> Scheduler:
    """A scheduler of one row for ``ids`` and ``max_new_tokens``, drafting with ``drafter`` (None: plainly) and ``tree``."""
    name = "none" if drafter is None else "drafter"
    return Scheduler(target, {name: drafter}, max_batch_size=1, max_len=len(ids) + max_new_tokens,
                     default_drafter=name, default_tree=tree)


def measure_draft_cost(target: Target, drafter: Drafter, prompt: Sequence[int], depth: int = 4, repeats: int = 10) -> float:
    """One draft round's time relative to a one-token target forward: a depth-``depth`` chain's time / depth.

    The first proposal after a reset also runs the whole prompt through the
    drafter, so it is made once untimed; later ones run only the root onward.
    """
    ids = torch.tensor(prompt, device=target.device)
    cache = target.new_cache()
    out = target.forward(ids[None], cache, torch.arange(len(ids), device=ids.device)[None], hidden_layers=tuple(drafter.hidden_layers))
    root = int(out.logits[0, -1].argmax())
    state = drafter.start(ids, {i: h[0] for i, h in out.hidden.items()})
    chain = Chain(depth, draw="top-k")
    state.propose(root, chain, depth)
    rounds, one_token = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        state.propose(root, chain, depth)
        rounds.append((time.perf_counter() - start) / depth)
        one_token.append(measure_one_token(target, cache))
    return min(rounds) / min(one_token)  # minima: the least disturbed runs on a shared machine


def measure_step_costs(
    target: Target, drafter: Drafter, prompt: Sequence[int], verify_cost: dict[int, float], draft_cost: float, steps: int = 40
) -> tuple[float, float]:
    """(plain step, speculative step overhead), both relative to a one-token forward T(1).

    A plain decoding step and a speculative step with one draft token are
    timed in turn (minima: the least disturbed runs); the overhead is the
    speculative step minus the plain one, minus the extra verification
    T(2) - T(1) and the draft round: what verification, commits and the
    drafter's bookkeeping add per step.
    """
    budget = 2 * (steps + 3) + 2  # more than both rows can commit: neither leaves while timed
    plain = _one_row(target, None, Chain(1), prompt, budget)
    spec = _one_row(target, drafter, Chain(1, draw="top-k"), prompt, budget)
    for sched in (plain, spec):
        sched.submit(list(prompt), budget, eos_token_id=())
        sched.step()  # the prefill (and a first step)
    plain_cache = next(iter(plain.running.values())).cache
    plain_s, spec_s, one_s = [], [], []
    for i in range(steps + 3):  # three warm-up rounds
        start = time.perf_counter()
        plain.step()
        middle = time.perf_counter()
        spec.step()
        end = time.perf_counter()
        one = measure_one_token(target, plain_cache)
        if i >= 3:
            plain_s.append(middle - start)
            spec_s.append(end - middle)
            one_s.append(one)
    t1 = min(one_s)
    plain_step = max(min(plain_s) / t1, 1.0)
    overhead = (min(spec_s) - min(plain_s)) / t1 - (interpolate(verify_cost, 2) - 1.0) - draft_cost
    return plain_step, max(overhead, 0.0)


def measure_one_token(target: Target, cache) -> float:
    n = len(cache)
    start = time.perf_counter()
    target.forward(torch.tensor([[3]], device=target.device), cache, torch.tensor([[n]], device=target.device))
    elapsed = time.perf_counter() - start
    cache.crop(n)
    return elapsed


def check_kind(kind: str) -> None:
    if kind not in ("dynamic", "static"):
        raise ValueError(f"tree kind must be 'dynamic' or 'static', got {kind!r}")


def tree_spec(choice: TreeChoice, kind: str) -> dict:
    """A sized tree as a spec file's dict: a DynamicTree budget (top_k covers the ranks used, depth the
    deepest node) or the static tree of exactly those nodes.

    A dynamic pick that is one path of top-1 tokens is written as a chain: the
    same tree, grown without ranking a frontier (measurably cheaper per step).
    """
    check_kind(kind)
    if kind == "static":
        return {"kind": "static", "choices": choice.choices}
    if choice.choices and all(set(p) == {0} for p in choice.choices) and len(choice.choices) == choice.depth:
        return {"kind": "chain", "depth": choice.depth}
    top_k = max((max(p) for p in choice.choices), default=0) + 1
    return {"kind": "dynamic", "top_k": max(top_k, 2), "depth": max(choice.depth, 1), "budget": max(len(choice.choices), 1)}


def shortlist(candidates: Sequence[TreeChoice]) -> list[TreeChoice]:
    """The predicted-fastest speculating tree of each depth: the trees worth timing for real."""
    best: dict[int, TreeChoice] = {}
    for c in candidates:
        if c.choices and (c.depth not in best or c.speedup > best[c.depth].speedup):
            best[c.depth] = c
    return [best[d] for d in sorted(best)]


def measure_speed(
    target: Target,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    trees: Sequence[TreePolicy | None],
    max_new_tokens: int,
) -> list[float]:
    """Committed tokens per second of each tree (None: plain decoding) over the prompts, timed as
    `specgraft bench` times its methods: interleaved, the order rotating from prompt to prompt."""
    runners = [engine_runner(str(i), target, drafter if t is not None else None, t) for i, t in enumerate(trees)]
    calibration = [BenchPrompt(str(n), "calibration", "") for n in range(len(prompts))]
    runs = run_interleaved(
        runners, calibration, [list(p) for p in prompts], max_new_tokens, warmup=0, progress=True,
        desc="timing candidate trees",
    )
    return [sum(len(r.tokens) for r in runs[str(i)]) / sum(r.wall_s for r in runs[str(i)]) for i in range(len(trees))]


@dataclass
class TuneResult:
    best: TreeChoice
    candidates: list[TreeChoice]
    acceptance: list[list[float]]
    verify_cost: dict[int, float]
    draft_cost: float
    plain_step: float = 1.0
    step_overhead: float = 0.0
    kind: str = "dynamic"
    # Timed on the calibration prompts: (tree spec, or None for plain decoding, tokens/s); empty when not timed.
    measured: list[tuple[dict | None, float]] = field(default_factory=list)

    def spec(self) -> dict:
        return tree_spec(self.best, self.kind)

    def dynamic_spec(self) -> dict:
        return tree_spec(self.best, "dynamic")

    def static_spec(self) -> dict:
        return tree_spec(self.best, "static")


def tune(
    target: Target,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    depth: int = 6,
    max_new_tokens: int = 64,
    nodes: int | None = None,
    kind: str = "dynamic",
    measure: bool = True,
) -> TuneResult:
    """Measure, size, then time the short list: the fastest tree, or with ``nodes`` the most valuable tree
    of that many draft nodes.

    The cost model ranks every size; the predicted-fastest tree of each depth
    is then run for real on the calibration prompts next to plain decoding
    (``measure``), and the fastest measured one is kept: the model does not
    see everything a step costs (the first draft round also runs the pairs
    just accepted, a dynamic round ranks top_k nodes).
    """
    if nodes is not None and nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    check_kind(kind)  # before anything is measured
    verify_cost = measure_verify_cost(target)
    draft_cost = measure_draft_cost(target, drafter, prompts[0])
    plain_step, overhead = measure_step_costs(target, drafter, prompts[0], verify_cost, draft_cost)
    acceptance = measure_acceptance(target, drafter, prompts, depth=depth, max_new_tokens=max_new_tokens)
    best, candidates = size_tree(
        acceptance, verify_cost, draft_cost, max_nodes=nodes, step_overhead=overhead, plain_step=plain_step
    )
    measured: list[tuple[dict | None, float]] = []
    if nodes is not None:
        best = candidates[-1]  # the largest size considered: exactly ``nodes`` unless fewer were measured
    else:
        if not best.choices:  # plain decoding wins here; still hand back the best tree that speculates
            best = max(candidates[1:], key=lambda c: c.speedup, default=best)
        if measure:
            listed = shortlist(candidates)
            specs = [tree_spec(c, kind) for c in listed]
            speeds = measure_speed(
                target, drafter, prompts, [None] + [tree_from_spec(s) for s in specs], max_new_tokens
            )
            measured = list(zip([None] + specs, speeds))
            best = max(zip(listed, speeds[1:]), key=lambda pair: pair[1])[0]
    return TuneResult(best, candidates, acceptance, verify_cost, draft_cost, plain_step, overhead, kind, measured)
