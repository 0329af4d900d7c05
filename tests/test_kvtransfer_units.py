"""kvtransfer pieces that need no second endpoint: layouts, wire records, row copies, config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer import (
    CacheEntry, CacheLayout, CacheTensors, HandoffTarget, LayoutMismatchError, TransferConfig,
    default_cpu_transport, make_transport,
)
from kvtransfer.layout import BLOCK, TensorSpec
from kvtransfer.messages import HEADER_BYTES, STATUS_ABORTED, WireHeader, decode_trailer, encode_trailer
from kvtransfer.rows import RowMap, byte_rows, copy_rows, plan_packing, runs
from kvtransfer.testing import make_cache


def test_layout_is_ordered_by_layer_and_round_trips():
    cache = make_cache("hybrid", block_size=4, num_blocks=10, num_slots=3, seed=0)
    layout = cache.layout
    assert [s.layer for s in layout.specs] == sorted(s.layer for s in layout.specs)
    assert layout.layers == [0, 1, 2, 3]
    assert {s.name: s.role for s in layout.specs_of_layer(1)} == {"layer1.k": BLOCK, "layer1.v": BLOCK}
    assert {s.layer_kind for s in layout.specs_of_layer(0)} == {"mamba"}
    assert CacheLayout.from_dict(layout.to_dict()) == layout
    assert (cache.num_blocks, cache.num_slots) == (10, 3)
    # only rows differ between workers: layouts still match
    assert make_cache("hybrid", 4, 99, 7, seed=1).layout == layout


def test_handoff_bytes_counts_whole_blocks_and_one_slot():
    layout = make_cache("hybrid", block_size=4, num_blocks=10, num_slots=3, seed=0).layout
    kv_row = 4 * 2 * 8 * 2  # block_size * heads * head_dim * bf16
    state = (24 * 4 * 2 + 24 * 8 * 4) + (24 * 4 * 2 + 3 * 24 * 8 * 4)  # a mamba and a mamba2 layer
    assert layout.num_blocks_for(9) == 3
    assert layout.handoff_bytes(9) == 3 * 4 * kv_row + state
    mamba = make_cache("mamba", 4, 10, 3, seed=0).layout
    assert mamba.num_blocks_for(100) == 0  # no KV: block ids are bookkeeping only


@pytest.mark.parametrize("change, expected", [
    (dict(kind="attention"), "layer 0: mamba vs attention; layer 2: mamba2 vs attention; layer 3: attention vs no cache"),
    (dict(head_dim=16), "layer1.k: token shape (2, 8) vs (2, 16)"),
    (dict(block_size=8, head_dim=16), "layer1.k: token shape (2, 8) vs (2, 16)"),
    (dict(d_inner=32), "layer0.ssm: row_shape (24, 8) vs (32, 8)"),
])
def test_layout_mismatch_names_the_difference(change, expected):
    mine = make_cache("hybrid", 4, 10, 3, seed=0)
    args = dict(kind="hybrid", block_size=4, num_blocks=10, num_slots=3, seed=0)
    args.update(change)
    theirs = make_cache(**args)
    with pytest.raises(LayoutMismatchError, match="between receiver D and sender P") as info:
        mine.layout.check_compatible(theirs.layout, "receiver D", "sender P")
    assert expected in str(info.value)


def test_shards_of_a_tensor_parallel_cache_must_match():
    """Rank r's shard has the same shapes as rank r+1's: only the shard name tells them apart."""
    from dataclasses import replace

    layout = make_cache("hybrid", 4, 10, 3, seed=0).layout
    rank0, rank1 = replace(layout, shard="rank 0 of 2"), replace(layout, shard="rank 1 of 2")
    with pytest.raises(LayoutMismatchError, match="shard 'rank 0 of 2' vs 'rank 1 of 2'"):
        rank0.check_compatible(rank1, "sender P", "receiver D")
    assert "shard 'whole cache' vs 'rank 0 of 2'" in layout.differences(rank0)
    assert CacheLayout.from_dict(rank1.to_dict()) == rank1 and rank0.differences(rank0) == []


def test_speculative_settings_of_a_pair_must_match():
    """A decode worker that speculates and a prefill worker set otherwise refuse each other,
    naming both settings; the setting survives the wire's re-blocking."""
    from dataclasses import replace

    from engine.speculative import SpeculativeConfig
    from kvtransfer.grid import Grid

    layout = make_cache("hybrid", 4, 10, 3, seed=0).layout
    ngram = replace(layout, speculative=SpeculativeConfig("ngram", 4).canonical())
    with pytest.raises(LayoutMismatchError, match='speculative_config none vs {"method":"ngram","model":null,'
                                                  '"num_speculative_tokens":4,'):
        layout.check_compatible(ngram, "sender P", "receiver D")
    assert CacheLayout.from_dict(ngram.to_dict()) == ngram
    assert Grid(4, 8).wire_layout(ngram).speculative == ngram.speculative
    assert ngram.differences(replace(ngram)) == []
    assert SpeculativeConfig("ngram", 4, adaptive=False).canonical() == ngram.speculative  # a local knob


