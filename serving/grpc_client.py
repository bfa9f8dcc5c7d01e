"""A small blocking Python client of the gRPC face.

    with StrataClient("127.0.0.1:50051") as client:
        for msg in client.generate("Hello", max_tokens=8):
            print(msg.text, end="")

Also runnable: ``python -m serving.grpc_client --target 127.0.0.1:50051 "Hello"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.protos import strata_pb2, strata_pb2_grpc


class StrataClient:
    """Blocking client: ``generate`` streams ``GenerateResponse`` messages."""

    def __init__(self, target: str, *, api_key: str | None = None, max_message_bytes: int = 64 << 20) -> None:
        self.channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
            ],
        )
        self.stub = strata_pb2_grpc.StrataStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def __enter__(self) -> StrataClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(
        self,
        prompt: str | list[int],
        *,
        cache_salt: str = "",
        request_id: str = "",
        lora_name: str = "",
        timeout: float | None = None,
        **params: Any,
    ) -> grpc.Call:
        """Start a ``Generate`` stream; iterate it for messages, ``.cancel()`` it to abort.

        ``params`` are ``SamplingParams`` fields (max_tokens, temperature, stop, ...);
        ``lora_name``: a loaded LoRA adapter ("" for the base model).
        """
        request = strata_pb2.GenerateRequest(
            params=strata_pb2.SamplingParams(**params),
            cache_salt=cache_salt,
            request_id=request_id,
            lora_name=lora_name,
        )
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return self.stub.Generate(request, timeout=timeout, metadata=self._metadata)

    def complete(self, prompt: str | list[int], **kwargs: Any) -> tuple[str, strata_pb2.GenerateResponse | None]:
        """Run ``generate`` to the end; returns the full text and the final message."""
        text, last = [], None
        for msg in self.generate(prompt, **kwargs):
            text.append(msg.text)
            last = msg
        return "".join(text), last

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """``SERVING`` / ``NOT_SERVING`` / ... from ``grpc.health.v1``."""
        reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def cache_stats(self) -> dict:
        reply = self.stub.GetCacheStats(strata_pb2.GetCacheStatsRequest(), metadata=self._metadata)
        return json.loads(reply.json)

    def flush_cache(self, tier: str = "all") -> None:
        self.stub.FlushCache(strata_pb2.FlushCacheRequest(tier=tier), metadata=self._metadata)

    def start_profile(self, log_dir: str = "") -> str:
        return self.stub.StartProfile(strata_pb2.StartProfileRequest(log_dir=log_dir), metadata=self._metadata).log_dir

    def stop_profile(self) -> str:
        return self.stub.StopProfile(strata_pb2.StopProfileRequest(), metadata=self._metadata).trace_dir


def _stream_text(messages: Iterator[strata_pb2.GenerateResponse]) -> strata_pb2.GenerateResponse | None:
    last = None
    for msg in messages:
        sys.stdout.write(msg.text)
        sys.stdout.flush()
        last = msg
    sys.stdout.write("\n")
    return last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stream one completion from a strata-jax gRPC server.")
    parser.add_argument("prompt", help="prompt text")
    parser.add_argument("--target", default="127.0.0.1:50051", help="host:port of the gRPC server")
    parser.add_argument("--api-key", default=None, help="API key, if the server needs one")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    args = parser.parse_args(argv)
    with StrataClient(args.target, api_key=args.api_key) as client:
        try:
            last = _stream_text(client.generate(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature))
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    if last is not None:
        print(f"[{last.finish_reason}] usage: {last.usage}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
