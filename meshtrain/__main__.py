"""``python -m meshtrain``: the command line (see :mod:`meshtrain.cli`)."""

from meshtrain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
