"""The NCCL backend's CPU-testable parts: the ctypes binding's layout and constants (against the installed
``nccl.h`` where a C compiler and the header exist), the real libnccl where it is installed (loading,
version, unique ids, creation failing cleanly without a GPU), the handle life cycle (create, settle,
finalize, abort) with a fake library, and the pure helpers. The watchdog has its own file; the tests that
need a GPU are in ``tests/gpu``.
"""

import ctypes
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import elastic_ring as er
from elastic_ring.backends.nccl import handle as nccl_handle, lib as nccl_lib
from elastic_ring.backends.nccl.communicator import (
    check_nonblocking_allowed, check_unique_id, reduce_dtype, reduce_op, set_eager_connect,
)
from elastic_ring.backends.nccl.lib import IN_PROGRESS, SUCCESS, NcclError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _library_or_none():
    try:
        return nccl_lib.load()
    except nccl_lib.NcclUnavailable:
        return None


# ---------------------------------------------------------------- refusal
def test_nccl_without_cuda_is_refused_with_a_clear_message():
    if er.nccl_available():
        pytest.skip("this machine has CUDA and NCCL; the refusal applies to machines without them")
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = er.RingSpec(round_id=1, rank=0, world_size=1, node_ids=("n",), backend="nccl", job_id="nccl-refused",
                       store=er.StoreAddress("127.0.0.1", master.port))
    try:
        with pytest.raises(RuntimeError, match=r"backend='nccl' needs CUDA and NCCL.*backend='gloo'"):
            er.init(spec)
        assert not er.is_initialized()
    finally:
        er.shutdown()


# ---------------------------------------------------------------- pure helpers
@pytest.mark.parametrize("code, expected", [(23203, (2, 32, 3)), (22501, (2, 25, 1)), (21805, (2, 18, 5)),
                                            (2804, (2, 8, 4)), (2408, (2, 4, 8)), (30000, (3, 0, 0))])
def test_version_tuple(code, expected):
    assert nccl_lib.version_tuple(code) == expected


@pytest.mark.parametrize("code, accepted", [(22500, True), (22501, True), (23203, True), (22403, False),
                                            (21805, False), (2804, False)])
def test_check_version_pins_nccl_2_25(code, accepted):
    if accepted:
        assert nccl_lib.check_version(code) >= (2, 25, 0)
    else:
        with pytest.raises(nccl_lib.NcclUnavailable, match=r"too old.*from NCCL 2\.25\.0.*nvidia-nccl-cu12>=2\.25"):
            nccl_lib.check_version(code)


def test_config_struct_is_ncclconfig_v21700():
    offsets = [getattr(nccl_lib.Config, f).offset for f, _ in nccl_lib.Config._fields_]
    assert offsets == [0, 8, 12, 16, 20, 24, 28, 32, 40]
    assert ctypes.sizeof(nccl_lib.Config) == 48 and ctypes.sizeof(nccl_lib.UniqueId) == 128
    config = nccl_lib.nonblocking_config()
    assert (config.size, config.magic, config.version, config.blocking) == (48, 0xCAFEBEEF, 21700, 0)
    assert config.cgaClusterSize == config.minCTAs == config.maxCTAs == config.splitShare == -(2**31)
    assert config.netName is None


@pytest.fixture
def nccl_header(tmp_path):
    """The installed nccl.h's folder, with the CUDA headers it includes stubbed in ``tmp_path``."""
    include = next((pathlib.Path(p) / "include" for p in _nccl_package_dirs()
                    if (pathlib.Path(p) / "include" / "nccl.h").exists()), None)
    if include is None or shutil.which("gcc") is None:
        pytest.skip("needs gcc and the nvidia-nccl-cu12 wheel's nccl.h (pip install nvidia-nccl-cu12)")
    (tmp_path / "cuda_runtime.h").write_text("#define CUDART_VERSION 12000\ntypedef struct CUstream_st* cudaStream_t;\n"
                                             "typedef struct CUevent_st* cudaEvent_t;\n")
    (tmp_path / "cuda_fp16.h").write_text("")
    (tmp_path / "cuda_bf16.h").write_text("")
    return include


