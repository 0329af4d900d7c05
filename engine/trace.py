"""Where a request's time went: spans its processes record and the caller gets with its last output.

A span is a named interval on the wall clock (`time.time_ns`), so spans measured in different
processes line up: exactly on one node, to within the clocks' skew across nodes. Engines keep
monotonic times (engine.request); `wall_ns` converts them at the moment a span is made.

What records which (docs/tracing.md has an annotated pair):
- every engine, from its Request: `queued` (arrival to first scheduled), `prefill` (first
  scheduled to first token), `awaiting hand-off` (a decode worker's reservation to the landing),
  `decode` (first token to the last);
- the router: the request itself, the decode worker's reservation call, the prefill worker's call;
- the prefill worker: the hand-off, from its send to the transport's result.

`otlp_json` writes traces as OpenTelemetry's JSON (OTLP/JSON `resourceSpans`), which trace
viewers open (Jaeger, Perfetto through its OTLP import, Grafana Tempo).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    name: str
    start_ns: int
    end_ns: int
    where: str = ""  # the process that measured it: "router", a worker's name, "engine"

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def wall_ns(monotonic_s: float, offset_ns: int | None = None) -> int:
    """A time.monotonic() reading on the wall clock, in nanoseconds; `offset_ns` (wall minus
    monotonic) read once keeps the readings of one request consistent with each other."""
    if offset_ns is None:
        offset_ns = time.time_ns() - time.monotonic_ns()
    return offset_ns + int(monotonic_s * 1e9)


def span(name: str, start_s: float | None, end_s: float | None, where: str, offset_ns: int | None = None) -> list[Span]:
    """[Span] between two monotonic readings, or [] when either is missing."""
    if start_s is None or end_s is None:
        return []
    if offset_ns is None:
        offset_ns = time.time_ns() - time.monotonic_ns()
    return [Span(name, wall_ns(start_s, offset_ns), wall_ns(max(end_s, start_s), offset_ns), where)]


def engine_spans(request, where: str) -> tuple[Span, ...]:
    """What an engine knows of a request (engine.request.Request) as spans."""
    offset = time.time_ns() - time.monotonic_ns()
    if request.scheduled_time is not None:
        spans = (span("queued", request.arrival_time, request.scheduled_time, where, offset)
                 + span("prefill", request.scheduled_time, request.first_token_time, where, offset))
    else:  # never prefilled here: it waited for a hand-off
        spans = span("awaiting hand-off", request.arrival_time, request.first_token_time, where, offset)
    return tuple(spans + span("decode", request.first_token_time, request.finish_time, where, offset))


def otlp_json(traces: dict[str, list[Span]], service: str = "splitserve") -> dict:
    """{request id: spans} as one OTLP/JSON document: a trace per request, under a root span
    `request` (the router's, or one spanning the rest where no router measured it)."""
    spans = []
    for request_id, recorded in traces.items():
        if not recorded:
            continue
        if not any(s.name == "request" for s in recorded):
            recorded = [Span("request", min(s.start_ns for s in recorded), max(s.end_ns for s in recorded)),
                        *recorded]
        trace_id = hashlib.sha256(request_id.encode()).hexdigest()[:32]
        root = None
        for i, s in enumerate(sorted(recorded, key=lambda s: (s.name != "request", s.start_ns, -s.end_ns))):
            span_id = hashlib.sha256(f"{request_id}/{i}".encode()).hexdigest()[:16]
            entry = {"traceId": trace_id, "spanId": span_id, "name": f"{s.where} {s.name}".strip(),
                     "kind": 1, "startTimeUnixNano": str(s.start_ns), "endTimeUnixNano": str(s.end_ns),
                     "attributes": [{"key": "splitserve.request_id", "value": {"stringValue": request_id}},
                                    {"key": "splitserve.where", "value": {"stringValue": s.where}}]}
            if root is None:
                root = span_id
            else:
                entry["parentSpanId"] = root
            spans.append(entry)
    return {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
        "scopeSpans": [{"scope": {"name": "splitserve"}, "spans": spans}],
    }]}
