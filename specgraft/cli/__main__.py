"""``python -m specgraft.cli``: the `specgraft` command, for environments without the console script."""

import sys

from specgraft.cli import main

sys.exit(main())