def test_binding_matches_the_installed_nccl_header(tmp_path, nccl_header):
    """Compiles a C program against the installed nccl.h (CUDA headers stubbed) and compares layouts."""
    include = nccl_header
    fields = [f for f, _ in nccl_lib.Config._fields_]
    enums = ["ncclSuccess", "ncclInProgress", "ncclInvalidUsage", "ncclRemoteError", "ncclInt8", "ncclUint8",
             "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64", "ncclFloat16", "ncclFloat32", "ncclFloat64",
             "ncclBfloat16", "ncclSum", "ncclProd", "ncclMax", "ncclMin"]
    lines = [f'printf("%zu\\n", offsetof(ncclConfig_t, {f}));' for f in fields]
    lines += [f'printf("%d\\n", (int){e});' for e in enums]
    lines += ['printf("%zu\\n", sizeof(ncclUniqueId));', 'printf("%d\\n", NCCL_CONFIG_UNDEF_INT);',
              'printf("%zu\\n", sizeof(ncclResult_t));']
    source = "#include <stdio.h>\n#include <stddef.h>\n#include \"nccl.h\"\nint main(void) {\n" + "\n".join(lines) + \
        "\nreturn 0;\n}\n"
    (tmp_path / "abi.c").write_text(source)
    subprocess.run(["gcc", f"-I{tmp_path}", f"-I{include}", str(tmp_path / "abi.c"), "-o", str(tmp_path / "abi")],
                   check=True, capture_output=True, timeout=60)
    values = [int(v) for v in subprocess.run([str(tmp_path / "abi")], check=True, capture_output=True, text=True,
                                             timeout=10).stdout.split()]
    offsets, codes, (uid_bytes, undef, result_size) = values[:len(fields)], values[len(fields):-3], values[-3:]
    assert offsets == [getattr(nccl_lib.Config, f).offset for f in fields]
    assert codes == [0, nccl_lib.IN_PROGRESS, nccl_handle.INVALID_USAGE, 6, nccl_lib.INT8, nccl_lib.UINT8,
                     nccl_lib.INT32, nccl_lib.UINT32, nccl_lib.INT64, nccl_lib.UINT64, nccl_lib.FLOAT16,
                     nccl_lib.FLOAT32, nccl_lib.FLOAT64, nccl_lib.BFLOAT16, nccl_lib.SUM, nccl_lib.PROD, nccl_lib.MAX,
                     nccl_lib.MIN]
    assert (uid_bytes, undef, result_size) == (nccl_lib.UNIQUE_ID_BYTES, nccl_lib.CONFIG_UNDEF_INT, 4)


#: The C prototype (argument types) of every function the binding declares, as nccl.h spells them.
PROTOTYPES = {
    "ncclGetVersion": ["int*"],
    "ncclGetUniqueId": ["ncclUniqueId*"],
    "ncclGetErrorString": ["ncclResult_t"],
    "ncclGetLastError": ["ncclComm_t"],
    "ncclCommInitRankConfig": ["ncclComm_t*", "int", "ncclUniqueId", "int", "ncclConfig_t*"],
    "ncclCommGetAsyncError": ["ncclComm_t", "ncclResult_t*"],
    "ncclCommFinalize": ["ncclComm_t"],
    "ncclCommDestroy": ["ncclComm_t"],
    "ncclCommAbort": ["ncclComm_t"],
    "ncclAllReduce": ["const void*", "void*", "size_t", "ncclDataType_t", "ncclRedOp_t", "ncclComm_t", "cudaStream_t"],
    "ncclBroadcast": ["const void*", "void*", "size_t", "ncclDataType_t", "int", "ncclComm_t", "cudaStream_t"],
    "ncclAllGather": ["const void*", "void*", "size_t", "ncclDataType_t", "ncclComm_t", "cudaStream_t"],
    "ncclCommSplit": ["ncclComm_t", "int", "int", "ncclComm_t*", "ncclConfig_t*"],
    "ncclCommShrink": ["ncclComm_t", "int*", "int", "ncclComm_t*", "ncclConfig_t*", "int"],
    "ncclCommRevoke": ["ncclComm_t", "int"],
    "ncclCommGetUniqueId": ["ncclComm_t", "ncclUniqueId*"],
    "ncclCommGrow": ["ncclComm_t", "int", "const ncclUniqueId*", "int", "ncclComm_t*", "ncclConfig_t*"],
}

