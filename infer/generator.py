"""SpeculativeGenerator: the one decode loop.

Each step: the drafter grows a tree from the last committed token (the
root), the target runs every node in one forward with tree attention, an
acceptance rule picks the path it agrees with, and the target's cache and the
drafter keep only that path. ``generate`` consumes ``stream``; there is no
second loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from specgraft.heads.base import Drafter, DraftRequest, DraftState
from specgraft.infer.detokenize import Detokenizer
from specgraft.infer.sampling import Sampler, SamplingPolicy, check_prefix_free, make_generator
from specgraft.infer.scheduler import Scheduler, per_prompt_options
from specgraft.infer.stats import GenerationStats, StatsRecorder
from specgraft.infer.stopping import StopRule
from specgraft.infer.verify import Acceptance, greedy_accept, sample_accept, typical_accept
from specgraft.model import KVCache, StaticKVCache, Target
from specgraft.tree import Chain, Tree, TreePolicy, tree_attention_mask, tree_position_ids

Prompt = str | Sequence[int] | torch.Tensor


@dataclass
class StreamChunk:
    """Tokens committed by one step (after stop rules) and their text; ``stats`` on the last chunk only."""

    token_ids: list[int]
    text: str
    stats: GenerationStats | None = None


@dataclass
class GenerationOutput:
    token_ids: list[int]  # generated ids only, prompt excluded
    text: str
    stats: GenerationStats


class SpeculativeGenerator:
    """Generates with a frozen target, faster by drafting and verifying trees.

    Args:
        target: the frozen target from `load_target`.
        drafter: any `Drafter`; None decodes plainly (one target call per token)
            through the same loop, as our own baseline.
        tree: how the drafter's tree grows (`Chain`, `StaticTree`, ...).
        acceptance: ``"exact"`` (default: output follows the target exactly) or
            ``"typical"`` — Medusa's LOSSY typical acceptance, which changes the
            output distribution for speed and reports ``stats.lossless == False``.
    """

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        tree: TreePolicy | None = None,
        *,
        acceptance: str = "exact",
    ) -> None:
        if acceptance not in ("exact", "typical"):
            raise ValueError(f"acceptance={acceptance!r} must be 'exact' or 'typical' (lossy)")
        self.acceptance = acceptance
        if not isinstance(target, Target):
            raise TypeError(f"target must be a specgraft Target (use sg.load_target), got {type(target).__name__}")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"drafter {type(drafter).__name__} does not implement the Drafter protocol")
        self.target = target
        self.drafter = drafter
        self.tree = tree if tree is not None else Chain(depth=5)

    def generate(self, prompt: Prompt, max_new_tokens: int = 128, **options) -> GenerationOutput:
        """Generate a completion; takes the same options as `stream` (the same loop, without per-step text)."""
        ids: list[int] = []
        for event in self._start(prompt, max_new_tokens, **options):
            if isinstance(event, GenerationStats):
                return GenerationOutput(token_ids=ids, text=self.target.decode(ids), stats=event)
            ids.extend(event)
        raise AssertionError("the decode loop ended without stats")

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, **options) -> Iterator[StreamChunk]:
        """Yield committed tokens step by step with their text; the last chunk carries the stats.

        Takes the options of `_begin` (temperature, top_k, top_p, min_p,
        banned_token_ids, seed, eos_token_id, stop, ...).
        """
        yield from _stream_text(self.target, self._start(prompt, max_new_tokens, **options))

    def scheduler(self, max_batch_size: int = 16, max_len: int | None = None) -> Scheduler:
        """A continuous-batching scheduler over this generator's target, drafter and tree (see `Scheduler`)."""
        return Scheduler(self, max_batch_size=max_batch_size, max_len=max_len)

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int | Sequence[int] = 128, **options) -> list[GenerationOutput]:
        """Generate a completion for each prompt, all of them advancing together step by step.

        Each option (as `generate` takes them) is one value for every prompt or a
        list with one value per prompt; see `per_prompt_options`.
        """
        sched = self.scheduler(max_batch_size=max(1, len(prompts)))
        handles = [
            sched.submit(prompt, **opts)
            for prompt, opts in zip(prompts, per_prompt_options(len(prompts), max_new_tokens=max_new_tokens, **options))
        ]
        while not all(sched.finished(h) for h in handles):
            sched.step()
        return [sched.result(h) for h in handles]

    def _start(self, prompt: Prompt, max_new_tokens: int = 128, **options) -> Iterator[list[int] | GenerationStats]:
        """Validate the options and run the decode loop: lists of committed tokens, then the stats."""
        decoding, rule = self._begin(prompt, max_new_tokens, **options)
        return decoding.run(rule)

    def _begin(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        banned_token_ids: Sequence[int] = (),
        seed: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        stop: str | Sequence[str] | None = None,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
    ) -> tuple[Decoding, StopRule]:
        """Validate the options; the generation's own `Decoding` and `StopRule`, nothing run yet.

        Args:
            prompt: text (encoded with the target's tokenizer) or token ids.
            max_new_tokens: most tokens to generate.
            temperature: 0 for greedy decoding, token-identical to the target's own;
                above 0, exact speculative sampling from the filtered distribution.
            top_k, top_p, min_p, banned_token_ids: filters applied alike to target and draft.
            seed: makes a run repeat on the same machine and settings. It does not
                reproduce the string plain sampling gives with the same seed: the
                random numbers are consumed differently; the distribution is the same.
            eos_token_id: ids that end the output; None uses the target's, () none.
            stop: strings that end the output once generated text contains one.
            repetition_penalty, presence_penalty: refused unless neutral (they need
                a different p for every draft path).
        """
        check_prefix_free(repetition_penalty, presence_penalty)
        policy = SamplingPolicy(temperature, top_k, top_p, min_p, tuple(banned_token_ids))
        if policy.greedy and self.acceptance == "typical":
            raise ValueError("acceptance='typical' needs temperature > 0 (greedy acceptance is already exact)")
        sampler = None if policy.greedy else Sampler(policy, make_generator(seed, self.target.device))
        prompt_ids = self._prompt_ids(prompt)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if len(prompt_ids) + max_new_tokens > self.target.max_context:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
                f"context of {self.target.max_context} tokens"
            )
        eos = self.target.eos_token_ids if eos_token_id is None else (
            (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
        )
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        decode = self.target.decode if self.target.tokenizer is not None else None
        rule = StopRule(max_new_tokens, eos, stops, decode)
        decoding = Decoding(self.target, self.drafter, self.tree, prompt_ids, policy, sampler, self.acceptance)
        return decoding, rule

    def _prompt_ids(self, prompt: Prompt) -> torch.Tensor:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.target.encode(prompt)
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
                raise ValueError(f"prompt tensor has shape {tuple(prompt.shape)}: pass one sequence, (S,) or (1, S)")
            ids = prompt.flatten().tolist()
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty: it has no tokens")
        if not all(isinstance(i, int) and 0 <= i < self.target.vocab_size for i in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.target.vocab_size})")
        return torch.tensor(ids, dtype=torch.long, device=self.target.device)


