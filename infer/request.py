"""One generation as the scheduler runs it: its options, checked once at submission, and its own state.

Everything that belongs to one generation lives here (its drafter's state,
sampling and RNG, stop rule, detokenizer, stats, cache row), so rows never
see each other; what every generation shares (the target, loaded drafters,
the KV pool) belongs to the `Scheduler`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specgraft.heads.base import Drafter, DraftState
from specgraft.infer.detokenize import Detokenizer, prompt_context
from specgraft.infer.stats import StatsRecorder
from specgraft.infer.stopping import StopRule
from specgraft.infer.verify import AcceptRule, is_lossless
from specgraft.model import KVCache, StaticKVCache, Target
from specgraft.tree import Adaptive, Sampling, TreePolicy



@dataclass(frozen=True)
class PromptIds:
    """A prompt already checked against the target (`check_prompt`): submitting it checks nothing again."""

    ids: torch.Tensor  # (S,) long, on the target's device


Prompt = str | Sequence[int] | torch.Tensor | PromptIds


@dataclass(eq=False)  # one generation: compared by identity (its fields' == would compare tensors and states)
class Request:
    """One submitted generation: what it asked for, then (from admission on) its state.

    Invariant between steps, once admitted: ``cache`` holds every committed
    token but ``root``, which the next step's forward runs first.
    """

    handle: int
    prompt_ids: torch.Tensor  # (S,)
    drafter_name: str
    drafter: Drafter | None
    tree: TreePolicy
    sampling: Sampling
    acceptance: AcceptRule
    rule: StopRule
    recorder: StatsRecorder
    text: Detokenizer | None  # the one incremental detokenizer: stop strings and streamed text
    text_context: list[int]  # the prompt tokens the output's text is decoded after (`prompt_context`)
    cache: KVCache | StaticKVCache | None = None  # its row of the scheduler's pool, or its own (HF forward)
    row: int | None = None
    draft_row: int | None = None  # its row of its drafter's draft pool, if the drafter keeps one
    draft: DraftState | None = None
    root: int | None = None
    root_tensor: torch.Tensor | None = None  # ``root`` as the (1,) device tensor it was chosen in, where it was one
    drafted: bool = False  # this step's tree is its drafter's proposal (not the root alone)
    draft_kv: int = 0  # its draft state's `cache_tokens` as it last moved (it moves only as the state drafts or is given)
    # Tokens given to its draft state since it last proposed (the prompt, then commits): what a drafter with a
    # cache catches up on in its next round, which the goodput controller's draft cost reads.
    behind: int = 0
    # Commits of the root alone not given to its draft state yet: its row's index in the scheduler's held states,
    # and the root, of each; given as one commit when it next drafts (see `specgraft.infer.held`).
    deferred: list[int] = field(default_factory=list)
    deferred_roots: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    record: bool = True  # observers that read states (a traffic recorder) may keep its tokens and states
    released: int = 0  # characters of ``text`` already sent in events

    hidden_layers: tuple[int, ...] = field(init=False)  # the target states its drafter reads
    adaptive: bool = field(init=False)  # a drafter whose trees the goodput controller sizes (an `Adaptive` tree)

    def __post_init__(self) -> None:
        self.hidden_layers = tuple(self.drafter.hidden_layers) if self.drafter is not None else ()
        self.adaptive = self.drafter is not None and isinstance(self.tree, Adaptive)


def new_request(
    target: Target,
    handle: int,
    prompt: Prompt,
    max_new_tokens: int = 128,
    *,
    max_len: int,
    drafter_name: str,
    drafter: Drafter | None,
    tree: TreePolicy,
    acceptance: AcceptRule,
    text: bool = False,
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
    record: bool = True,
) -> Request:
    """Check a generation's prompt and options once; its `Request`, nothing run yet.

    Args:
        prompt: text (encoded with the target's tokenizer), token ids, or `PromptIds` checked before.
        max_new_tokens: most tokens to generate.
        max_len: most tokens (prompt + new) the scheduler's rows hold.
        text: detokenize as tokens arrive, for streamed text (stop strings do it anyway).
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
        record: False keeps its tokens and states from observers that record traffic (see `StepObserver.layers`).

    Raises:
        ValueError: naming the bad option or the sizes that do not fit.
        NotImplementedError: a non-neutral penalty.
    """
    check_prefix_free(repetition_penalty, presence_penalty)
    sampling = Sampling(temperature, top_k, top_p, min_p, tuple(banned_token_ids))
    if sampling.greedy and not is_lossless(acceptance):
        raise ValueError(f"acceptance={acceptance.__name__} needs temperature > 0 (greedy acceptance is already exact)")
    if not sampling.greedy:
        sampling = sampling.seeded(seed, target.device)
    prompt_ids = check_prompt(target, prompt).ids
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    total = len(prompt_ids) + max_new_tokens
    if total > target.max_context:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
            f"context of {target.max_context} tokens"
        )
    if total > max_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"this scheduler's max_len of {max_len} tokens"
        )
    eos = target.eos_token_ids if eos_token_id is None else (
        (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    )
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    context = prompt_context(target.decode, prompt_ids.tolist()) if target.tokenizer is not None else []
    detokenizer = Detokenizer(target.decode, context) if target.tokenizer is not None and (text or stops) else None
    return Request(
        handle=handle, prompt_ids=prompt_ids, drafter_name=drafter_name, drafter=drafter, tree=tree, sampling=sampling,
        acceptance=acceptance, rule=StopRule(max_new_tokens, eos, stops, detokenizer),
        recorder=StatsRecorder(lossless=is_lossless(acceptance)), text=detokenizer, text_context=context,
        record=bool(record),
    )


def check_prompt(target: Target, prompt: Prompt) -> PromptIds:
    """The token ids of a text prompt (the target's tokenizer), a list of ids or a (S,) / (1, S) tensor.

    Raises:
        ValueError: an empty prompt, a batch of prompts, or ids outside the vocabulary.
    """
    if isinstance(prompt, PromptIds):
        return prompt
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        ids = target.encode(prompt)
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise ValueError(f"prompt tensor has shape {tuple(prompt.shape)}: pass one sequence, (S,) or (1, S)")
        ids = prompt.flatten().tolist()
    else:
        ids = list(prompt)
    if not ids:
        raise ValueError("prompt is empty: it has no tokens")
    vocab = target.vocab_size  # once: a property that looks the model's output layer up (12 us a token, in a loop)
    if not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
    return PromptIds(torch.tensor(ids, dtype=torch.long, device=target.device))


def check_prefix_free(repetition_penalty: float, presence_penalty: float) -> None:
    """Refuse options whose distribution depends on each tree node's own path.

    They would need a different p per node; rather than approximate them
    silently, specgraft refuses them.
    """
    for name, value, neutral in (("repetition_penalty", repetition_penalty, 1.0), ("presence_penalty", presence_penalty, 0.0)):
        if value != neutral:
            raise NotImplementedError(
                f"{name}={value} depends on each draft path's own tokens and is not supported by exact "
                f"speculative sampling in specgraft; leave it at {neutral}"
            )