def test_block_sizes_alone_may_differ():
    mine = make_cache("hybrid", 4, 10, 3, seed=0).layout
    for size in (1, 6, 16):
        assert mine.differences(make_cache("hybrid", size, 10, 3, seed=0).layout) == []


def test_grid_rows_of_two_block_sizes():
    from kvtransfer.grid import Grid

    layout = make_cache("hybrid", 6, 10, 3, seed=0).layout
    grid = Grid(6, 4)  # rows of gcd = 2 tokens: 3 per block here, 2 per block on the peer
    assert grid.row_tokens == 2 and grid.wire_rows(layout, 9) == 5 and grid.peer_blocks_for(layout, 9) == 3
    assert grid.my_rows([7, 2], 9) == [21, 22, 23, 6, 7]
    assert grid.peer_rows([5, 0, 9], 9) == [10, 11, 0, 1, 18]
    wire = grid.wire_layout(layout)
    assert wire.block_size == 2 and wire.differences(grid.wire_layout(make_cache("hybrid", 4, 10, 3, seed=0).layout)) == []
    k = next(s for s in wire.specs if s.name == "layer1.k")
    assert k.row_shape == (2, 2, 8)
    mamba = make_cache("mamba", 6, 10, 3, seed=0).layout
    assert grid.wire_rows(mamba, 9) == 0 and grid.peer_blocks_for(mamba, 9) == 0
    rows = torch.arange(10 * 12).reshape(10, 12)  # 10 blocks of 6 tokens, 2 bytes a token
    assert grid.split(rows, 6, BLOCK).shape == (30, 4) and torch.equal(grid.split(rows, 6, BLOCK)[22], rows[7, 4:8])
    assert Grid(4, 4).split(rows, 4, BLOCK) is rows
    with pytest.raises(ValueError, match="block sizes must be >= 1"):
        Grid(0, 4)


def test_a_block_tensor_must_hold_block_size_tokens():
    with pytest.raises(ValueError, match=r"layer0.k: a block tensor is \[blocks, block_size=4, ...\], got \(5, 8, 2, 8\)"):
        CacheTensors(4, [CacheEntry("layer0.k", 0, "attention", BLOCK, torch.zeros(5, 8, 2, 8))])


def test_dtype_and_layer_kind_mismatches():
    k = torch.zeros(5, 4, 2, 8)
    a = CacheTensors(4, [CacheEntry("layer0.k", 0, "attention", BLOCK, k)])
    b = CacheTensors(4, [CacheEntry("layer0.k", 0, "attention", BLOCK, k.half())])
    c = CacheTensors(4, [CacheEntry("layer0.k", 0, "mamba", BLOCK, k)])
    assert a.layout.differences(b.layout) == ["layer0.k: dtype float32 vs float16"]
    assert a.layout.differences(c.layout) == ["layer 0: attention vs mamba"]


def test_cache_validation():
    with pytest.raises(ValueError, match="contiguous"):
        CacheTensors(4, [CacheEntry("layer0.k", 0, "attention", BLOCK, torch.zeros(5, 8, 4).transpose(1, 2))])
    with pytest.raises(ValueError, match="same dim 0"):
        CacheTensors.hybrid(4, attention={0: (torch.zeros(5, 4, 1, 2), torch.zeros(6, 4, 1, 2))})
    with pytest.raises(ValueError, match="role"):
        TensorSpec("x", 0, "attention", "row", (1,), "float32")
    cache = make_cache("hybrid", 4, 10, 3, seed=0)
    with pytest.raises(ValueError, match=r"block ids \[10\] outside \[0, 10\)"):
        cache.check_rows([1, 10], 0, "req")
    with pytest.raises(ValueError, match="duplicate block ids"):
        cache.check_rows([1, 1], 0, "req")
    with pytest.raises(ValueError, match="state slot 3 outside"):
        cache.check_rows([1], 3, "req")