@dataclass
class StepResult:
    tokens: list[int]  # committed by this step: accepted draft tokens, then the target's own
    draft_tokens: int  # tree nodes the drafter proposed
    kv_tokens: int  # target + draft KV positions held at verification


class Decoding:
    """One generation in progress: owns the target's cache and the root token.

    Invariant between steps: the target's cache holds every committed token
    but the root, which the next step's forward runs first.
    """

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None,
        policy: TreePolicy,
        prompt_ids: torch.Tensor,
        sampling: SamplingPolicy | None = None,
        sampler: Sampler | None = None,
        acceptance: str = "exact",
        cache: KVCache | StaticKVCache | None = None,
    ) -> None:
        self.target, self.drafter, self.policy = target, drafter, policy
        self.prompt_ids = prompt_ids
        self.sampling = sampling or SamplingPolicy(temperature=0.0)
        self.sampler = sampler  # None: greedy
        self.acceptance = acceptance
        self.cache = cache if cache is not None else target.new_cache()  # a scheduler passes its row
        self.draft_cache: StaticKVCache | None = None  # a scheduler's row of a batch drafter's cache, set before prefill
        self.hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()
        self.draft: DraftState | None = None  # this generation's own drafter state, from prefill on
        self.root: int | None = None
        self.recorder = StatsRecorder(lossless=acceptance == "exact")

    def prefill(self) -> int:
        """Run the prompt; the target's choice after it becomes the root."""
        ids = self.prompt_ids[None]  # (1, S)
        out = self.target.forward(
            ids, self.cache, torch.arange(ids.shape[1], device=ids.device)[None], hidden_layers=self.hidden_layers,
            last_only=True,
        )
        if self.drafter is not None:
            hidden = {i: h[0] for i, h in out.hidden.items()}
            if self.draft_cache is None:
                self.draft = self.drafter.start(self.prompt_ids, hidden)
            else:
                self.draft = self.drafter.start(self.prompt_ids, hidden, cache=self.draft_cache)
        last = out.logits[0, -1]
        if self.sampler is None:
            self.root = int(self.sampling.ban(last).argmax())
        else:
            self.root = int(torch.multinomial(self.sampler.probs(last), 1, generator=self.sampler.generator))
        self.recorder.first_token()
        self.recorder.observe_kv(len(self.cache))
        return self.root

    def step(self, max_depth: int) -> StepResult:
        """Draft, verify and commit once."""
        prefix = len(self.cache)
        tree = self.propose(max_depth)
        mask = None if tree.is_chain else tree_attention_mask(tree, prefix, self.target.dtype)
        out = self.target.forward(
            tree.tokens[None], self.cache, tree_position_ids(tree, prefix), mask, hidden_layers=self.hidden_layers
        )
        return self.commit(tree, prefix, out.logits[0], {i: h[0] for i, h in out.hidden.items()})

    def propose(self, max_depth: int) -> Tree:
        """This step's tree: the drafter's, or the root alone (plain decoding, or no room left to draft)."""
        if self.draft is None or max_depth < 1:
            return Tree.root_only(self.root, self.target.device)
        return self.draft.propose(self.root, self.policy, max_depth, self.sampler).to(self.target.device)

    def draft_request(self, max_depth: int, row: int) -> DraftRequest | None:
        """This step's draft as a request a batch drafter serves with other rows' (None: nothing to draft)."""
        if self.draft is None or max_depth < 1:
            return None
        return DraftRequest(self.draft, self.root, self.policy, max_depth, self.sampler, row)

    def commit(self, tree: Tree, prefix: int, logits: torch.Tensor, hidden: dict[int, torch.Tensor]) -> StepResult:
        """Accept a path of the verified ``tree`` and keep only it, in the target's cache and the drafter's.

        Args:
            tree: the step's tree, its nodes in the cache's slots from ``prefix`` on (padding may follow).
            logits: (N, V) the target's logits at the tree's nodes; hidden: layer -> (N, H) at them.
        """
        kv_peak = prefix + tree.num_nodes + (self.draft.cache_tokens() if self.draft is not None else 0)
        accepted = self._accept(tree, logits)
        self.cache.keep(prefix, accepted.path)  # rows of the accepted nodes, root first
        if self.draft is not None:
            self.draft.commit(tree.tokens[accepted.path], {i: h[accepted.path] for i, h in hidden.items()})
        self.root = accepted.next_token
        tokens = tree.tokens[accepted.path[1:]].tolist() + [accepted.next_token]
        return StepResult(tokens=tokens, draft_tokens=tree.num_draft_tokens, kv_tokens=kv_peak)

    def _accept(self, tree: Tree, logits: torch.Tensor) -> Acceptance:
        if self.sampler is None:
            return greedy_accept(tree, self.sampling.ban(logits))
        p = self.sampler.probs(logits)  # (N, V) the same filters the draft's q went through
        if self.acceptance == "typical":
            return typical_accept(tree, p, self.sampler.generator)
        return sample_accept(tree, p, self.sampler.generator)

    def advance(self, rule: StopRule) -> list[int]:
        """Prefill on the first call, then one step; the tokens ``rule`` keeps."""
        if self.root is None:
            return rule.accept([self.prefill()])
        self.recorder.begin_step()
        return self.record(rule, self.step(max_depth=rule.remaining() - 1))

    def record(self, rule: StopRule, result: StepResult) -> list[int]:
        """Pass a step's tokens through ``rule`` and into the stats; the tokens kept."""
        kept = rule.accept(result.tokens)
        self.recorder.end_step(len(result.tokens), len(kept), result.draft_tokens, result.kv_tokens)
        return kept

    def run(self, rule: StopRule) -> Iterator[list[int] | GenerationStats]:
        """Yield the kept tokens of each step, then the final stats."""
        yield self.advance(rule)
        while not rule.done:
            yield self.advance(rule)
        yield self.recorder.finish()


def _stream_text(target: Target, events: Iterator[list[int] | GenerationStats]) -> Iterator[StreamChunk]:
    """Turn token events into chunks with text deltas, decoding only the newest tokens (`Detokenizer`).

    The last chunk reconciles with one full decode, releasing any held-back text.
    """
    text = Detokenizer(target.decode)
    for event in events:
        if isinstance(event, GenerationStats):
            yield StreamChunk(token_ids=[], text=target.decode(text.ids)[len(text.text):], stats=event)
            return
        yield StreamChunk(token_ids=event, text=text.add(event))
