"""The autoscaler's policy on synthetic readings: pressure, idleness, hysteresis, bounds."""

from __future__ import annotations

import pytest

from router.autoscaler import AutoscaleConfig, Autoscaler, Signals

CONFIG = dict(slo_ttft_s=1.0, slo_tpot_s=0.1, up_intervals=2, down_intervals=3, cooldown_intervals=2)


def run(scaler, readings):
    return [[(d.kind, d.delta, d.reason) for d in scaler.decide(s)] for s in readings]


def test_spec_parsing_and_validation():
    config = AutoscaleConfig.parse("prefill=1:4,decode=2:8", slo_ttft_s=0.5)
    assert (config.prefill, config.decode, config.slo_ttft_s) == ((1, 4), (2, 8), 0.5)
    assert AutoscaleConfig.parse("decode=1:3").prefill == (1, 4)
    for bad in ("prefill=4:1", "gpu=1:2", "decode=1", "prefill=0:2"):
        with pytest.raises(ValueError):
            AutoscaleConfig.parse(bad)


def test_slo_pressure_grows_the_limiting_kind_after_two_readings_then_cools_down():
    scaler = Autoscaler(AutoscaleConfig(prefill=(1, 3), decode=(1, 3), **CONFIG))
    slow_ttft = Signals(1, 1, ttft_p90_s=2.5, tpot_p90_s=0.02, decode_slot_occupancy=0.5)
    steps = run(scaler, [slow_ttft] * 3)
    assert steps == [[], [("prefill", 1, "ttft_slo")], []]  # one reading is not enough; then cooldown
    grown = Signals(2, 1, ttft_p90_s=2.5, tpot_p90_s=0.02, decode_slot_occupancy=0.5)
    assert run(scaler, [grown] * 3) == [[], [("prefill", 1, "ttft_slo")], []]  # readings in cooldown count
    at_max = Signals(3, 1, ttft_p90_s=2.5, tpot_p90_s=0.02, decode_slot_occupancy=0.5)
    assert run(scaler, [at_max] * 4) == [[], [], [], []]
    assert scaler.decisions[("prefill", "up", "ttft_slo")] == 2


def test_decode_grows_on_tpot_or_occupancy_and_shrinks_only_when_the_rest_has_room():
    scaler = Autoscaler(AutoscaleConfig(decode=(1, 4), **CONFIG))
    full = Signals(1, 2, decode_block_occupancy=0.95)
    assert run(scaler, [full, full]) == [[], [("decode", 1, "decode_occupancy")]]
    scaler = Autoscaler(AutoscaleConfig(decode=(1, 4), **CONFIG))
    assert run(scaler, [Signals(1, 2, tpot_p90_s=0.3)] * 2)[-1] == [("decode", 1, "tpot_slo")]
    scaler = Autoscaler(AutoscaleConfig(decode=(1, 4), **CONFIG))
    busy_enough = Signals(1, 2, decode_slot_occupancy=0.2)  # 0.4 on one worker: above low_occupancy 0.3
    assert run(scaler, [busy_enough] * 5) == [[]] * 5
    quiet = Signals(1, 2, decode_slot_occupancy=0.1)
    assert run(scaler, [quiet] * 3) == [[], [], [("decode", -1, "idle")]]


def test_alternating_readings_never_flap():
    scaler = Autoscaler(AutoscaleConfig(prefill=(1, 4), **CONFIG))
    pressured = Signals(2, 1, ttft_p90_s=3.0)
    idle = Signals(2, 1, ttft_p90_s=0.1)
    assert run(scaler, [pressured, idle] * 6) == [[]] * 12


def test_a_pool_outside_its_bounds_is_brought_back():
    scaler = Autoscaler(AutoscaleConfig(prefill=(2, 4), decode=(1, 2), **CONFIG))
    assert run(scaler, [Signals(1, 3)]) == [[("prefill", 1, "bounds"), ("decode", -1, "bounds")]]
    status = scaler.status()
    assert {"kind": "prefill", "direction": "up", "reason": "bounds", "count": 1} in status["decisions"]


def test_decisions_are_exported_as_a_metric():
    from prometheus_client.parser import text_string_to_metric_families

    from router.metrics import FrontDoorMetrics

    scaler = Autoscaler(AutoscaleConfig(prefill=(2, 4), **CONFIG))
    scaler.decide(Signals(1, 1))
    text = FrontDoorMetrics(lambda: {"workers": [], "autoscaler": scaler.status()}).render().decode()
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    key = ("splitserve_autoscaler_decisions_total",
           frozenset({"kind": "prefill", "direction": "up", "reason": "bounds"}.items()))
    assert samples[key] == 1


