"""bench/: metrics on hand-made timestamps, workload statistics, the planner's simulator, and
one tiny offline run end to end."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics

import pytest

from bench.metrics import SLO, RequestRecord, compute_metrics, jsonable, percentile
from bench.planner import PlanConfig, fit_profile, lstsq, predict, recommend
from router.capacity import WorkerProfile
from bench.planner_sim import simulate
from bench.workloads import BenchRequest, WorkloadConfig, arrival_offsets, generate_requests
from tests.test_api_support import backend, server  # noqa: F401  (the live server fixtures)


# ---------------------------------------------------------------- metrics

def _records():
    a = RequestRecord(10, 0.0, [0.5, 0.6, 0.8, 1.1], [1, 1, 1, 1], success=True)
    b = RequestRecord(20, 1.0, [1.2, 1.4], [1, 3], success=True)  # a chunk of 3 tokens
    failed = RequestRecord(30, 1.5, [], [], success=False, error="boom")
    return a, b, failed


def test_per_request_latencies_by_hand():
    a, b, _ = _records()
    assert a.ttft == pytest.approx(0.5) and a.e2el == pytest.approx(1.1)
    assert a.tpot == pytest.approx(0.6 / 3) and a.itls == pytest.approx([0.1, 0.2, 0.3])
    assert b.output_len == 4 and b.tpot == pytest.approx(0.2 / 3) and b.itls == pytest.approx([0.2])
    assert RequestRecord(1, 0.0, [0.3], [1], success=True).tpot is None


def test_compute_metrics_by_hand():
    m = compute_metrics(list(_records()), duration_s=2.0, slo=SLO(ttft=0.4))
    assert (m["completed"], m["failed"], m["num_requests"]) == (2, 1, 3)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(19.0)
    assert m["mean_ttft_ms"] == pytest.approx(350.0) and m["median_ttft_ms"] == pytest.approx(350.0)
    assert m["p99_ttft_ms"] == pytest.approx(200 + 0.99 * 300)
    assert m["mean_tpot_ms"] == pytest.approx((200 + 200 / 3) / 2)
    assert m["mean_itl_ms"] == pytest.approx(200.0)  # gaps 100, 200, 300, 200
    assert m["p90_itl_ms"] == pytest.approx(270.0)
    assert m["std_ttft_ms"] == pytest.approx(150.0)
    assert m["mean_e2el_ms"] == pytest.approx(750.0)
    # SLO: only b meets TTFT <= 400 ms; the failed request counts as a miss.
    assert m["goodput"] == pytest.approx(0.5) and m["slo_attainment"] == pytest.approx(1 / 3)
    assert m["errors"] == ["boom"]
    assert json.loads(json.dumps(jsonable(compute_metrics([_records()[2]], 1.0))))["mean_ttft_ms"] == "nan"


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    values = [rng.random() for _ in range(37)]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_slo_and_configs_validate():
    with pytest.raises(ValueError, match="ttft"):
        SLO(ttft=-1)
    with pytest.raises(ValueError, match="kind"):
        WorkloadConfig(kind="nope")
    with pytest.raises(ValueError, match="request_rate"):
        WorkloadConfig(request_rate=0)
    with pytest.raises(ValueError, match="rate"):
        PlanConfig(rate=0, slo=SLO(ttft=1))


# ---------------------------------------------------------------- workloads

def test_fixed_and_mixes_lengths():
    fixed = generate_requests(WorkloadConfig("fixed", 5, 40, 7, vocab_size=100))
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(40, 7)] * 5
    assert all(3 <= t < 100 for r in fixed for t in r.prompt_token_ids)
    heavy = generate_requests(WorkloadConfig("prefill-heavy", 3, 800, 64, vocab_size=100))
    assert {(r.prompt_len, r.output_len) for r in heavy} == {(800, 8)}
    light = generate_requests(WorkloadConfig("decode-heavy", 3, 800, 64, vocab_size=100))
    assert {(r.prompt_len, r.output_len) for r in light} == {(100, 64)}
    clipped = generate_requests(WorkloadConfig("fixed", 2, 500, 500, vocab_size=50, max_model_len=600))
    assert all(r.prompt_len + r.output_len <= 600 for r in clipped)


def test_random_and_sharegpt_statistics_are_seeded():
    cfg = WorkloadConfig("random", 2000, 100, 50, range_ratio=0.5, vocab_size=50, seed=7)
    reqs = generate_requests(cfg)
    assert min(r.prompt_len for r in reqs) >= 50 and max(r.prompt_len for r in reqs) <= 150
    assert statistics.mean(r.prompt_len for r in reqs) == pytest.approx(100, rel=0.03)
    assert [r.prompt_token_ids for r in generate_requests(cfg)[:3]] == [r.prompt_token_ids for r in reqs[:3]]
    share = generate_requests(WorkloadConfig("sharegpt", 2000, 128, 128, vocab_size=50, max_model_len=100000))
    assert statistics.median(r.prompt_len for r in share) == pytest.approx(100, rel=0.1)
    assert statistics.median(r.output_len for r in share) == pytest.approx(200, rel=0.1)
    assert max(r.prompt_len for r in share) > 5 * statistics.median(r.prompt_len for r in share)  # tail


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_gamma_mean_and_cv(burstiness):
    times = arrival_offsets(20000, 5.0, burstiness, random.Random(1))
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = statistics.mean(gaps)
    assert mean == pytest.approx(0.2, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    assert arrival_offsets(4, math.inf, 1.0, random.Random(0)) == [0.0] * 4


# ---------------------------------------------------------------- planner

def _profile(**kw):
    base = dict(prefill_base_s=0.0, prefill_per_token_s=0.0, prefill_per_token2_s=0.0,
                decode_base_s=0.0, decode_per_seq_s=0.0)
    return WorkerProfile(**{**base, **kw})


def test_simulator_single_request_exact():
    profile = _profile(prefill_base_s=0.1, prefill_per_token_s=0.001, decode_base_s=0.01, handoff_s=0.05)
    (record,), duration = simulate(profile, [BenchRequest([3] * 100, 5, 0.0)], 1, 1)
    assert record.ttft == pytest.approx(0.1 + 0.1 + 0.05)
    assert record.e2el == pytest.approx(0.25 + 4 * 0.01) and record.tpot == pytest.approx(0.01)
    assert duration == pytest.approx(0.29)


def test_simulator_queues_prefills_fcfs():
    profile = _profile(prefill_per_token_s=0.01, decode_base_s=0.001, max_num_batched_tokens=100)
    reqs = [BenchRequest([3] * 100, 2, 0.0), BenchRequest([3] * 100, 2, 0.0)]
    records, _ = simulate(profile, reqs, 1, 1)
    assert [r.ttft for r in records] == pytest.approx([1.0, 2.0])  # budget fits one at a time
    records, _ = simulate(profile, reqs, 2, 1)
    assert [r.ttft for r in records] == pytest.approx([1.0, 1.0])


def test_planner_recommends_more_prefill_when_prefill_bound():
    profile = _profile(prefill_per_token_s=0.01, decode_base_s=0.002, max_num_batched_tokens=100)
    workload = WorkloadConfig("fixed", 200, 100, 10, vocab_size=50)  # 1 s of prefill per request
    plan = recommend(profile, workload, PlanConfig(1.2, SLO(ttft=3.0), 0.9, max_workers=4,
                                                   num_requests=200, seeds=(0, 1)))
    by_split = {(c["prefill"], c["decode"]): c["slo_attainment"] for c in plan["candidates"]}
    assert by_split[(1, 1)] < 0.3  # utilisation 1.2: the queue grows without bound
    assert (plan["recommended"]["prefill"], plan["recommended"]["decode"]) == (2, 1)


def test_planner_recommends_more_decode_when_decode_bound():
    profile = _profile(prefill_base_s=0.001, decode_base_s=0.01, decode_per_seq_s=0.001)
    workload = WorkloadConfig("fixed", 300, 16, 50, vocab_size=50)
    plan = recommend(profile, workload, PlanConfig(10.0, SLO(tpot=0.016), 0.8, max_workers=3,
                                                   num_requests=300, seeds=(0,)))
    assert (plan["recommended"]["prefill"], plan["recommended"]["decode"]) == (1, 2)


def test_fit_recovers_known_costs():
    assert lstsq([[1, x] for x in range(5)], [2 + 3 * x for x in range(5)]) == pytest.approx([2, 3])
    prefill = [(n, 0.01 + 1e-4 * n + 1e-8 * n * n) for n in (64, 256, 1024, 2048)]
    decode = [(b, 0.005 + 0.0002 * b) for b in (1, 8, 32)]
    p = fit_profile(prefill, decode)
    assert p.prefill_step_s([512]) == pytest.approx(0.01 + 1e-4 * 512 + 1e-8 * 512 ** 2, rel=1e-6)
    assert p.decode_step_s(16) == pytest.approx(0.005 + 0.0002 * 16, rel=1e-6)
    w = WorkloadConfig("fixed", 20, 64, 8, vocab_size=50, request_rate=2.0)
    assert predict(p, w, 1, 1, SLO(ttft=10.0))["slo_attainment"] == pytest.approx(1.0)


# ---------------------------------------------------------------- a tiny real run

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from bench.checkpoints import build_checkpoint

    path = tmp_path_factory.mktemp("bench_tiny")
    return path, build_checkpoint("jamba-test", path)


def test_offline_runner_smoke(tiny_model):
    from bench.runner import RunConfig, open_target, run_benchmark

    path, _ = tiny_model
    requests = generate_requests(WorkloadConfig("random", 6, 24, 5, vocab_size=320, request_rate=50.0, seed=2))
    with open_target("llm", str(path), max_num_batched_tokens=64) as target:
        result = run_benchmark(target, requests, RunConfig("smoke", max_concurrency=3, progress=False,
                                                           slo=SLO(ttft=60.0)))
    m = result["metrics"]
    assert {"workload", "metrics", "requests", "run"} <= set(result)
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "p99_tpot_ms", "median_itl_ms", "p90_e2el_ms", "goodput", "slo_attainment"):
        assert key in m and m[key] == m[key], key
    assert m["completed"] == 6 and m["failed"] == 0
    assert m["total_output_tokens"] == sum(r.output_len for r in requests)
    assert m["total_input_tokens"] == sum(r.prompt_len for r in requests)
    assert [r["output_len"] for r in result["requests"]] == [r.output_len for r in requests]
    json.dumps(jsonable(result))


def test_engine_and_hf_offline_token_counts(tiny_model):
    from bench.hf_baseline import HFConfig, hf_generate
    from bench.runner import run_engine_offline
    from engine import LLM

    path, hf = tiny_model
    requests = generate_requests(WorkloadConfig("fixed", 3, 12, 4, vocab_size=320))
    ours, _ = run_engine_offline(LLM(path), requests)
    theirs, _ = hf_generate(hf, requests, HFConfig(batch_size=2))
    for records in (ours, theirs):
        assert [r.output_len for r in records] == [4, 4, 4] and all(r.success for r in records)
        assert all(r.ttft > 0 and r.tpot is not None for r in records)


def test_cli_parses_every_benchmark(tmp_path):
    from bench.cli import build_parser
    from bench.plots import plot_latency_cdfs
    from router.cli import build_parser as splitserve_parser

    for what in ("serve", "offline", "compare", "plan", "transfer", "structured", "prefix", "elastic", "quant"):
        args, _ = splitserve_parser().parse_known_args(["bench", what])
        assert args.what == what
    args = build_parser().parse_args(["offline", "--tiny", "jamba", "--workload", "sharegpt",
                                      "--request-rate", "2", "--burstiness", "0.5"])
    assert (args.tiny, args.workload, args.request_rate, args.burstiness) == ("jamba", "sharegpt", 2.0, 0.5)
    run = {"requests": [{"success": True, "ttft": 0.1, "tpot": 0.01, "e2el": 0.5}] * 3}
    assert plot_latency_cdfs({"x": run}, tmp_path / "cdf.png").stat().st_size > 0


def test_bare_bench_help_lists_the_benchmarks(capsys):
    from router.cli import main

    assert main(["bench", "--help"]) == 0
    listed = capsys.readouterr().out
    assert all(what in listed for what in ("serve", "offline", "compare", "plan", "transfer"))
    assert main(["bench"]) == 2


def test_online_runner_against_a_live_server(server, backend):
    """`splitserve bench serve`'s path: the gRPC client against the front door over the 1P1D
    cluster; every request streams exactly its output length and the JSON is complete."""
    from bench.runner import RunConfig, open_target, run_benchmark

    requests = generate_requests(WorkloadConfig("random", 8, 20, 6, vocab_size=backend.info.vocab_size,
                                                request_rate=20.0, burstiness=0.5, seed=4))
    with open_target("server", server=f"127.0.0.1:{server.grpc_port}") as target:
        result = run_benchmark(target, requests, RunConfig("online", max_concurrency=4, progress=False))
    m = result["metrics"]
    assert m["completed"] == 8 and m["failed"] == 0, result["requests"]
    assert m["total_output_tokens"] == sum(r.output_len for r in requests)
    assert m["mean_ttft_ms"] > 0 and m["median_tpot_ms"] > 0
    json.dumps(jsonable(result))


def test_offline_runner_on_a_mamba2_family(tmp_path):
    """The benchmarks run the Mamba2 families as they run Jamba (here Granite 4.0-H's layout)."""
    from bench.checkpoints import build_checkpoint
    from bench.runner import RunConfig, open_target, run_benchmark

    build_checkpoint("granite4h-test", tmp_path)
    requests = generate_requests(WorkloadConfig("random", 4, 20, 4, vocab_size=320, request_rate=50.0, seed=3))
    with open_target("llm", str(tmp_path), max_num_batched_tokens=16) as target:
        result = run_benchmark(target, requests, RunConfig("mamba2", max_concurrency=2, progress=False))
    assert result["metrics"]["completed"] == 4 and result["metrics"]["failed"] == 0
    assert result["metrics"]["total_output_tokens"] == sum(r.output_len for r in requests)


def test_prefix_bench_runs_both_engines_alike(tmp_path):
    from bench.checkpoints import build_checkpoint
    from bench.prefix import format_rows, run_prefix

    build_checkpoint("jamba", tmp_path)
    rows = run_prefix(str(tmp_path), sessions=2, turns=3, system_len=24, message_len=8, answer_len=4,
                      waves=3, no_reuse_len=16, engine_options={"block_size": 4})
    by = {(r["workload"], r["cache"]): r for r in rows}
    for workload in ("multi-turn", "shared-system"):
        assert by[(workload, "on")]["prompt_tokens_computed"] < by[(workload, "off")]["prompt_tokens_computed"]
    assert by[("no-reuse", "on")]["prompt_tokens_computed"] == by[("no-reuse", "off")]["prompt_tokens_computed"]
    assert "TTFT p50 off/on" in format_rows(rows)


@pytest.mark.parametrize("name", ["bamba", "falcon_h1", "zamba2", "qwen3_next", "lfm2"])
def test_bench_zoo_checkpoint_runs_exactly(tmp_path, name):
    """The roofline's checkpoints of the later families: transformers builds each config, and the
    engine's greedy tokens on it are judged by transformers."""
    import torch

    from bench.checkpoints import build_checkpoint
    from engine import LLM, SamplingParams
    from tests.oracle import judge_greedy

    model = build_checkpoint(name, tmp_path)
    prompt = [5, 9, 77, 1000, 33, 4000, 12, 8000] * 2
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    output = LLM(str(tmp_path), max_model_len=64).generate([prompt], params)[0].token_ids
    assert len(output) == 4
    with torch.no_grad():
        judge_greedy(model, prompt, output)


def test_handoff_overlap_measures_both_modes_side_by_side(tmp_path, capsys):
    """bench.handoff_overlap on a prompt of three chunks: both modes hand off (one() asserts it),
    every round is timed, and the report prints a row per length."""
    import asyncio

    from bench import handoff_overlap

    model = handoff_overlap.long_context_model(tmp_path, 4096)
    times = asyncio.run(handoff_overlap.sitting(model, "shm", [300], rounds=2, chunk=128))
    assert set(times) == {(300, "whole"), (300, "streamed")}
    assert all(len(t[k]) == 2 and min(t[k]) > 0 for t in times.values() for k in ("exposed", "prefill"))
    handoff_overlap.report("shm", times, lambda n: 2048 * n)
    assert "     300         0.6 |" in capsys.readouterr().out


def test_the_serving_sweep_doubles_until_colocated_misses_its_slo_and_names_where_the_split_wins():
    from bench.compare import sweep_text
    from bench.serving import ServingConfig, sweep_rates, sweep_summary

    measured = []

    def attainment(rate):  # colocated meets the SLO up to 2 req/s
        measured.append(rate)
        return 1.0 if rate <= 2 else 0.5

    cfg = ServingConfig(rates=(0.25, 0.5), max_rates=6)
    assert sweep_rates(cfg, attainment) == [0.25, 0.5, 1.0, 2.0, 4.0] == measured  # each rate measured once
    assert sweep_rates(ServingConfig(rates=(0.5,), max_rates=3), lambda r: 1.0) == [0.5, 1.0, 2.0]
    assert sweep_rates(ServingConfig(rates=(0.5,), sweep_factor=1), lambda r: 1.0) == [0.5]
    with pytest.raises(ValueError, match="sweep_factor"):
        ServingConfig(rates=(0.5, 1.0), max_rates=1)

    def run(goodput, attained=1.0):
        return {"metrics": {"p50_ttft_ms": 10.0, "p99_ttft_ms": 20.0, "p50_tpot_ms": 3.0, "p99_tpot_ms": 6.0,
                            "slo_attainment": attained, "goodput": goodput}}

    rates = [0.5, 1.0, 2.0]
    runs = {}
    for rate, colocated, one_one, one_two, two_one in zip(rates, (0.5, 0.9, 1.0), (0.5, 0.8, 1.6), (0.4, 1.0, 1.2),
                                                           (0.5, 0.9, 0.1)):
        tag = f"{rate:g}rps"
        runs.update({f"colocated@{tag}": run(colocated), f"disagg-1P1D@{tag}": run(one_one),
                     f"disagg-1P2D@{tag}": run(one_two), f"disagg-2P1D@{tag}": run(two_one)})
    sweep = sweep_summary(runs, rates, ("1:1", "1:2", "2:1"))
    assert sweep["split"] == "disagg-1P1D" and sweep["best_other"] == "disagg-1P2D"  # 2.6 req/s summed against 1.5
    assert sweep["split_wins_at"] == [1.0, 2.0] and sweep["largest_goodput_ratio"] == pytest.approx(1.6)
    assert [set(row) for row in sweep["table"]] == [{"rate", "colocated", "disagg-1P1D", "disagg-1P2D"}] * 3
    text = sweep_text(sweep)
    assert "beats colocated's at 1, 2 req/s (at most 1.60x)" in text and text.count("disagg-1P2D") == 3


def test_the_colocated_engine_can_get_a_split_workers_share_of_the_cores(monkeypatch):
    import contextlib

    import torch

    from bench import serving
    from bench.compare import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--colocated-cores", "1"]))
    assert cfg.serving["colocated_cores"] == 1
    with pytest.raises(ValueError, match="colocated_cores"):
        serving.ServingConfig(colocated_cores=0)

    threads = []
    monkeypatch.setattr(serving, "open_target", lambda *a, **k: contextlib.nullcontext(None))
    monkeypatch.setattr(serving, "run_benchmark",
                        lambda target, requests, run_cfg: threads.append(torch.get_num_threads()) or {"metrics": {}})
    before = torch.get_num_threads()
    serving._run_colocated("model", {"x": []}, serving.ServingConfig(colocated_cores=1, total_cores=4))
    serving._run_colocated("model", {"x": []}, serving.ServingConfig(total_cores=3))
    assert threads == [1, 3] and torch.get_num_threads() == before


def test_spec_bench_runs_three_engines_alike(tmp_path):
    """bench spec: plain, always-drafting and adaptive engines give the same tokens (the run
    raises otherwise), and the rows carry what the table prints."""
    from bench.checkpoints import build_checkpoint
    from bench.spec import format_rows, run_spec

    build_checkpoint("jamba", tmp_path)
    rows = run_spec(str(tmp_path), batches=(1, 2), max_tokens=12, rounds=1, engine_options={"block_size": 4})
    assert {(r["workload"], r["batch"], r["engine"]) for r in rows} == {
        (w, b, e) for w in ("hit", "miss") for b in (1, 2) for e in ("plain", "always", "adaptive")}
    assert all(r["draft_tokens"] == 0 for r in rows if r["engine"] == "plain")
    assert any(r["draft_tokens"] > 0 for r in rows if r["engine"] == "always")
    assert "vs plain" in format_rows(rows)


def test_spec_bench_measures_the_decode_side_prefill_of_a_draft(tmp_path):
    from bench.checkpoints import build_checkpoint
    from bench.spec import draft_prefill_cost

    build_checkpoint("jamba", tmp_path)
    cost = draft_prefill_cost(str(tmp_path), str(tmp_path), prompt_len=40, k=2)
    assert cost["target_prefill_ms"] > 0 and cost["draft_first_proposal_ms"] > 0
    assert cost["draft_later_proposal_ms"] > 0 and cost["draft_cache_bytes"] > 0


def test_spec_bench_sizes_what_an_mtp_head_adds_to_a_handoff():
    """Qwen3-Next-80B's head: one attention layer of 2 KV heads of 256 (K and V in bf16,
    2048 B a token) and its g per slot (2048 bf16 values)."""
    from bench.spec import mtp_handoff_bytes

    rows = mtp_handoff_bytes("bench/qwen3_next_80b", prompt_lens=(1024, 8192))
    for row in rows:
        assert row["with_head_bytes"] - row["target_bytes"] == 2048 * row["prompt_len"] + 4096
    assert 0.01 < rows[0]["added"] < rows[1]["added"] < 0.1


def test_tiers_bench_turns_evictions_into_hits_on_an_agentic_trace(tmp_path):
    """bench prefix --tiers on a tiny trace 4x the pool: the pool alone finds little, the
    host and disk tiers find the conversations it evicted; the engines' tokens agree (checked
    inside)."""
    from bench.checkpoints import build_checkpoint
    from bench.tiers import format_rows, run_tiers

    build_checkpoint("jamba", tmp_path / "model")
    rows = run_tiers(str(tmp_path / "model"), conversations=6, turns=3, message_len=24, answer_len=4, block_size=4,
                     disk_dir=str(tmp_path / "disk"))
    agentic = {r["engine"]: r for r in rows if r["workload"] == "agentic"}
    assert agentic["off"]["hit_rate"] == 0 and agentic["tiers"]["hit_rate"] > agentic["pool"]["hit_rate"] + 0.2
    assert agentic["tiers"]["tier_host_hits"] + agentic["tiers"]["tier_disk_hits"] > 0
    assert "tiers vs pool" in format_rows(rows) and "no reuse" in format_rows(rows)


def test_quant_bench_measures_every_format_against_float32(tmp_path):
    """bench quant: the float32 row drifts by nothing from itself; each narrow format keeps fewer
    bytes, fits more sequences once its working rows are counted, and drifts a little."""
    from bench.checkpoints import build_checkpoint
    from bench.quant import OPTIONS, format_rows, run_quant

    build_checkpoint("jamba", tmp_path)
    rows = {r["option"]: r for r in run_quant(str(tmp_path), list(OPTIONS), steps=6, num_prompts=2,
                                               seq_lens=(64, 512), budget_mib=64, ppl_tokens=32, batch=2,
                                               rounds=1, seed=0)}
    base = rows["float32"]
    assert base["logit_diff_max"] == 0.0 and base["argmax_agree"] == 1.0
    for name in ("state-bfloat16", "state-float16", "both"):
        assert rows[name]["state_bytes_per_seq"] * 2 == base["state_bytes_per_seq"]
    for name in ("kv-fp8_e4m3", "kv-fp8_e5m2", "both"):
        assert rows[name]["kv_bytes_per_token"] * 4 == base["kv_bytes_per_token"]
    for name in set(OPTIONS) - {"float32"}:
        assert rows[name]["seqs_vs_float32"][512] > 1.0 and 0 < rows[name]["logit_diff_max"] < 1.0, rows[name]
    assert "fit@512" in format_rows(list(rows.values()))
