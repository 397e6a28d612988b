"""``python -m asps_jax [sample] ARGS``: the same command as ``asps-jax`` (asps_jax.cli.main)."""

import sys

from asps_jax.cli.main import console

if __name__ == "__main__":
    sys.exit(console())
