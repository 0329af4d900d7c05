"""`splitserve generate` and `splitserve status` against a live front door."""

from __future__ import annotations

import pytest

from router.cli import main
from router.client_cli import format_status
from protos.splitserve.v1 import splitserve_pb2 as pb
from tests.test_api_support import backend, idle_backend, server, text_model_path  # noqa: F401


def test_generate_prints_the_completion(server, idle_backend, capsys):
    address = f"127.0.0.1:{server.grpc_port}"
    assert main(["generate", "def f(x):", "--max-tokens", "6", "--temperature", "0",
                 "--ignore-eos", "--server", address]) == 0
    out, err = capsys.readouterr()
    assert "6 tokens, finish_reason=length" in err
    assert main(["generate", "def f(x):", "--max-tokens", "6", "--temperature", "0",
                 "--ignore-eos", "--stream", "--server", address]) == 0
    streamed, _ = capsys.readouterr()
    assert streamed == out


def test_generate_with_token_ids(server, idle_backend, capsys):
    assert main(["generate", "5,6,7", "--token-ids", "--max-tokens", "3", "--temperature", "0",
                 "--ignore-eos", "--server", f"127.0.0.1:{server.grpc_port}"]) == 0
    assert "3 tokens" in capsys.readouterr().err


def test_generate_reports_server_errors(server, capsys):
    assert main(["generate", "x", "--max-tokens", "3", "--temperature", "-2",
                 "--server", f"127.0.0.1:{server.grpc_port}"]) == 1
    assert "INVALID_ARGUMENT: sampling.temperature" in capsys.readouterr().err


def test_status_shows_workers_nodes_cache_and_queues(server, capsys):
    assert main(["status", "--server", f"127.0.0.1:{server.grpc_port}"]) == 0
    out = capsys.readouterr().out
    for text in ("tiny-jamba", "ready: yes", "prefill-0", "decode-0", "KV BLOCKS USED", "0/160 (0%)",
                 "0/8 (0%)", "WAITING", "RUNNING", "NODE"):
        assert text in out, text


def test_status_table_for_a_cluster():
    status = pb.ServerStatus(ready=False, max_queued=8, model=pb.ModelInfo(model_name="m"), workers=[
        pb.WorkerStatus(id="prefill-0", kind="prefill", node="n1", alive=True, kv_blocks_total=100,
                        kv_blocks_free=25, waiting=3, handoff_count=7, handoff_bytes=5_000_000),
        pb.WorkerStatus(id="decode-0", kind="decode", node="n2", alive=False, running=2,
                        spec_drafts=5, spec_draft_tokens=20, spec_accepted_tokens=15,
                        tier_host_bytes=2_000_000, tier_host_hits=4, tier_disk_bytes=30_000_000, tier_disk_hits=9)])
    text = format_status(status)
    assert "SPEC ACCEPTED" in text and "15/20 (75%)" in text
    assert "TIERS MB (hits)" in text and "host 2.0 (4) disk 30.0 (9)" in text
    assert "ready: NO" in text and "75/100 (75%)" in text and "7 (0)" in text and "5.0" in text
    assert text.count("n1") == 2 and text.count("n2") == 2  # a worker row and a node row each


def test_every_command_and_option_explains_itself():
    """`splitserve --help` lists every command on its own line; every option of every command has
    help text, and the help shows each option's default."""
    import argparse

    from router.cli import BENCHMARKS, build_parser

    parser = build_parser()
    top = parser.format_help()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        assert f"\n    {name}" in top, name
        if name == "bench":
            assert all(what in top for what in BENCHMARKS)
            continue
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
            if action.option_strings and action.default not in (None, False, []):
                assert f"default: {action.default}" in text or "default" in action.help, (name, action.dest)


def test_run_takes_one_prompt_of_several_words(capsys):
    from router.cli import main

    assert main(["run", "def", "main():", "--max-tokens", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def main():") and out.err.count("tokens, finish_reason") == 1


def test_values_the_wire_cannot_carry_are_named_on_the_client_side(capsys):
    from router.cli import main
    from router.client import build_request

    with pytest.raises(ValueError, match=r"sampling.max_tokens: must be >= 0, got -1"):
        build_request("x", max_tokens=-1)
    with pytest.raises(ValueError, match=r"sampling.temperature: .*got 'hot'"):
        build_request("x", temperature="hot")
    with pytest.raises(ValueError, match=r"sampling.max_token: not a field"):
        build_request("x", max_token=3)
    # the command line: a clear error and status 2, before any connection is tried
    assert main(["generate", "hi", "--max-tokens", "-1", "--server", "127.0.0.1:1"]) == 2
    assert "sampling.max_tokens: must be >= 0, got -1" in capsys.readouterr().err


def test_speculative_config_reaches_the_engine_options_from_the_cli_and_a_serve_config(capsys):
    """`serve --speculative-config JSON` and a Serve config's mapping give launch the same dict;
    JSON that is not an object is a usage error naming the flag, a bad field fails at start."""
    from router.cli import build_parser, serve_options
    from router.serve_app import parse_options

    setting = {"method": "ngram", "num_speculative_tokens": 3}
    args = build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert serve_options(args)[0]["speculative_config"] == setting
    _, launch_options, _ = parse_options({"speculative_config": setting})
    assert launch_options["speculative_config"] == setting
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "[4]"])
    assert "--speculative-config: must be a JSON object" in capsys.readouterr().err
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        from engine.config import EngineConfig

        EngineConfig("engine/demo_model", speculative_config={"method": "ngram", "num_speculative_tokens": -1})


def test_the_cache_tiers_reach_the_engine_options_from_the_cli():
    from router.cli import build_parser, serve_options

    args = build_parser().parse_args(["serve", "--enable-prefix-caching", "--host-cache-bytes", "1048576",
                                      "--disk-cache-dir", "/var/cache/splitserve", "--disk-cache-bytes", "4096"])
    options = serve_options(args)[0]
    assert (options["host_cache_bytes"], options["disk_cache_dir"], options["disk_cache_bytes"]) == \
        (1 << 20, "/var/cache/splitserve", 4096)
    assert "host_cache_bytes" not in serve_options(build_parser().parse_args(["serve"]))[0]


def test_the_cache_formats_reach_the_engine_options_from_the_cli():
    from router.cli import build_parser, serve_options

    args = build_parser().parse_args(["serve", "--mamba-state-dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3"])
    options = serve_options(args)[0]
    assert (options["mamba_state_dtype"], options["kv_cache_dtype"]) == ("bfloat16", "fp8_e4m3")
    plain = serve_options(build_parser().parse_args(["serve"]))[0]
    assert "mamba_state_dtype" not in plain and "kv_cache_dtype" not in plain
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
