"""bench/elastic.py and the simulator's changing pools: the autoscaler's policy against the best
fixed split on traffic that turns from decode-heavy to prefill-heavy (simulated, seconds)."""

from __future__ import annotations

import json

import pytest

from router.capacity import WorkerProfile
from bench.planner_sim import ClusterSim, simulate
from bench.workloads import BenchRequest

# A worker like the demo model on one thread (bench plan's fit, rounded): ~3,000 prompt tokens/s,
# a decode step of 7 ms + 0.5 ms per sequence.
DEMO_LIKE = WorkerProfile(0.035, 3.1e-4, 7e-9, 0.007, 5e-4, handoff_s=0.005)


def test_a_grown_worker_takes_work_only_once_started_and_a_shrunk_one_leaves_when_done():
    profile = WorkerProfile(0.0, 0.01, 0.0, 0.01, 0.0, max_num_batched_tokens=100)
    reqs = [BenchRequest([3] * 100, 3, t) for t in (0.0, 0.1, 2.0, 2.1)]
    sim = ClusterSim(profile, 1, 2)
    seen = []

    def control(sim, now):
        seen.append((now, len(sim.serving("prefill")), len(sim.serving("decode"))))
        if now == 0.5:
            sim.grow("prefill", now, startup_s=1.0)  # serving from 1.5 s
            sim.shrink("decode", now)  # the newest decode worker: idle, so gone at once
            sim.shrink("decode", now)  # never the last one

    records, _ = sim.run(reqs, control, interval_s=0.5)
    assert seen[:4] == [(0.5, 1, 2), (1.0, 1, 1), (1.5, 2, 1), (2.0, 2, 1)]
    assert [r.ttft for r in records][:2] == pytest.approx([1.0 + 0.0, 2.0 - 0.1])  # one prefill worker, FCFS
    assert [r.ttft for r in records][2:] == pytest.approx([1.0, 1.0])  # two by then: in parallel
    assert [row[1:] for row in sim.timeline] == [(1, 2), (1, 1), (2, 1)]
    # 1P2D until 0.5 s, then 1P1D plus a prefill worker starting (it costs from then on): 3 throughout
    end = max(r.e2el + r.start for r in records)
    assert sim.worker_seconds == pytest.approx(3 * end)
    assert simulate(profile, reqs, 1, 1)[0][3].ttft == pytest.approx(1.9)  # without the growth: queued


def test_a_draining_decode_worker_finishes_its_streams_first():
    profile = WorkerProfile(0.0, 0.0, 0.0, 0.1, 0.0)
    reqs = [BenchRequest([3], 20, 0.0), BenchRequest([3], 20, 0.0)]
    sim = ClusterSim(profile, 1, 2)
    sim_times = []

    def control(sim, now):
        if now == 0.5:
            sim.shrink("decode", now)
        sim_times.append((now, len(sim.decodes)))

    records, _ = sim.run(reqs, control, interval_s=0.5)
    assert all(r.output_len == 20 for r in records)
    assert [r.tpot for r in records] == pytest.approx([0.1, 0.1])  # the stream was not cut
    assert (1.0, 2) in sim_times and sim.timeline[-1][1:] == (1, 1)
    assert sim.decodes and len(sim.decodes) == 1  # removed after its stream ended


def test_elastic_bench_autoscaler_beats_the_fixed_split_after_the_shift(tmp_path):
    from bench.elastic import RUNS, format_report, plot_worker_counts, run_elastic
    from bench.metrics import SLO
    from engine import demo_model_path

    report = run_elastic(str(demo_model_path()), num_prompts=300, rate=8.0, slo=SLO(ttft=1.0, tpot=0.05),
                         max_workers=5, profile=DEMO_LIKE)
    fixed, signals, model = (report["runs"][name] for name in RUNS)
    # The planner sizes the fixed split for the decode-heavy half: more decode than prefill.
    assert report["fixed_split"]["decode"] > report["fixed_split"]["prefill"]
    assert fixed["first half"]["slo_attainment"] >= 0.9
    assert fixed["second half"]["slo_attainment"] < 0.2  # one prefill worker drowns in long prompts
    for run in (signals, model):
        assert run["first half"]["slo_attainment"] == pytest.approx(fixed["first half"]["slo_attainment"])
        assert run["second half"]["goodput"] > 5 * fixed["second half"]["goodput"]
        assert run["max_workers"]["prefill"] > report["fixed_split"]["prefill"]
        assert {d["kind"] for d in run["decisions"] if d["direction"] == "up"} == {"prefill"}
        grown = next(t for t, p, _ in run["timeline"] if p > report["fixed_split"]["prefill"])
        assert grown > report["shift_s"]  # nothing moved before the traffic did
    # The capacity model grows prefill to what the load needs in one step, so it recovers sooner.
    assert model["second half"]["slo_attainment"] > signals["second half"]["slo_attainment"]
    assert model["goodput_per_worker"] > fixed["goodput_per_worker"]
    text = format_report(report)
    assert "fixed split (the planner's pick for the first half)" in text and "worker-seconds" in text
    assert (tmp_path / "w.png").exists() is False
    plot_worker_counts(report, tmp_path / "w.png")
    assert (tmp_path / "w.png").stat().st_size > 10_000


def test_elastic_bench_from_the_cli_with_a_plan_profile(tmp_path, capsys):
    from dataclasses import asdict

    from router.cli import main

    (tmp_path / "plan.json").write_text(json.dumps({"profile": asdict(DEMO_LIKE)}))
    out = tmp_path / "out"
    assert main(["bench", "elastic", "--profile", str(tmp_path / "plan.json"), "--num-prompts", "40",
                 "--rate", "8", "--slo-tpot-ms", "50", "--max-workers", "5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "second-half goodput" in printed and "elastic_workers.png" in printed
    report = json.loads((out / "elastic.json").read_text())
    assert report["mode"] == "simulated" and set(report["runs"]) == {
        "fixed", "autoscaled (signals)", "autoscaled (signals + capacity model)"}
    assert (out / "elastic_workers.png").exists()