def test_from_named_matches_the_engine_cache_naming():
    cache = make_cache("hybrid", 4, 6, 2, seed=3)
    named = [(s.name, s.layer, s.layer_kind, s.role, cache.tensors[s.name]) for s in cache.layout.specs]
    assert CacheTensors.from_named(4, named).layout == cache.layout
    with pytest.raises(ValueError, match="layer0.<part>"):
        CacheTensors.from_named(4, [("k_cache", 0, "attention", BLOCK, torch.zeros(2, 4, 1, 1))])


def test_pack_plan_segments_follow_layers():
    layout = make_cache("hybrid", 4, 10, 3, seed=0).layout
    per_layer = plan_packing(layout, num_blocks=3, pipelined=True)
    assert [s.layers for s in per_layer.segments] == [(0,), (1,), (2,), (3,)]
    assert per_layer.segments[1].entries[0].rows == 3 and per_layer.segments[0].entries[0].rows == 1
    assert all(e.offset % 64 == 0 for s in per_layer.segments for e in s.entries)
    whole = plan_packing(layout, num_blocks=3, pipelined=False)
    assert len(whole.segments) == 1 and whole.total_bytes == per_layer.total_bytes


def test_runs_and_copy_rows_are_exact():
    assert runs([4, 5, 6, 9, 1], [0, 1, 2, 3, 7]) == [(4, 0, 3), (9, 3, 1), (1, 7, 1)]
    assert runs([], []) == []
    src = torch.randn(20, 4, 3).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    copy_rows(byte_rows(src), byte_rows(dst), RowMap([3, 4, 5, 0], [10, 11, 12, 19]))
    assert torch.equal(dst[[10, 11, 12, 19]], src[[3, 4, 5, 0]])
    assert dst[:10].abs().sum() == 0
    with pytest.raises(ValueError, match="row count mismatch"):
        RowMap([1], [1, 2])
    with pytest.raises(IndexError, match=r"destination row ids outside \[0, 20\): \[20\]"):
        copy_rows(byte_rows(src), byte_rows(dst), RowMap([1, 2], [3, 20]))
    with pytest.raises(IndexError, match=r"source row ids outside \[0, 20\): \[-1\]"):
        copy_rows(byte_rows(src), byte_rows(dst), RowMap([-1, 2], [3, 4]))
    assert isinstance(byte_rows(src), np.ndarray) and byte_rows(src).shape == (20, 4 * 3 * 2)


@pytest.mark.parametrize(("gather_scatter_max", "kernel"), [
    (0, True), (1 << 30, True), (1 << 30, False)])  # memmove per run / compiled loop / numpy gather-scatter
def test_copy_rows_every_path_against_indexing(monkeypatch, gather_scatter_max, kernel):
    import kvtransfer.rows as rows_module

    monkeypatch.setattr(rows_module, "GATHER_SCATTER_MAX_BYTES", gather_scatter_max)
    if kernel:
        assert rows_module.copy_row_ids is not None  # numba is a dependency
    else:
        monkeypatch.setattr(rows_module, "copy_row_ids", None)
    rng = np.random.default_rng(0)
    src = torch.from_numpy(rng.integers(0, 256, (40, 24), dtype=np.uint8)).view(torch.bfloat16)
    for src_ids, dst_ids in [(list(range(5, 12)), [30, 2, 3, 4, 17, 18, 0]),  # packed source
                             ([9, 1, 2, 3, 33, 34, 20], list(range(10, 17))),  # packed destination
                             ([9, 1, 2, 3, 33, 34, 20], [30, 2, 3, 4, 17, 18, 0]),  # both scattered
                             ([7], [39])]:
        dst = torch.zeros_like(src)
        copy_rows(byte_rows(src), byte_rows(dst), RowMap(src_ids, dst_ids))
        expected = torch.zeros_like(src)
        expected[dst_ids] = src[src_ids]
        assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8)), (src_ids, dst_ids)


