"""The ``strata-jax`` console script: the engine's commands plus ``serve``."""

from __future__ import annotations

import argparse
import sys

from strata_jax.cli import build_parser, dispatch, run_reporting_model_errors


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    subparsers = next(
        a
        for a in parser._actions  # noqa: SLF001 - argparse has no public way to reach a parser's subcommands
        if isinstance(a, argparse._SubParsersAction) and a.dest == "command"  # noqa: SLF001 - as above
    )
    serve = subparsers.add_parser(
        "serve", help="start the gRPC and OpenAI-compatible HTTP servers (needs the serve extra)"
    )
    # serve's flags import the servers and the engine (jax, ~3 s): only build them for `serve`.
    if next((a for a in argv if not a.startswith("-")), None) != "serve":
        serve.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    else:
        try:
            from serving.server_cli import add_serve_arguments
        except ModuleNotFoundError as exc:  # the `serve` extra is not installed: say so before parsing any flag
            print(
                f"strata-jax serve: error: needs the serve extra ({exc.name} is missing): "
                "pip install 'strata-jax[serve]'",
                file=sys.stderr,
            )
            return 2
        add_serve_arguments(serve)
    args = parser.parse_args(argv)
    if args.command == "serve":
        from serving.server_cli import run_serve

        return run_reporting_model_errors(lambda: run_serve(args))
    return run_reporting_model_errors(lambda: dispatch(args))


if __name__ == "__main__":
    raise SystemExit(main())
