"""Run the flint-sched CLI with module constants set first, for A/B runs of a server on one machine:

    python3 benchmarks/with_constants.py "flint_sched.executor.graph_sampler.GUMBEL_MAX=False" serve flint ...

The first argument is ab_decode.py's assignment list (`module.ATTR=value`, comma-separated, value a
Python literal); the rest are the CLI's arguments. `serve_runs.sh` uses it when SERVE_SET is set.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flint_sched.benchmarks.ab_decode import set_constants  # noqa: E402
from flint_sched.cli import main as cli_main  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    for module, attr, value in set_constants(argv[0], "with_constants"):
        print(f"with_constants: {module.__name__}.{attr} = {value!r}", file=sys.stderr)
    return cli_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
