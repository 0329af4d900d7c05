"""The C++ entries' contract: their parameters are read from the C++ itself, and every call
names each of them once (a missing, misspelt or extra argument is refused before the call)."""

from __future__ import annotations

import pytest

from engine.kernels import native


def test_every_entry_is_read_from_the_cpp_with_its_thread_count_last():
    assert {"decoder_layers", "mamba_decode", "paged_attention_decode", "row_argmax"} <= set(native.SIGNATURES)
    for name, params in native.SIGNATURES.items():
        assert params[-1][1] is native.INT, name
        assert all(param is not None for param, _ in params[:-1]), name
    assert [p for p, _ in native.SIGNATURES["row_argmax"]] == ["x", "out", "rows", "cols", "threads"]


def test_a_call_that_misnames_its_arguments_is_refused_before_it_runs():
    with pytest.raises(TypeError, match=r"row_argmax: missing \['cols'\], unexpected \['columns'\]"):
        native.call("row_argmax", x=None, out=None, rows=0, columns=0)
    with pytest.raises(TypeError, match=r"row_argmax: missing \[\], unexpected \['threads'\]"):
        native.call("row_argmax", x=None, out=None, rows=0, cols=0, threads=2)


def test_a_declaration_the_binding_cannot_read_is_an_error(tmp_path):
    source = tmp_path / "k.cpp"
    source.write_text('extern "C" {\nvoid f(double* x, int64_t n, int threads) {}\n'
                      'void g(const float* x, unsigned n, int threads) {}\n}  // extern "C"\n')
    with pytest.raises(RuntimeError, match=r"k.cpp: g: parameter 'unsigned n'"):
        native.read_signatures([source])
    source.write_text('extern "C" void h(const float* x, int64_t n) {}\n')
    with pytest.raises(RuntimeError, match="h must end with its int thread count"):
        native.read_signatures([source])
