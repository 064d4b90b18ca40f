"""`specgraft.progress`: a bar on a terminal, plain lines now and then anywhere else."""

from __future__ import annotations

import io

import pytest

from specgraft import progress as pg


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(pg.time, "monotonic", clock)
    return clock


def test_off_a_terminal_a_loop_writes_a_line_every_interval_and_one_at_the_end(clock, capsys):
    bar = pg.progress_bar(total=100, desc="train", unit="step")
    assert isinstance(bar, pg.PlainProgress)  # pytest's stderr is not a terminal
    for step in range(100):
        clock.now += 1.0  # 100 s in all: a line at 30, 60 and 90 s, and the last
        bar.update(1)
        bar.set_postfix(loss=f"{1 / (step + 1):.2f}")
    bar.close()
    bar.close()  # a second close adds nothing
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines() == [
        "train: 30/100 step (30%), 0m30s, loss=0.03",
        "train: 60/100 step (60%), 1m00s, loss=0.02",
        "train: 90/100 step (90%), 1m30s, loss=0.01",
        "train: 100/100 step (100%), 1m40s, loss=0.01",
    ]


def test_a_wrapped_iterable_counts_itself_and_a_disabled_one_says_nothing(clock, capsys):
    assert list(pg.progress_bar(range(3), desc="bench", unit="prompt")) == [0, 1, 2]
    assert capsys.readouterr().err == "bench: 3/3 prompt (100%), 0m00s\n"
    assert list(pg.progress_bar(range(3), desc="bench", enabled=False)) == [0, 1, 2]
    with pg.progress_bar(total=5, desc="quiet", leave=False) as bar:
        bar.update(5)
    assert capsys.readouterr().err == ""


def test_a_terminal_gets_a_tqdm_bar(monkeypatch):
    from tqdm.auto import tqdm

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(pg.sys, "stderr", Terminal())
    with pg.progress_bar(total=2, desc="train") as bar:
        assert isinstance(bar, tqdm)
        bar.update(2)
    assert "\r" in pg.sys.stderr.getvalue()


def test_quiet_libraries_turns_off_the_weight_loading_bar():
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    try:
        pg.quiet_libraries()
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.disable_progress_bar()
