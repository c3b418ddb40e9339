"""ctypes bindings of the few NCCL functions the NCCL backend needs.

Why not cupy's ``NcclCommunicator``: cupy 13/14 create communicators with a
*blocking* ``ncclCommInitRank`` (no handle until every peer joined, so a
creation that outlives its deadline cannot be aborted; its ``__dealloc__``
then runs ``ncclCommDestroy``) and expose neither ``ncclCommFinalize`` nor a
non-blocking config. Here every communicator is created *non-blocking*
(``ncclConfig_t.blocking = 0``): ``ncclCommInitRankConfig`` returns a handle at
once, the connection proceeds in NCCL's own thread, and the handle can be
aborted at any time (reliable from NCCL 2.25 on).

In non-blocking mode every call may return ``ncclInProgress``; the caller then
polls ``ncclCommGetAsyncError`` until it is not ``ncclInProgress`` before the
next call on that communicator (see :mod:`elastic_ring.backends.nccl.handle`).

The library is the ``libnccl.so.2`` already loaded in the process (torch's
CUDA wheels load it), else the ``nvidia-nccl-cu12`` wheel's, else the
system's. Nothing here touches CUDA: the module imports and loads the library
on machines without a GPU (every communicator creation then fails cleanly).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
import time

from ...core.log import get_logger

_log = get_logger(__name__)

#: NCCL from which ``ncclCommAbort`` reliably interrupts a communicator whose
#: creation or collective is blocked on a lost peer.
MIN_VERSION = (2, 25, 0)
UNIQUE_ID_BYTES = 128
API_MAGIC = 0xCAFEBEEF
CONFIG_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT (INT_MIN)
#: ``version`` written into our ncclConfig_t: its layout is NCCL 2.17's. The
#: struct is append-only; NCCL copies ``size`` bytes and keeps its defaults
#: for every later field.
CONFIG_VERSION = 21700

SUCCESS = 0
IN_PROGRESS = 7
RESULT_NAMES = {
    0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
    4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress", 8: "ncclTimeout",
}

#: ncclDataType_t
INT8, UINT8, INT32, UINT32, INT64, UINT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = range(10)
#: ncclRedOp_t
SUM, PROD, MAX, MIN = range(4)


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class Config(ctypes.Structure):
    """``ncclConfig_t`` as of NCCL 2.17 (``ncclConfig_v21700``)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
    ]


def nonblocking_config(blocking: int = 0) -> Config:
    """NCCL_CONFIG_INITIALIZER with ``blocking = 0`` (or 1: a blocking child of :meth:`NcclLibrary.split`)."""
    u = CONFIG_UNDEF_INT
    return Config(ctypes.sizeof(Config), API_MAGIC, CONFIG_VERSION, blocking, u, u, u, None, u)


class NcclError(RuntimeError):
    """An NCCL call returned an error code (``status``)."""

    def __init__(self, what: str, status: int, detail: str = "") -> None:
        self.status = status
        name = RESULT_NAMES.get(status, f"ncclResult {status}")
        super().__init__(f"{what} failed with {name}" + (f": {detail}" if detail else ""))


class NcclUnavailable(RuntimeError):
    """No usable NCCL library (missing, or older than :data:`MIN_VERSION`)."""