def test_wire_records_round_trip():
    header = WireHeader("req-\u00e9", 17, 5, None, 12345, True)
    data = header.encode()
    assert data.numel() == HEADER_BYTES and WireHeader.decode(data) == header
    assert decode_trailer(encode_trailer(STATUS_ABORTED, -1)) == (STATUS_ABORTED, -1)
    with pytest.raises(ValueError, match="out of sync"):
        WireHeader.decode(torch.zeros(HEADER_BYTES, dtype=torch.uint8))


def test_target_validation_and_digest():
    t = HandoffTarget("r", "D", [3, 1], 2)
    assert t.dst_block_ids == (3, 1)
    assert t.digest() != HandoffTarget("r", "D", (1, 3), 2).digest()
    assert t.digest() != HandoffTarget("r", "D", (3, 1), None).digest()
    with pytest.raises(ValueError, match="request_id"):
        HandoffTarget("", "D", (), None)
    with pytest.raises(ValueError, match="longer than"):
        HandoffTarget("x" * 500, "D", (), None)


def test_config_is_validated():
    assert TransferConfig().timeout_s > 0
    for bad in (dict(timeout_s=0), dict(connect_timeout_s=-1), dict(watchdog_interval_s=5), dict(advertise_host="")):
        with pytest.raises(ValueError):
            TransferConfig(**bad)


def test_transport_factory():
    assert default_cpu_transport(same_node=True) == "shm"
    assert default_cpu_transport(same_node=False) == "gloo"
    assert make_transport("gloo").name == "gloo"
    with pytest.raises(ValueError, match="unknown transport 'tcp'"):
        make_transport("tcp")
    cache = make_cache("hybrid", 4, 4, 2, seed=0)
    with pytest.raises(ValueError, match="the nccl transport moves cuda caches; this one is on cpu"):
        make_transport("nccl").sender("P", cache)


def test_no_model_family_is_named_where_state_travels():
    """kvtransfer, the workers and the router move what layers declare: a new model family or
    state kind must not need code there. (kvtransfer/testing.py builds synthetic caches of named
    kinds, as data, for the tests.) The one exception is the flag the issue and vLLM name for
    recurrent state of every kind, `--mamba-state-dtype`."""
    import re
    from pathlib import Path

    from engine.models import FAMILIES

    root = Path(__file__).resolve().parent.parent
    words = sorted(set(FAMILIES) | {"mamba2", "granite", "falcon", "nemotron", "zamba"})
    pattern = re.compile(r"\b(" + "|".join(words) + r")", re.IGNORECASE)
    offenders = []
    for folder in ("kvtransfer", "prefill_worker", "decode_worker", "router"):
        for path in sorted((root / folder).glob("*.py")):
            if path.name == "testing.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(re.sub(r"mamba[-_]state[-_]dtype", "", line)):
                    offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_auto_picks_nccl_only_between_whole_gpus_and_refuses_nccl_on_shared_ones():
    from kvtransfer.transport import check_transport, choose_transport

    assert choose_transport("auto", 0, same_node=True) == "shm"
    assert choose_transport("auto", 0, same_node=False) == "gloo"
    assert choose_transport("auto", 0.5, same_node=True) == "shm"  # two workers may share a GPU: staged
    assert choose_transport("auto", 1, same_node=True) == "nccl"
    assert choose_transport("auto", 2.0, same_node=False) == "nccl"
    assert choose_transport("auto", 1.5, same_node=False) == "gloo"
    assert choose_transport("gloo", 1, same_node=True) == "gloo"  # asked for: staged through host memory
    with pytest.raises(ValueError, match=r"gpus_per_worker=0.5: two workers may share one GPU"):
        check_transport("nccl", 0.5)
    with pytest.raises(ValueError, match="run on CPU"):
        check_transport("nccl", 0)
    with pytest.raises(ValueError, match="transport: 'tcp' not in"):
        check_transport("tcp", 0)
    check_transport("nccl", 1)


def test_an_nccl_pair_on_one_gpu_is_refused_naming_both():
    from kvtransfer.nccl_wire import check_distinct_devices

    check_distinct_devices("prefill-0", "GPU-a", "decode-0", "GPU-b")
    check_distinct_devices("prefill-0", "", "decode-0", "")  # an older offer without a device
    with pytest.raises(ValueError, match="sender prefill-0 and receiver decode-0 share GPU GPU-a"):
        check_distinct_devices("prefill-0", "GPU-a", "decode-0", "GPU-a")
