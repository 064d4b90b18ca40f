"""The thread count: one thread for small models, the user's choice kept, bad values refused before loading."""

from __future__ import annotations

import os

import pytest
import torch

import specgraft as sg
from conftest import tiny_causal_lm
from specgraft import threads
from specgraft.threads import ONE_THREAD_BELOW, choose_threads


@pytest.fixture
def restore_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_small_models_get_one_thread_and_larger_ones_the_idle_cores(restore_threads, monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads, "idle_cores", lambda: 1.9)  # an otherwise quiet 2-core machine
    assert choose_threads(260_000).threads == 1  # faster on one thread even when both cores are free
    choice = choose_threads(135_000_000)  # SmolLM2: 1.5x faster on two idle cores
    assert choice.threads == 2 and "1.9 of 2 idle" in choice.why
    monkeypatch.setattr(threads, "idle_cores", lambda: 0.9)  # another job holds a core: 7x slower on two
    assert choose_threads(135_000_000).threads == 1
    monkeypatch.setattr(threads, "idle_cores", lambda: 0.0)
    assert choose_threads(ONE_THREAD_BELOW).threads == 1  # never fewer than one
    monkeypatch.setattr(threads, "idle_cores", lambda: 7.5)  # idle cores this process may not use
    assert choose_threads(ONE_THREAD_BELOW).threads == 2
    monkeypatch.setattr(threads, "idle_cores", lambda: None)  # no /proc/stat: every available core
    assert choose_threads(ONE_THREAD_BELOW).threads == 2
    assert choose_threads(8_000_000_000, "cuda").threads is None  # torch's own setting on an accelerator


def test_idle_cores_reads_this_machine():
    idle = threads.idle_cores(0.05)
    if idle is None:
        pytest.skip("no /proc/stat here (not Linux)")
    assert 0.0 <= idle <= (os.cpu_count() or 1) + 1e-9


def test_an_explicit_count_or_omp_num_threads_wins(monkeypatch, restore_threads):
    assert choose_threads(260_000, requested=3) == choose_threads(8_000_000_000, requested=3)
    assert choose_threads(260_000, requested=None).threads is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(260_000).threads == 2


def test_load_target_pins_one_thread_for_a_small_model(restore_threads):
    torch.set_num_threads(2)
    sg.load_target(tiny_causal_lm(), threads="auto")
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    sg.load_target(tiny_causal_lm(), threads=None)
    assert torch.get_num_threads() == 2


def test_a_bad_thread_count_fails_before_the_model_loads(restore_threads):
    with pytest.raises(ValueError, match="threads must be 'auto', None or a positive int, got 0"):
        sg.load_target("/nonexistent/target", threads=0)  # not the missing path's FileNotFoundError
