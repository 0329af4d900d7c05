"""A ctypes binding to libnccl.so.2: pairwise communicators without torch.distributed.

The library comes from the nvidia-nccl-cu12 or -cu13 wheel (both install
nvidia/nccl/lib/libnccl.so.2; a CUDA build of torch brings the one it matches), else the
system loader; KVTRANSFER_NCCL_LIBRARY names another file. Loading, the version, a
unique id and error strings need no GPU. The caller carries the unique id from one side
to the other (Ray in the cluster); both then call NcclCommunicator(...) at the same time.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from contextlib import contextmanager, nullcontext
from functools import cache
from pathlib import Path

import torch

UNIQUE_ID_BYTES = 128
IN_PROGRESS = 7

# ncclDataType_t values from nccl.h
NCCL_DTYPES: dict[torch.dtype, int] = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.uint32: 3, torch.int64: 4, torch.uint64: 5,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
    torch.float8_e4m3fn: 10, torch.float8_e5m2: 11, torch.bool: 1,
}


class NcclError(RuntimeError):
    def __init__(self, code: int, call: str, detail: str):
        super().__init__(f"{call} failed: NCCL error {code}: {detail}")
        self.code = code


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


_COMM = ctypes.c_void_p
_SIGNATURES = {  # name: (restype, argtypes)
    "ncclGetVersion": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetUniqueId": (ctypes.c_int, [ctypes.POINTER(_UniqueId)]),
    "ncclGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "ncclGetLastError": (ctypes.c_char_p, [_COMM]),
    "ncclCommInitRank": (ctypes.c_int, [ctypes.POINTER(_COMM), ctypes.c_int, _UniqueId, ctypes.c_int]),
    "ncclCommDestroy": (ctypes.c_int, [_COMM]),
    "ncclCommAbort": (ctypes.c_int, [_COMM]),
    "ncclCommGetAsyncError": (ctypes.c_int, [_COMM, ctypes.POINTER(ctypes.c_int)]),
    "ncclSend": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _COMM, ctypes.c_void_p]),
    "ncclRecv": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _COMM, ctypes.c_void_p]),
    "ncclGroupStart": (ctypes.c_int, []),
    "ncclGroupEnd": (ctypes.c_int, []),
}


def find_library() -> str:
    """Path of the libnccl.so.2 to load: env override, then the pip wheel, then the system name."""
    if os.environ.get("KVTRANSFER_NCCL_LIBRARY"):
        return os.environ["KVTRANSFER_NCCL_LIBRARY"]
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "lib" / "libnccl.so.2"
        if candidate.exists():
            return str(candidate)
    return "libnccl.so.2"


class NcclLibrary:
    def __init__(self, path: str | None = None):
        self.path = path or find_library()
        try:
            self._lib = ctypes.CDLL(self.path)
        except OSError as error:
            raise OSError(
                f"cannot load NCCL from {self.path!r} (install the nvidia-nccl-cu12 or -cu13 wheel that "
                f"matches torch's CUDA, or name a libnccl.so.2 in KVTRANSFER_NCCL_LIBRARY): {error}"
            ) from None
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(self._lib, name)
            function.restype, function.argtypes = restype, argtypes

    def check(self, code: int, call: str, comm=None) -> None:
        if code != 0:
            last = self._lib.ncclGetLastError(comm)
            detail = (last or b"").decode(errors="replace") or self.error_string(code)
            raise NcclError(code, call, detail)

    def error_string(self, code: int) -> str:
        return self._lib.ncclGetErrorString(int(code)).decode(errors="replace")

    def version(self) -> tuple[int, int, int]:
        value = ctypes.c_int()
        self.check(self._lib.ncclGetVersion(ctypes.byref(value)), "ncclGetVersion")
        code = value.value
        if code >= 20900:  # NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9
            return code // 10000, code % 10000 // 100, code % 100
        return code // 1000, code % 1000 // 100, code % 100

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self.check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(bytearray(uid.internal))

    def raw(self):
        return self._lib


@cache
def load_library(path: str | None = None) -> NcclLibrary:
    return NcclLibrary(path)


def nccl_version() -> tuple[int, int, int]:
    """Version of the loaded libnccl, e.g. (2, 32, 3)."""
    return load_library().version()


LAUNCH_ORDER_ENV = "NCCL_LAUNCH_ORDER_IMPLICIT"


def check_launch_order(tp_size: int, environ=os.environ) -> None:
    """Refuse the one NCCL setting under which a tensor-parallel worker's hand-offs can deadlock.

    A TP rank drives two communicators from two threads: its TP group from the thread that runs
    the model, its hand-off pair from the channel thread, in orders that differ from rank to rank
    (a header reaches each rank when it does). NCCL runs kernels of distinct communicators side by
    side on their own streams, and our hand-off kernels are posted only for a hand-off whose peer
    is posting too (kvtransfer.doorbell), so no kernel waits on one that cannot start. With
    NCCL_LAUNCH_ORDER_IMPLICIT, NCCL instead runs one device's kernels in host launch order, which
    deadlocks unless every device launches in one consistent order: here they do not."""
    value = environ.get(LAUNCH_ORDER_ENV, "").strip()
    if tp_size > 1 and value not in ("", "0"):
        raise ValueError(f"{LAUNCH_ORDER_ENV}={value}: a tensor-parallel worker (tensor_parallel_size={tp_size}) "
                         "drives its TP group and its NCCL hand-offs from different threads in orders that differ "
                         "between ranks, which implicit launch ordering can deadlock; unset it (or set it to 0)")


def nccl_dtype(dtype: torch.dtype) -> int:
    if dtype not in NCCL_DTYPES:
        raise TypeError(f"NCCL cannot send {dtype}; supported: {sorted(str(d) for d in NCCL_DTYPES)}")
    return NCCL_DTYPES[dtype]


def check_p2p(tensor: torch.Tensor, peer: int, rank: int, world_size: int, device: torch.device, what: str) -> int:
    """Validate one send/recv before it reaches NCCL; returns the NCCL dtype."""
    if not 0 <= peer < world_size or peer == rank:
        raise ValueError(f"{what}: peer {peer} must be another rank in [0, {world_size}) than {rank}")
    if tensor.device.type != "cuda":
        raise ValueError(f"{what}: NCCL moves CUDA tensors, this one is on {tensor.device}")
    if tensor.device != device:
        raise ValueError(f"{what}: tensor on {tensor.device}, communicator on {device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous")
    return nccl_dtype(tensor.dtype)


class NcclCommunicator:
    """One NCCL communicator (typically two ranks: one sender, one receiver)."""

    def __init__(self, unique_id: bytes, rank: int, world_size: int, device: torch.device | int, library: NcclLibrary | None = None):
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(
                f"unique_id must be {UNIQUE_ID_BYTES} bytes from get_unique_id(), got "
                f"{type(unique_id).__name__} of {len(unique_id) if hasattr(unique_id, '__len__') else '?'}"
            )
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"an NCCL communicator needs a CUDA device, got {self.device}")
        self.rank, self.world_size = rank, world_size
        self.lib = library or load_library()
        uid = _UniqueId()
        ctypes.memmove(ctypes.byref(uid), bytes(unique_id), UNIQUE_ID_BYTES)
        self._comm = _COMM()
        # Without CUDA in torch, NCCL itself reports the missing driver (a clear NcclError).
        on_device = torch.cuda.device(self.device) if torch.cuda.is_available() else nullcontext()
        with on_device:
            code = self.lib.raw().ncclCommInitRank(ctypes.byref(self._comm), world_size, uid, rank)
        self.lib.check(code, "ncclCommInitRank")

    def send(self, tensor: torch.Tensor, peer: int, stream: torch.cuda.Stream) -> None:
        dtype = check_p2p(tensor, peer, self.rank, self.world_size, self.device, "send")
        code = self.lib.raw().ncclSend(tensor.data_ptr(), tensor.numel(), dtype, peer, self._comm, stream.cuda_stream)
        self.lib.check(code, "ncclSend", self._comm)

    def recv(self, tensor: torch.Tensor, peer: int, stream: torch.cuda.Stream) -> None:
        dtype = check_p2p(tensor, peer, self.rank, self.world_size, self.device, "recv")
        code = self.lib.raw().ncclRecv(tensor.data_ptr(), tensor.numel(), dtype, peer, self._comm, stream.cuda_stream)
        self.lib.check(code, "ncclRecv", self._comm)

    @contextmanager
    def group(self):
        """Everything issued inside goes out as one NCCL group (ncclGroupStart/End)."""
        self.lib.check(self.lib.raw().ncclGroupStart(), "ncclGroupStart")
        try:
            yield
        finally:
            self.lib.check(self.lib.raw().ncclGroupEnd(), "ncclGroupEnd", self._comm)

    def async_error(self) -> int:
        value = ctypes.c_int()
        self.lib.check(self.lib.raw().ncclCommGetAsyncError(self._comm, ctypes.byref(value)), "ncclCommGetAsyncError", self._comm)
        return value.value

    def abort(self) -> None:
        """Tear down at once, cancelling queued operations (use when a peer is stuck or gone)."""
        if self._comm:
            comm, self._comm = self._comm, _COMM()
            self.lib.check(self.lib.raw().ncclCommAbort(comm), "ncclCommAbort")

    def destroy(self) -> None:
        if self._comm:
            comm, self._comm = self._comm, _COMM()
            self.lib.check(self.lib.raw().ncclCommDestroy(comm), "ncclCommDestroy")
