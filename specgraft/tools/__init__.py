"""Programs built on specgraft's public API: bench (offline, batch, server), tune-tree, check-exactness, the
quickstart and its demo target. The engine never imports them; `specgraft.cli` runs them."""