#: Which ctypes type stands for each C type in the binding.
CTYPES_FOR = {
    "int": ctypes.c_int, "ncclResult_t": ctypes.c_int, "ncclDataType_t": ctypes.c_int, "ncclRedOp_t": ctypes.c_int,
    "size_t": ctypes.c_size_t, "ncclComm_t": ctypes.c_void_p, "cudaStream_t": ctypes.c_void_p,
    "void*": ctypes.c_void_p, "const void*": ctypes.c_void_p, "int*": ctypes.POINTER(ctypes.c_int),
    "ncclResult_t*": ctypes.POINTER(ctypes.c_int), "ncclComm_t*": ctypes.POINTER(ctypes.c_void_p),
    "ncclUniqueId": nccl_lib.UniqueId, "ncclUniqueId*": ctypes.POINTER(nccl_lib.UniqueId),
    "const ncclUniqueId*": ctypes.POINTER(nccl_lib.UniqueId), "ncclConfig_t*": ctypes.POINTER(nccl_lib.Config),
}


def test_every_bound_function_has_the_arguments_of_its_nccl_h_prototype():
    """The ctypes argtypes of every binding (the optional shrink / revoke / grow too) follow PROTOTYPES, which
    the next test compiles against the real header."""
    bound = {**nccl_lib.NcclLibrary._SIGNATURES, **nccl_lib.NcclLibrary._OPTIONAL_SIGNATURES}
    assert set(bound) == set(PROTOTYPES)
    for name, (_, argtypes) in bound.items():
        assert list(argtypes) == [CTYPES_FOR[c] for c in PROTOTYPES[name]], name


