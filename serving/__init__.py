"""Faces of the engine: gRPC, OpenAI-compatible HTTP, metrics, CLI glue."""
