"""Where a request's time went (engine.trace): the engine's spans, a hand-off's on both sides,
and the OpenTelemetry JSON `splitserve bench ... --trace` writes."""

from __future__ import annotations

import json

from engine import SamplingParams
from engine.trace import Span, otlp_json

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_a_colocated_request_is_queued_then_prefilled_then_decoded(model_factory):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    path, _ = model_factory("jamba")
    engine = LLMEngine(EngineConfig(str(path), block_size=4, max_num_batched_tokens=8))  # three prefill steps
    engine.add_request(list(range(3, 23)), GREEDY, request_id="r")
    outputs = []
    while not (outputs and outputs[-1].finished):
        outputs += engine.step()
    *running, out = outputs
    assert running and not any(o.spans for o in running)  # only the final output carries them
    assert [(s.name, s.where) for s in out.spans] == [("queued", "engine"), ("prefill", "engine"), ("decode", "engine")]
    queued, prefill, decode = out.spans
    assert queued.end_ns == prefill.start_ns and prefill.end_ns == decode.start_ns  # the same readings
    assert queued.seconds >= 0 and prefill.seconds > 0 and decode.seconds > 0
    assert abs(sum(s.seconds for s in out.spans) - (out.finish_time - out.arrival_time)) < 1e-3


def test_a_handed_off_request_waits_for_its_state_then_decodes(model_factory):
    """The decode side never prefills a handed-in request: it waited for the hand-off, then decoded."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.trace import engine_spans

    path, _ = model_factory("jamba")
    prefill = LLMEngine(EngineConfig(str(path), block_size=4, mode="prefill"))
    decode = LLMEngine(EngineConfig(str(path), block_size=4, mode="decode"))
    decode.trace_name = "decode-0"
    prompt = list(range(5, 17))
    reservation = decode.reserve_for_handoff(prompt, GREEDY, "r")
    prefill.add_request(prompt, GREEDY, request_id="r")
    handoffs = []
    while not handoffs:
        prefill.step()
        handoffs = prefill.take_handoffs()
    sent = engine_spans(prefill.requests["r"], "prefill-0")
    assert [s.name for s in sent] == ["queued", "prefill"]  # its decode is elsewhere
    (handoff,) = handoffs
    from tests.test_tp_handoff import copy_rows, wire
    copy_rows(wire(prefill, None), wire(decode, None), handoff.block_ids, handoff.slot,
              reservation.block_ids, reservation.slot)
    prefill.finish_handoff("r")
    decode.accept_handoff("r", handoff.first_token)
    final = None
    while final is None:
        final = next((o for o in decode.step() if o.finished), None)
    assert [(s.name, s.where) for s in final.spans] == [("awaiting hand-off", "decode-0"), ("decode", "decode-0")]
    assert final.spans[0].start_ns <= sent[0].start_ns  # reserved before the prefill began
    assert final.spans[0].end_ns >= sent[-1].end_ns  # landed after the first token


def test_otlp_json_is_one_trace_per_request_under_its_request_span():
    spans = {"a": [Span("request", 100, 900, "router"), Span("prefill", 200, 500, "prefill-0"),
                   Span("decode", 500, 880, "decode-0")],
             "b": [Span("queued", 10, 20, "engine"), Span("decode", 20, 40, "engine")],
             "c": []}
    doc = json.loads(json.dumps(otlp_json(spans)))
    (resource,) = doc["resourceSpans"]
    assert resource["resource"]["attributes"][0] == {"key": "service.name", "value": {"stringValue": "splitserve"}}
    out = resource["scopeSpans"][0]["spans"]
    by_trace: dict[str, list] = {}
    for entry in out:
        by_trace.setdefault(entry["traceId"], []).append(entry)
    assert len(by_trace) == 2 and all(len(t) == 32 for t in by_trace)  # "c" recorded nothing
    for entries in by_trace.values():
        root, *children = entries
        assert root["name"].endswith("request") and "parentSpanId" not in root
        assert all(c["parentSpanId"] == root["spanId"] and len(c["spanId"]) == 16 for c in children)
        assert all(int(root["startTimeUnixNano"]) <= int(c["startTimeUnixNano"]) for c in children)
    b = next(t for t in by_trace.values() if len(t) == 3 and t[0]["name"] == "request")
    assert (b[0]["startTimeUnixNano"], b[0]["endTimeUnixNano"]) == ("10", "40")  # spans what b recorded


def test_trace_view_shows_the_median_request_and_medians_per_span(tmp_path, capsys):
    from bench import trace_view

    spans = {f"r{i}": [Span("request", 0, 1_000_000 * (i + 1), "router"),
                       Span("prefill", 0, 500_000 * (i + 1), f"prefill-{i % 2}")] for i in range(3)}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(otlp_json(spans)))
    assert trace_view.main([str(path)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("request r1\n")  # e2e 1, 2, 3 ms: the median is r1's
    assert "router request" in shown and "prefill-1 prefill" in shown
    assert "  prefill prefill                               1.0 ms" in shown  # both workers' spans, by name
