"""The same engine on a GPU (``device="cuda"``): batched and single generations equal HF greedy there.

Marked ``cuda`` and skipped without a CUDA device; run ``pytest -m cuda`` on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch
from conftest import STORIES

import specgraft as sg

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]

BRANCHING_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def cuda_stories():
    if not STORIES.is_dir():
        pytest.skip(f"../shared assets are absent ({STORIES} not found)")
    return sg.load_target(STORIES, device="cuda")


def hf_greedy(target: sg.Target, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids], device="cuda")
    out = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["plain", "prompt_lookup", "self_tree"])
def test_batched_generation_on_cuda_equals_hf_greedy(cuda_stories, dev_prompts, kind):
    drafter = {"plain": None, "prompt_lookup": sg.PromptLookup(), "self_tree": sg.DraftModel(cuda_stories, cuda_stories)}[kind]
    gen = sg.SpeculativeGenerator(cuda_stories, drafter, tree=sg.StaticTree(BRANCHING_TREE))
    prompts = [cuda_stories.encode(p) for p in dev_prompts[:6]]
    budgets = [40, 17, 33, 48, 9, 25]
    outs = gen.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=())
    for ids, n, out in zip(prompts, budgets, outs):
        want = hf_greedy(cuda_stories, ids, n)
        assert out.token_ids == want
        assert gen.generate(ids, max_new_tokens=n, eos_token_id=()).token_ids == want
