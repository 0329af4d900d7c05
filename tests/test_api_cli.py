"""`splitserve generate` and `splitserve status` against a live front door."""

from __future__ import annotations

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
        pb.WorkerStatus(id="decode-0", kind="decode", node="n2", alive=False, running=2)])
    text = format_status(status)
    assert "ready: NO" in text and "75/100 (75%)" in text and "7 (0)" in text and "5.0" in text
    assert text.count("n1") == 2 and text.count("n2") == 2  # a worker row and a node row each
