"""One request of a `--trace` file as a timeline: `python -m bench.trace_view TRACE.json [--request ID]`.

Without --request it shows the request of median end-to-end time. Each row is a span, with its
start relative to the request's and its length; a bar places it on the request's time line.
Also prints, per span name, the median length over every request in the file.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

BAR = 40


def load(path: str) -> dict[str, list[dict]]:
    """request id -> its spans (OTLP/JSON as engine.trace.otlp_json writes it), root first."""
    doc = json.loads(Path(path).read_text())
    traces: dict[str, list[dict]] = {}
    for resource in doc["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                rid = next(a["value"]["stringValue"] for a in span["attributes"] if a["key"] == "splitserve.request_id")
                traces.setdefault(rid, []).append(span)
    return traces


def _ms(span: dict, key: str) -> float:
    return int(span[key]) / 1e6


def timeline(spans: list[dict]) -> list[str]:
    root = spans[0]
    t0, length = _ms(root, "startTimeUnixNano"), _ms(root, "endTimeUnixNano") - _ms(root, "startTimeUnixNano")
    rows = [f"{'span':44s} {'start ms':>9s} {'length ms':>10s}  time line ({length:.1f} ms)"]
    for span in spans:
        start = _ms(span, "startTimeUnixNano") - t0
        size = _ms(span, "endTimeUnixNano") - _ms(span, "startTimeUnixNano")
        left = int(BAR * start / length) if length else 0
        width = max(1, round(BAR * size / length)) if length else 1
        rows.append(f"{span['name']:44s} {start:9.1f} {size:10.1f}  {' ' * left}{'#' * min(width, BAR - left or 1)}")
    return rows


def medians(traces: dict[str, list[dict]]) -> dict[str, float]:
    by_name: dict[str, list[float]] = {}
    for spans in traces.values():
        for span in spans:
            name = re.sub(r"-\d+\b", "", span["name"])  # "prefill-0 queued" -> "prefill queued": any worker
            by_name.setdefault(name, []).append(_ms(span, "endTimeUnixNano") - _ms(span, "startTimeUnixNano"))
    return {name: statistics.median(values) for name, values in by_name.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trace_view", description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--request", default=None, help="a request id (default: the median end-to-end one)")
    args = parser.parse_args(argv)
    traces = load(args.trace)
    if args.request is None:
        ranked = sorted(traces, key=lambda r: _ms(traces[r][0], "endTimeUnixNano") - _ms(traces[r][0], "startTimeUnixNano"))
        args.request = ranked[len(ranked) // 2]
    print(f"request {args.request}")
    print("\n".join(timeline(traces[args.request])))
    print(f"\nmedian over {len(traces)} requests:")
    for name, value in medians(traces).items():
        print(f"  {name:40s} {value:8.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
