"""``python -m tests.golden [--update] [NAME ...]``: compare (or rewrite) the golden plans."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # tests/: ``import zoo``

from tests.golden import CASES, PLANS, current, diff, path  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--update", action="store_true", help="rewrite the stored plans")
    parser.add_argument("names", nargs="*", help=f"cases (default: all {len(CASES)})")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    PLANS.mkdir(exist_ok=True)
    changed = 0
    for name in args.names or list(CASES):
        now = current(name)
        if path(name).exists() and path(name).read_text() == now:
            continue
        changed += 1
        if args.update:
            path(name).write_text(now)
            print(f"wrote {path(name)}")
        else:
            print(diff(name, now))
    print(f"{changed} plan(s) {'rewritten' if args.update else 'differ'}")
    return 1 if changed and not args.update else 0


if __name__ == "__main__":
    sys.exit(main())
