"""Sampling: logits -> the distribution a generation actually samples, and its random draws.

One object holds a generation's filters (temperature, top-k, top-p, min-p,
banned ids) and its RNG. The engine applies that same object to the
target's logits (p) and the drafter's (q), and every random token, drafted
or verified, is drawn through `Sampling.draw`. Filtering one side only is
the classic silent bug of speculative sampling; with one function it cannot
happen.

It lives in `tree` because tree policies draw sampled children with it,
and `tree` imports nothing of the engine's; the engine and the drafters
import it from here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Sampling:
    """Filters as transformers' generation options name them (0 / 1.0 disable one), and the RNG draws use.

    Args:
        temperature: 0 is greedy (argmax after banned ids); above 0 the logits are divided by it.
        top_k, top_p, min_p, banned_token_ids: filters applied in that order, then renormalised.
        generator: the generation's private RNG (`seeded`); None draws from torch's global RNG.

    Raises:
        ValueError: naming the bad option (negative temperature, top_p outside (0, 1], ...).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    banned_token_ids: tuple[int, ...] = ()
    generator: torch.Generator | None = field(default=None, compare=False, repr=False)

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

    def seeded(self, seed: int | None, device: torch.device | str = "cpu") -> Sampling:
        """This sampling with a private RNG: a seeded run repeats on the same machine and settings.

        None seeds the RNG from torch's global one (so ``torch.manual_seed`` still makes a run repeat).
        """
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return dataclasses.replace(self, generator=generator)

    def ban(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits with banned ids at -inf: greedy decoding's argmax goes through this too."""
        if not self.banned_token_ids:
            return logits
        return logits.index_fill(-1, _banned_index(self.banned_token_ids, logits.device), -torch.inf)

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

    def draw(self, probs: torch.Tensor, k: int = 1, *, replacement: bool = True) -> torch.Tensor:
        """``k`` tokens from each (..., V) distribution: (..., k), drawn with this sampling's RNG."""
        return torch.multinomial(probs, k, replacement=replacement, generator=self.generator)

    def draw_one(self, probs: torch.Tensor) -> int:
        """One token from a (V,) distribution."""
        return int(self.draw(probs)[0])


@functools.lru_cache(maxsize=256)
def _banned_index(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Banned ids as an index tensor on ``device``, made once per set and device (every step bans them, and a
    tensor built from a tuple is a copy to the device each time)."""
    return torch.tensor(ids, dtype=torch.long, device=device)