def test_prototypes_match_the_installed_nccl_header(tmp_path, nccl_header):
    """Assigns each function of nccl.h to a pointer of the PROTOTYPES type; gcc refuses any mismatch."""
    include = nccl_header
    returns = {"ncclGetErrorString": "const char*", "ncclGetLastError": "const char*"}
    lines = [f"{returns.get(name, 'ncclResult_t')} (*p_{name})({', '.join(args) or 'void'}) = {name};"
             for name, args in PROTOTYPES.items()]
    (tmp_path / "sig.c").write_text('#include <stddef.h>\n#include "nccl.h"\n' + "\n".join(lines) + "\nint main(void) { return 0; }\n")
    done = subprocess.run(["gcc", "-Werror=incompatible-pointer-types", "-Werror=discarded-qualifiers", "-c",
                           f"-I{tmp_path}", f"-I{include}", str(tmp_path / "sig.c"), "-o", str(tmp_path / "sig.o")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_optional_functions_are_bound_when_the_library_has_them():
    try:
        lib = nccl_lib.load()
    except nccl_lib.NcclUnavailable as exc:
        pytest.skip(f"no libnccl here: {exc}")
    names = sorted(nccl_lib.NcclLibrary._OPTIONAL_SIGNATURES)
    if lib.version() >= 22900:  # shrink (2.27), revoke (2.28), grow and per-communicator ids (2.29)
        assert [lib.has(n) for n in names] == [True] * len(names)
    with pytest.raises(ValueError, match="not an optional NCCL function"):
        lib.has("ncclAllReduce")


def _nccl_package_dirs():
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec else []


@pytest.mark.parametrize("dtype, code", [(torch.float16, nccl_lib.FLOAT16), (torch.bfloat16, nccl_lib.BFLOAT16),
                                         (torch.float32, nccl_lib.FLOAT32), (torch.float64, nccl_lib.FLOAT64),
                                         (torch.int8, nccl_lib.INT8), (torch.uint8, nccl_lib.UINT8),
                                         (torch.int32, nccl_lib.INT32), (torch.int64, nccl_lib.INT64)])
def test_reduce_dtype(dtype, code):
    assert reduce_dtype(dtype) == code


@pytest.mark.parametrize("dtype", [torch.bool, torch.int16, torch.complex64])
def test_reduce_dtype_refuses_with_the_fix(dtype):
    with pytest.raises(ValueError, match=rf"NCCL cannot reduce tensors of dtype {dtype}; cast to one of"):
        reduce_dtype(dtype)


def test_reduce_op():
    assert [reduce_op(o) for o in (er.Sum, er.Min, er.Max, er.Product)] == [nccl_lib.SUM, nccl_lib.MIN, nccl_lib.MAX,
                                                                            nccl_lib.PROD]
    with pytest.raises(ValueError, match="SUM, MIN, MAX or PRODUCT"):
        reduce_op(er.Average)


def test_unique_id_travels_as_raw_bytes():
    raw = bytes(range(128))
    assert check_unique_id(raw, "rank 1/2 round 3") == raw
    assert check_unique_id(bytearray(raw), "r") == raw
    import pickle

    for bad, shown in [(raw[:64], "got 64"), (pickle.dumps(tuple(raw)), "got "), ("x" * 128, "got str")]:
        with pytest.raises(er.CommError, match=rf"\[rank 1/2 round 3\] the NCCL unique id .* \({shown}"):
            check_unique_id(bad, "rank 1/2 round 3")


def test_eager_connect_is_set_unless_the_user_chose():
    env = {}
    assert set_eager_connect(env) and env == {"NCCL_RUNTIME_CONNECT": "0"}
    env = {"NCCL_RUNTIME_CONNECT": "1"}
    assert not set_eager_connect(env) and env == {"NCCL_RUNTIME_CONNECT": "1"}


@pytest.mark.parametrize("value, allowed", [(None, True), ("", True), ("0", True), ("1", False), (" 1 ", False)])
def test_blocking_communicators_forced_by_the_environment_are_refused(value, allowed):
    env = {} if value is None else {"NCCL_COMM_BLOCKING": value}
    if allowed:
        check_nonblocking_allowed(env)
    else:
        with pytest.raises(RuntimeError, match=r"NCCL_COMM_BLOCKING='1' makes NCCL communicators blocking.*unset it"):
            check_nonblocking_allowed(env)


# ---------------------------------------------------------------- the real library, no GPU
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/gpu forms real communicators")
def test_real_libnccl_loads_and_creation_fails_cleanly_without_a_gpu():
    if _library_or_none() is None:
        pytest.skip("no NCCL library here (pip install 'nvidia-nccl-cu12>=2.25' to run this on CPU)")
    # In a subprocess: ncclGetUniqueId leaves NCCL's bootstrap root thread behind.
    code = textwrap.dedent("""
        import time
        from elastic_ring import CommError
        from elastic_ring.backends.nccl import handle as nccl_handle, lib as nccl_lib
        lib = nccl_lib.load()
        print("VERSION", lib.version())
        a, b = lib.unique_id(), lib.unique_id()
        print("UID", len(a), len(b), a != b)
        ptr, status = lib.init_rank_nonblocking(2, a, 0)
        print("INIT", ptr, status)
        try:
            nccl_handle.create(lib, 2, a, 0, time.monotonic() + 5, "rank 0/2 round 1", 5.0)
        except CommError as exc:
            print("COMMERROR", exc)
        print("ERRSTR", lib.error_string(7))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert "VERSION" in lines, out.stdout + out.stderr
    assert nccl_lib.version_tuple(int(lines["VERSION"])) >= nccl_lib.MIN_VERSION
    assert lines["UID"] == "128 128 True"
    assert lines["INIT"] == f"None {1}"  # ncclUnhandledCudaError, no handle: nothing to abort
    assert lines["COMMERROR"].startswith("[rank 0/2 round 1] NCCL communicator creation failed (ncclUnhandledCudaError")
    assert "in progress" in lines["ERRSTR"].lower()


# ---------------------------------------------------------------- the handle life cycle, fake library
class FakeLib:
    """Answers like NCCL in non-blocking mode; ``states`` are the successive async-error states
    (the last one repeats)."""

    def __init__(self, states=(SUCCESS,), init_status=IN_PROGRESS, init_ptr=0xC0FFEE, finalize_status=IN_PROGRESS):
        self.states, self.init_status, self.init_ptr, self.finalize_status = list(states), init_status, init_ptr, \
            finalize_status
        self.calls = []

    def init_rank_nonblocking(self, world_size, unique_id, rank):
        self.calls.append("init")
        return self.init_ptr, self.init_status

    def async_error(self, ptr):
        assert ptr == self.init_ptr
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def finalize(self, ptr):
        self.calls.append("finalize")
        return self.finalize_status

    def destroy(self, ptr):
        self.calls.append("destroy")
        return SUCCESS

    def abort(self, ptr):
        self.calls.append("abort")
        return SUCCESS

    def last_error(self, ptr):
        return "peer 1 closed the connection"

    def error_string(self, status):
        return nccl_lib.RESULT_NAMES[status]


class FakeClock:
    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def create(lib, clock, timeout_s=3.0):
    return nccl_handle.create(lib, 2, bytes(128), 1, clock() + timeout_s, "rank 1/2 round 4", timeout_s, clock,
                              clock.sleep)


def test_create_settles_and_returns_a_live_handle():
    lib, clock = FakeLib([IN_PROGRESS, IN_PROGRESS, SUCCESS]), FakeClock()
    handle = create(lib, clock)
    assert handle.alive and lib.calls == ["init"]
    assert clock.sleeps == [50e-6, 100e-6]


def test_settle_backs_off_to_2ms():
    lib, clock = FakeLib([IN_PROGRESS] * 12 + [SUCCESS]), FakeClock()
    create(lib, clock)
    assert clock.sleeps[:6] == pytest.approx([50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3])
    assert set(clock.sleeps[6:]) == {2e-3}


def test_create_past_connect_timeout_is_aborted_not_destroyed():
    lib, clock = FakeLib([IN_PROGRESS]), FakeClock()
    with pytest.raises(er.CommError, match=r"\[rank 1/2 round 4\] NCCL communicator not formed within "
                                           r"connect_timeout_s=3.0; a peer did not join \(the creation was aborted\)"):
        create(lib, clock)
    assert lib.calls == ["init", "abort"]
    assert 3.0 <= clock.now - 100.0 <= 3.01


def test_create_error_state_is_aborted_with_nccls_message():
    lib, clock = FakeLib([IN_PROGRESS, 6]), FakeClock()
    with pytest.raises(er.CommError, match=r"creation failed: ncclCommInitRankConfig failed with ncclRemoteError: "
                                           r"ncclRemoteError: peer 1 closed the connection$"):
        create(lib, clock)
    assert lib.calls == ["init", "abort"]


def test_two_ranks_on_one_gpu_get_a_hint():
    lib, clock = FakeLib([nccl_handle.INVALID_USAGE]), FakeClock()
    with pytest.raises(er.CommError, match=r"ncclInvalidUsage.*gpus_per_worker=1.*docs/gpu.md"):
        create(lib, clock)


def test_create_that_fails_at_once_has_nothing_to_abort():
    lib, clock = FakeLib(init_status=1, init_ptr=None), FakeClock()
    with pytest.raises(er.CommError, match=r"creation failed \(ncclUnhandledCudaError: peer 1 closed"):
        create(lib, clock)
    assert lib.calls == ["init"]


def test_finalize_then_destroy_and_never_abort():
    lib, clock = FakeLib([SUCCESS, IN_PROGRESS, IN_PROGRESS, SUCCESS]), FakeClock()
    handle = create(lib, clock)
    nccl_handle.finalize_and_destroy(handle, clock() + 5, "r", clock, clock.sleep)
    assert lib.calls == ["init", "finalize", "destroy"] and not handle.alive
    assert not nccl_handle.abort(handle, "r") and lib.calls[-1] == "destroy"


def test_finalize_past_its_deadline_leaves_the_handle_to_abort():
    lib, clock = FakeLib([SUCCESS, IN_PROGRESS]), FakeClock()
    handle = create(lib, clock)
    with pytest.raises(TimeoutError, match="ncclCommFinalize still in progress"):
        nccl_handle.finalize_and_destroy(handle, clock() + 2, "r", clock, clock.sleep)
    assert "destroy" not in lib.calls and handle.alive
    assert nccl_handle.abort(handle, "r") and not nccl_handle.abort(handle, "r")
    assert lib.calls == ["init", "finalize", "abort"]


def test_finalize_error_is_raised_and_nothing_destroyed():
    lib, clock = FakeLib(), FakeClock()
    lib.finalize_status = 2
    handle = create(lib, clock)
    with pytest.raises(NcclError, match="ncclCommFinalize failed with ncclSystemError: peer 1 closed"):
        nccl_handle.finalize_and_destroy(handle, clock() + 2, "r", clock, clock.sleep)
    assert lib.calls == ["init", "finalize"]


def test_calls_on_an_aborted_handle_fail_and_settle_notices_an_abort():
    lib, clock = FakeLib([SUCCESS, IN_PROGRESS]), FakeClock()
    handle = create(lib, clock)

    def abort_while_sleeping(seconds):  # the watchdog aborts while the caller waits
        nccl_handle.abort(handle, "r")

    with pytest.raises(NcclError, match="aborted while waiting"):
        nccl_handle.settle(handle, "allreduce", clock() + 5, clock, abort_while_sleeping)
    with pytest.raises(NcclError, match="allreduce failed with ncclInvalidUsage: the communicator was aborted"):
        handle.call("allreduce", lambda ptr: SUCCESS)
    assert handle.state() is None


def test_a_call_returning_an_error_names_ncclss_last_error():
    lib, clock = FakeLib(), FakeClock()
    handle = create(lib, clock)
    assert handle.call("allreduce", lambda ptr, x: IN_PROGRESS, 1) == IN_PROGRESS
    with pytest.raises(NcclError, match="broadcast failed with ncclSystemError: peer 1 closed the connection"):
        handle.call("broadcast", lambda ptr: 2)
