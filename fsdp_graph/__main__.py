"""`python -m fsdp_graph COMMAND` / `fsdp-graph COMMAND`: `train`, the main job."""

from __future__ import annotations

import sys

_USAGE = """usage: fsdp-graph COMMAND [options]

commands:
  train   train a Llama-style model on the shipped corpus (fsdp-graph train --help)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from fsdp_graph.train.job import cli

        return cli(rest)
    print(f"fsdp-graph: unknown command {command!r}\n\n{_USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
