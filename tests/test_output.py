"""The output side alone: one stream's failure (its detokenizer, its sink) is its own; every
other stream of the same step still gets its chunks; final-only sinks get the last chunk."""

from __future__ import annotations

from strata_jax.api import SamplingParams
from strata_jax.engine.output import OutputProcessor, OutputStream, TokenEvent
from strata_jax.engine.sinks import CollectingSink, OutputSink, deliver


class _Broken(OutputSink):
    def __init__(self) -> None:
        self.failed: BaseException | None = None

    def push(self, chunk) -> None:
        raise OSError("client gone")

    def fail(self, exc: BaseException) -> None:
        self.failed = exc


class _BadDetok:
    def push(self, ids):
        raise ValueError("bad bytes")

    def flush(self):
        return ""


class _FinalOnly(CollectingSink):
    final_only = True


def _stream(name: str, sink: OutputSink, detok=None) -> OutputStream:
    return OutputStream(
        name, sink, SamplingParams(max_tokens=3), 5, 0.0, detok=detok, final_only=getattr(sink, "final_only", False)
    )


def test_one_streams_failure_is_its_own():
    stopped: list[str] = []
    proc = OutputProcessor(stopped.append)
    ok, broken, bad = CollectingSink(), _Broken(), CollectingSink()
    streams = [_stream("ok", ok), _stream("broken", broken), _stream("bad", bad, _BadDetok())]
    for i, finish in enumerate((None, None, "length")):
        deliver(proc.process([TokenEvent(s, 10 + i, None, finish, 1.0 + i) for s in streams]))
    assert [t for c in ok.chunks for t in c.token_ids] == [10, 11, 12] and ok.chunks[-1].finished
    assert isinstance(broken.failed, OSError)  # its push raised: it is told, the others are unaffected
    assert isinstance(bad.error, ValueError) and not bad.chunks and stopped == ["bad"]


def test_final_only_sinks_get_the_last_chunk_with_the_counts():
    proc = OutputProcessor(lambda rid: None)
    sink = _FinalOnly()
    s = _stream("f", sink)
    for i, finish in enumerate((None, None, "length")):
        deliver(proc.process([TokenEvent(s, 20 + i, None, finish, 2.0 + i)]))
    (chunk,) = sink.chunks
    assert chunk.finished and chunk.completion_tokens == 3 and chunk.ttft_s == 2.0 and chunk.latency_s == 4.0
