"""``toolspec`` command: each subcommand lives in the package that owns it, imported lazily."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("deployments.cli", "serve_main", "start the OpenAI-compatible server (Ray Serve) on embedded defaults"),
    "demo": ("deployments.cli", "demo_main", "start the server, make one real tool call against it, stop"),
    "bench": ("benchmarks.cli", "bench_main", "run the side-by-side benchmark and write a report"),
    "bench-cost": ("benchmarks.cost", "main", "measure the verify-cost curve of a model shape"),
    "loadtest": ("benchmarks.loadtest", "main", "load-test OpenAI-compatible endpoints"),
    "generate": ("toolspec_core.quick", "main", "decode one prompt with a method (debugging)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: toolspec {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, _, doc) in COMMANDS.items():
            print(f"  {name:12s} {doc}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, func, _ = COMMANDS[argv[0]]
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
