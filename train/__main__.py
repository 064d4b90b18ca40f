"""``python -m specgraft.train CONFIG.yaml [section.key=value ...]``: `specgraft train` under a launcher.

The same command runs one process per device:

    deepspeed --num_gpus 8 --module specgraft.train CONFIG.yaml
    torchrun --nproc_per_node 8 -m specgraft.train CONFIG.yaml

(``deepspeed`` takes ``--module``, not ``-m``; it also passes ``--local_rank=N``,
which is accepted and ignored because LOCAL_RANK is in the environment too.)
"""

import logging
import sys

from specgraft.cli import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main(["train", *sys.argv[1:]]))
