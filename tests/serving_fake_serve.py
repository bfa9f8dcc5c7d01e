"""`strata-jax serve` stand-in over the fake engine (for the SIGTERM test before the engine exists)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from serving_fake_engine import FakeEngine, FakeEngineConfig

from serving.config import ServerConfig
from serving.server import StrataServer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True, help="HTTP port")
    parser.add_argument("--grpc-port", type=int, required=True, help="gRPC port")
    parser.add_argument("--grace-s", type=float, default=10.0, help="shutdown grace period")
    args = parser.parse_args()
    config = ServerConfig(port=args.port, grpc_port=args.grpc_port, grace_s=args.grace_s)
    server = StrataServer(config, lambda: FakeEngine(FakeEngineConfig(step_s=0.02)))
    return asyncio.run(server.serve(handle_signals=True))


if __name__ == "__main__":
    sys.exit(main())