def test_serve_flags_build_the_autoscaler_config():
    from router.cli import build_parser, serve_options

    args = build_parser().parse_args(["serve", "--autoscale", "prefill=1:2,decode=1:6", "--slo-ttft-ms", "500",
                                      "--slo-tpot-ms", "40"])
    config = serve_options(args)[0]["autoscale"]
    assert (config.prefill, config.decode, config.slo_ttft_s, config.slo_tpot_s) == ((1, 2), (1, 6), 0.5, 0.04)
    assert "autoscale" not in serve_options(build_parser().parse_args(["serve"]))[0]
    with pytest.raises(ValueError, match="KIND=MIN:MAX"):
        serve_options(build_parser().parse_args(["serve", "--autoscale", "decode:1-6"]))


def _profile():
    from router.capacity import WorkerProfile

    # prefill step 10 ms + 0.1 ms/token; decode step 10 ms + 1 ms/sequence
    return WorkerProfile(0.01, 1e-4, 0.0, 0.01, 0.001, max_num_batched_tokens=2048, max_num_seqs=64)


def test_the_capacity_model_sizes_each_pool_from_the_profile():
    from router.capacity import CapacityModel

    model = CapacityModel(_profile(), prefill_utilization=0.7, tpot_headroom=0.8)
    per_worker = 2048 / (0.01 + 2048 * 1e-4)  # four 512-token prompts per 2048-token step
    assert model.prefill_tokens_per_s(512) == pytest.approx(per_worker)
    assert model.prefill_workers(0.69 * per_worker, 512) == 1
    assert model.prefill_workers(0.71 * per_worker, 512) == 2
    assert model.prefill_workers(2.1 * per_worker * 0.7, 512) == 3
    assert model.prefill_workers(0, 0) == 1
    assert model.decode_batch(0.05) == 30  # 10 ms + 30 x 1 ms = 40 ms = 0.8 x 50 ms
    assert model.decode_batch(0.001) == 1  # no batch meets it: one sequence per step is the least
    assert [model.decode_workers(n, 0.05) for n in (0, 30, 31, 70)] == [1, 1, 2, 3]
    with pytest.raises(ValueError):
        CapacityModel(_profile(), prefill_utilization=0)


def test_with_a_capacity_model_steps_are_sized_and_shrinks_need_its_consent():
    from router.capacity import CapacityModel

    config = dict(CONFIG, slo_tpot_s=0.05, capacity=CapacityModel(_profile()))
    scaler = Autoscaler(AutoscaleConfig(decode=(1, 8), **config))
    breach = Signals(1, 1, tpot_p90_s=0.3, decode_running=70)  # 70 sequences need 3 decode workers
    assert run(scaler, [breach] * 2) == [[], [("decode", 2, "tpot_slo")]]
    scaler = Autoscaler(AutoscaleConfig(decode=(1, 2), **config))
    assert run(scaler, [breach] * 2)[-1] == [("decode", 1, "tpot_slo")]  # clipped to the pool's max
    # No SLO breached yet, but the load already needs more workers than there are.
    scaler = Autoscaler(AutoscaleConfig(decode=(1, 8), **config))
    assert run(scaler, [Signals(1, 1, decode_running=70)] * 2)[-1] == [("decode", 2, "capacity")]
    # Occupancy says idle, the model says 3 workers are needed: no shrink; with 10 sequences, shrink.
    scaler = Autoscaler(AutoscaleConfig(decode=(1, 8), **config))
    assert run(scaler, [Signals(1, 3, decode_slot_occupancy=0.05, decode_running=70)] * 4) == [[]] * 4
    assert run(scaler, [Signals(1, 3, decode_slot_occupancy=0.05, decode_running=10)] * 3)[-1] == \
        [("decode", -1, "idle")]
    # Prefill: prompt tokens arriving at 2x what one worker takes at 70% load.
    per_worker = CapacityModel(_profile()).prefill_tokens_per_s(512) * 0.7
    scaler = Autoscaler(AutoscaleConfig(prefill=(1, 4), **config))
    busy = Signals(1, 1, prompt_tokens_per_s=2 * per_worker, mean_prompt_len=512)
    assert run(scaler, [busy] * 2)[-1] == [("prefill", 1, "capacity")]


def test_the_capacity_profile_comes_from_a_plan_report(tmp_path):
    import json
    from dataclasses import asdict

    from router.capacity import CapacityModel
    from router.cli import build_parser, serve_options

    report = tmp_path / "plan.json"
    report.write_text(json.dumps({"profile": asdict(_profile()), "plan": {}}))
    assert CapacityModel.from_file(report).profile == _profile()
    args = build_parser().parse_args(["serve", "--autoscale", "decode=1:4", "--autoscale-profile", str(report)])
    assert serve_options(args)[0]["autoscale"].capacity.profile == _profile()
    (tmp_path / "bad.json").write_text(json.dumps({"profile": {"prefill_base_s": -1}}))
    for bad in (tmp_path / "bad.json", tmp_path / "missing.json"):
        with pytest.raises(ValueError, match="capacity profile"):
            CapacityModel.from_file(bad)
