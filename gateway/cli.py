"""The `tandem` command: one entry point, each subcommand owned by the package that implements it.

Subcommands are imported lazily so `tandem loadtest` does not load torch and `tandem serve` does not load the
load tester.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.server", "Run the OpenAI-compatible gateway (uvicorn)."),
    "generate": ("engines.generate_cli", "Generate a completion offline from a checkpoint folder."),
    "router": ("router_model.cli", "Train, calibrate and evaluate the prompt router."),
    "loadtest": ("traces.cli", "Replay realistic traffic against an OpenAI-compatible endpoint."),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: tandem <command> [options]\n\ncommands:")
        for name, (_, text) in SUBCOMMANDS.items():
            print(f"  {name:<10} {text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"tandem: unknown command {name!r}; choose one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
