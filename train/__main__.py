"""``python -m specgraft.train CONFIG.yaml [section.key=value ...]``: train a draft head.

The same command runs under a launcher, one process per device:

    deepspeed --num_gpus 8 --module specgraft.train CONFIG.yaml
    torchrun --nproc_per_node 8 -m specgraft.train CONFIG.yaml

(``deepspeed`` takes ``--module``, not ``-m``; it also appends ``--local_rank=N``,
which is accepted and ignored here because LOCAL_RANK is in the environment too.)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from specgraft.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specgraft.train", description="Train a draft head on a frozen target.")
    parser.add_argument("config", help="YAML training config")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.lr=1e-3")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)  # every config error surfaces before a model loads
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from specgraft.train.pipeline import run_training

    head_dir = run_training(cfg)
    if os.environ.get("RANK", "0") == "0":
        print(f"head written to {head_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