def version_tuple(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s integer as (major, minor, patch): X*10000+Y*100+Z since 2.9, X*1000+Y*100+Z before."""
    if not isinstance(code, int) or code < 0:
        raise ValueError(f"NCCL version code {code!r} must be an int >= 0")
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def check_version(code: int, path: str = "libnccl.so.2") -> tuple[int, int, int]:
    """Raise :class:`NcclUnavailable` unless the runtime NCCL is at least :data:`MIN_VERSION`."""
    found = version_tuple(code)
    if found < MIN_VERSION:
        have, need = ".".join(map(str, found)), ".".join(map(str, MIN_VERSION))
        raise NcclUnavailable(
            f"NCCL {have} (from {path}) is too old for backend='nccl': abort of a hung communicator is reliable "
            f"only from NCCL {need}; pip install 'nvidia-nccl-cu12>={need}' (torch's CUDA wheels load the "
            "libnccl.so.2 of that package)"
        )
    return found


def candidate_paths() -> list[str]:
    """Where to look for libnccl, in order (the first that loads wins)."""
    paths = []
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):  # no "nvidia" namespace package at all
        spec = None
    if spec is not None and spec.submodule_search_locations:
        paths += [os.path.join(p, "lib", "libnccl.so.2") for p in spec.submodule_search_locations]
    paths.append("libnccl.so.2")  # the system's loader path
    return paths


def _open() -> tuple[ctypes.CDLL, str]:
    try:  # the copy torch (or cupy) already loaded: one NCCL per process where possible
        return ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD), "libnccl.so.2 (already loaded)"
    except OSError:
        pass
    errors = []
    for path in candidate_paths():
        if os.path.isabs(path) and not os.path.exists(path):
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    raise NcclUnavailable(
        "no NCCL library found (" + ("; ".join(errors) or "looked for libnccl.so.2") + "); install "
        "elastic-ring[gpu] (nvidia-nccl-cu12) on a GPU machine, or use backend='gloo'"
    )


_c_void_p, _c_int, _c_size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t

#: ncclCommShrink / ncclCommRevoke flags (nccl.h).
SHRINK_DEFAULT, SHRINK_ABORT, REVOKE_DEFAULT = 0x00, 0x01, 0x00


class NcclLibrary:
    """The typed functions of one loaded libnccl. Return codes are ``ncclResult_t`` ints."""

    _SIGNATURES: dict[str, tuple[object, list]] = {
        "ncclGetVersion": (_c_int, [ctypes.POINTER(_c_int)]),
        "ncclGetUniqueId": (_c_int, [ctypes.POINTER(UniqueId)]),
        "ncclGetErrorString": (ctypes.c_char_p, [_c_int]),
        "ncclGetLastError": (ctypes.c_char_p, [_c_void_p]),
        "ncclCommInitRankConfig": (_c_int, [ctypes.POINTER(_c_void_p), _c_int, UniqueId, _c_int,
                                            ctypes.POINTER(Config)]),
        "ncclCommGetAsyncError": (_c_int, [_c_void_p, ctypes.POINTER(_c_int)]),
        "ncclCommFinalize": (_c_int, [_c_void_p]),
        "ncclCommDestroy": (_c_int, [_c_void_p]),
        "ncclCommAbort": (_c_int, [_c_void_p]),
        "ncclAllReduce": (_c_int, [_c_void_p, _c_void_p, _c_size_t, _c_int, _c_int, _c_void_p, _c_void_p]),
        "ncclBroadcast": (_c_int, [_c_void_p, _c_void_p, _c_size_t, _c_int, _c_int, _c_void_p, _c_void_p]),
        "ncclAllGather": (_c_int, [_c_void_p, _c_void_p, _c_size_t, _c_int, _c_void_p, _c_void_p]),
        # A blocking child for bucket allreduces (docs/gpu.md, the launch design not taken yet, measured by
        # benchmarks.nccl_launch); from NCCL 2.18, below MIN_VERSION. (No groups: the bucket lanes never group, as a
        # group is only safe when every rank groups the same collectives: launcher.py.)
        "ncclCommSplit": (_c_int, [_c_void_p, _c_int, _c_int, ctypes.POINTER(_c_void_p), ctypes.POINTER(Config)]),
    }

    #: Re-forming without a full init, where the loaded NCCL has it: shrink (2.27), revoke (2.28), grow and a
    #: per-communicator unique id (2.29). Bound when present (:meth:`has`); nothing uses them by default yet.
    _OPTIONAL_SIGNATURES: dict[str, tuple[object, list]] = {
        "ncclCommShrink": (_c_int, [_c_void_p, ctypes.POINTER(_c_int), _c_int, ctypes.POINTER(_c_void_p),
                                    ctypes.POINTER(Config), _c_int]),
        "ncclCommRevoke": (_c_int, [_c_void_p, _c_int]),
        "ncclCommGetUniqueId": (_c_int, [_c_void_p, ctypes.POINTER(UniqueId)]),
        "ncclCommGrow": (_c_int, [_c_void_p, _c_int, ctypes.POINTER(UniqueId), _c_int, ctypes.POINTER(_c_void_p),
                                  ctypes.POINTER(Config)]),
    }

    def __init__(self, cdll: ctypes.CDLL, path: str) -> None:
        self.path = path
        for name, (restype, argtypes) in self._SIGNATURES.items():
            try:
                fn = getattr(cdll, name)
            except AttributeError:
                raise NcclUnavailable(f"{path} has no {name}: it is not a usable NCCL (need >= 2.25)") from None
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, "_" + name, fn)
        self._optional: set[str] = set()
        for name, (restype, argtypes) in self._OPTIONAL_SIGNATURES.items():
            fn = getattr(cdll, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = restype, argtypes
                setattr(self, "_" + name, fn)
                self._optional.add(name)

    def has(self, name: str) -> bool:
        """Whether the loaded NCCL has the optional function ``name`` (e.g. ``"ncclCommShrink"``)."""
        if name not in self._OPTIONAL_SIGNATURES:
            raise ValueError(f"{name!r} is not an optional NCCL function; known: {sorted(self._OPTIONAL_SIGNATURES)}")
        return name in self._optional

    def _need(self, name: str) -> None:
        if name not in self._optional:
            raise NcclUnavailable(f"{self.path} has no {name} (NCCL {self.version()}); re-form with a full init")

    def shrink_nonblocking(self, comm: int, exclude_ranks: list[int], abort: bool) -> tuple["OutComm", int]:
        """Start shrinking ``comm`` without ``exclude_ranks`` (``abort``: end its in-flight work first,
        NCCL_SHRINK_ABORT): ``(out, status)``. NCCL may write the new handle into ``out`` after this returns
        (a child communicator is made by an asynchronous job), so ``out`` owns every buffer NCCL was given:
        read :attr:`OutComm.value` until it is set, and :meth:`OutComm.abandon` it if you stop waiting."""
        self._need("ncclCommShrink")
        out = OutComm()
        out.keep((_c_int * max(1, len(exclude_ranks)))(*exclude_ranks), nonblocking_config())
        ranks, config = out.kept
        status = self._ncclCommShrink(comm, ranks, len(exclude_ranks), ctypes.byref(out.ptr), ctypes.byref(config),
                                      SHRINK_ABORT if abort else SHRINK_DEFAULT)
        return out, status

    def comm_unique_id(self, comm: int) -> bytes:
        """A unique id for growing ``comm`` (used once, by :meth:`grow_nonblocking`)."""
        self._need("ncclCommGetUniqueId")
        uid = UniqueId()
        self._ok("ncclCommGetUniqueId", self._ncclCommGetUniqueId(comm, ctypes.byref(uid)))
        return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)

    def grow_nonblocking(self, comm: int | None, world_size: int, unique_id: bytes | None,
                         rank: int) -> tuple["OutComm", int]:
        """Start growing to ``world_size`` ranks: a member passes its ``comm``, ``rank=-1`` and the id only on the
        root; a new rank passes ``comm=None``, the id and its rank. ``(out, status)`` as :meth:`shrink_nonblocking`."""
        self._need("ncclCommGrow")
        out = OutComm()
        uid_ptr = None
        if unique_id is not None:
            if len(unique_id) != UNIQUE_ID_BYTES:
                raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
            uid = UniqueId()
            ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
            out.keep(uid)
            uid_ptr = ctypes.byref(uid)
        config = nonblocking_config()
        out.keep(config)
        status = self._ncclCommGrow(comm, world_size, uid_ptr, rank, ctypes.byref(out.ptr), ctypes.byref(config))
        return out, status

    def version(self) -> int:
        value = _c_int()
        self._ok("ncclGetVersion", self._ncclGetVersion(ctypes.byref(value)))
        return value.value

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self._ok("ncclGetUniqueId", self._ncclGetUniqueId(ctypes.byref(uid)))
        return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)

    def error_string(self, status: int) -> str:
        text = self._ncclGetErrorString(status)
        return text.decode(errors="replace") if text else RESULT_NAMES.get(status, str(status))

    def last_error(self, comm: int | None) -> str:
        text = self._ncclGetLastError(comm)
        return text.decode(errors="replace") if text else ""

    def init_rank_nonblocking(self, world_size: int, unique_id: bytes, rank: int) -> tuple[int | None, int]:
        """Start creating a non-blocking communicator: ``(handle or None, status)``.

        Status ``ncclInProgress`` is the normal answer: poll :meth:`async_error`.
        Uses the calling thread's current CUDA device."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
        comm, config = _c_void_p(), nonblocking_config()
        status = self._ncclCommInitRankConfig(ctypes.byref(comm), world_size, uid, rank, ctypes.byref(config))
        return comm.value, status

    def async_error(self, comm: int) -> int:
        result = _c_int(SUCCESS)
        self._ok("ncclCommGetAsyncError", self._ncclCommGetAsyncError(comm, ctypes.byref(result)))
        return result.value

    def all_reduce(self, comm: int, ptr: int, count: int, dtype: int, op: int, stream: int) -> int:
        return self._ncclAllReduce(ptr, ptr, count, dtype, op, comm, stream)

    def broadcast(self, comm: int, ptr: int, count: int, dtype: int, root: int, stream: int) -> int:
        return self._ncclBroadcast(ptr, ptr, count, dtype, root, comm, stream)

    def all_gather(self, comm: int, src: int, dst: int, count: int, dtype: int, stream: int) -> int:
        return self._ncclAllGather(src, dst, count, dtype, comm, stream)

    def split(self, comm: int, color: int, key: int, blocking: bool) -> tuple["OutComm", int]:
        """Start splitting ``comm`` (every rank calls it; ``color`` picks the child, ``key`` orders its ranks) into a
        child that is ``blocking`` or not: ``(out, status)`` as :meth:`shrink_nonblocking` (the call itself is
        non-blocking when ``comm`` is)."""
        out = OutComm()
        config = nonblocking_config(1 if blocking else 0)
        out.keep(config)
        status = self._ncclCommSplit(comm, color, key, ctypes.byref(out.ptr), ctypes.byref(config))
        return out, status

    def finalize(self, comm: int) -> int:
        return self._ncclCommFinalize(comm)

    def destroy(self, comm: int) -> int:
        return self._ncclCommDestroy(comm)

    def abort(self, comm: int) -> int:
        return self._ncclCommAbort(comm)

    def _ok(self, what: str, status: int) -> None:
        if status != SUCCESS:
            raise NcclError(what, status, self.error_string(status))


class OutComm:
    """The ``ncclComm_t*`` (and every buffer) handed to an asynchronous NCCL call that makes a child
    communicator. NCCL's job may write the handle, and read the buffers, after the call returned: they must
    stay alive until then. :meth:`abandon` keeps them for the life of the process (a few bytes) and has a
    reaper thread abort a handle that NCCL writes later (for up to REAP_S)."""

    #: How long the reaper watches an abandoned out-pointer for a late handle.
    REAP_S = 120.0
    _abandoned: list["OutComm"] = []
    _watching: list[tuple["OutComm", object, float]] = []
    _abandoned_lock = threading.Lock()
    _reaper: threading.Thread | None = None

    def __init__(self) -> None:
        self.ptr = _c_void_p()
        self.kept: list = []

    def keep(self, *buffers) -> None:
        self.kept.extend(buffers)

    @property
    def value(self) -> int | None:
        return self.ptr.value

    def abandon(self, lib) -> None:
        """Nobody waits for this child any more: keep the buffers forever, abort the handle if there is or
        comes one (``lib.abort``)."""
        with OutComm._abandoned_lock:
            OutComm._abandoned.append(self)
            OutComm._watching.append((self, lib, time.monotonic() + OutComm.REAP_S))
            if OutComm._reaper is None or not OutComm._reaper.is_alive():
                OutComm._reaper = threading.Thread(target=OutComm._reap, name="elastic-ring-nccl-child-reaper",
                                                   daemon=True)
                OutComm._reaper.start()

    @staticmethod
    def _reap() -> None:
        while True:
            with OutComm._abandoned_lock:
                now, keep = time.monotonic(), []
                for entry in OutComm._watching:
                    out, lib, until = entry
                    value = out.value
                    if value is not None:
                        out.ptr.value = None  # aborted once
                        try:
                            lib.abort(value)
                        except Exception as exc:  # noqa: BLE001 - a reaper has nobody to raise to: logged
                            _log.warning("aborting a late NCCL child communicator failed: %s: %s",
                                         type(exc).__name__, exc)
                    elif now < until:
                        keep.append(entry)
                OutComm._watching = keep
                if not keep:
                    OutComm._reaper = None
                    return
            time.sleep(0.05)


_lock = threading.Lock()
_library: NcclLibrary | None = None


def load() -> NcclLibrary:
    """The process's NCCL library (loaded once); raises :class:`NcclUnavailable` with the fix."""
    global _library
    with _lock:
        if _library is None:
            cdll, path = _open()
            lib = NcclLibrary(cdll, path)
            check_version(lib.version(), path)
            _library = lib
        return _library
