"""The sampling policy: logits -> the distribution actually sampled.

One object applies temperature, top-k, top-p, min-p and banned ids, and the
engine applies that same object to the target's logits (p) and the drafter's
(q). Filtering one side only is the classic silent bug of speculative
sampling; here it cannot happen because there is one function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch


@dataclass(frozen=True)
class SamplingPolicy:
    """Args mirror transformers' generation options; 0 / 1.0 disable a filter.

    Raises:
        ValueError: naming the bad option (negative temperature, top_p outside (0, 1], ...).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    banned_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        object.__setattr__(self, "banned_token_ids", tuple(int(i) for i in self.banned_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def ban(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits with banned ids at -inf: greedy decoding's argmax goes through this too."""
        if not self.banned_token_ids:
            return logits
        return logits.index_fill(-1, torch.tensor(self.banned_token_ids, device=logits.device), -torch.inf)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits or log-probs -> (..., V) normalised probabilities after every filter."""
        logits = self.ban(logits.float())
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, -torch.inf)
        probs = logits.softmax(-1)
        if self.top_p < 1.0:
            # Keep the smallest set of most likely tokens whose mass reaches top_p (the token crossing it included).
            sorted_p, order = probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
            drop_sorted = before >= self.top_p
            probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        if self.min_p > 0.0:
            probs = probs.masked_fill(probs < self.min_p * probs.amax(-1, keepdim=True), 0.0)
        return probs / probs.sum(-1, keepdim=True)


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


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A private RNG for drafting and verification: seeded runs repeat on the same machine and settings."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return generator


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a (V,) distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class Sampler:
    """A policy and its RNG: what tree policies draw draft tokens with, and verification samples with."""

    policy: SamplingPolicy
    generator: torch.Generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return self.policy.probs(logits)
