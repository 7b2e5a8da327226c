"""Run an `mx.fast.metal_kernel` call on the CPU from its exact generated source.

1. Source: inside `mx.export_function`, the kernel is called with
   `verbose=True`; MLX prints the full generated Metal source (header,
   signature, body, template instantiation) on the C++ stdout even without
   a Metal back-end. File descriptor 1 is captured around the call.
2. Translation: the `template [[host_name(...)]]` instantiation line is
   dropped, threadgroup arrays are rewritten onto per-threadgroup storage,
   and an `extern "C"` entry is appended that calls the instantiation with
   the buffers and builtins of one thread. Nothing else changes.
3. Build: clang++-19 compiles it against metal_shim.h and links runtime.cpp;
   binaries are cached under a temp directory keyed by a hash of everything
   that goes into them, so each instantiation compiles once.
4. Run: the binary gets the grid, the threadgroup size and the buffers on
   stdin and answers the outputs on stdout (see runtime.cpp).

What this proves is the kernel's logic and numerics on the source MLX would
hand to Metal; not that Apple's compiler accepts every line.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlxkv  # noqa: F401  (before mlx)
from real_parts import on_ci, require
import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
CLANG_ENV = "MLXKV_CLANG"
CLANG = os.environ.get(CLANG_ENV, "clang++-19")
_FLAGS = [
    "-std=c++14",  # MSL 3 is C++14-based
    "-O1",
    "-pthread",
    "-Wno-unknown-attributes",  # [[kernel]], [[buffer(0)]], builtin attributes
    # half and bfloat round at every operation, as on the GPU
    "-Xclang", "-ffloat16-excess-precision=none",
    "-Xclang", "-fbfloat16-excess-precision=none",
]
_SANITIZER_FLAGS = {
    None: [],
    "address": ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"],
    "thread": ["-fsanitize=thread", "-g"],
}
# Load tracing (efficiency.py): the kernel, not the runtime, calls
# __sanitizer_cov_load* before each load; the counters are only there
# because clang wants some coverage kind beside trace-loads. Without
# builtins, a copy loop stays loads rather than an (untraced) memcpy.
_TRACE_FLAGS = ["-fsanitize-coverage=inline-8bit-counters,trace-loads", "-fno-builtin"]
_SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:exitcode=23",
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66:report_signal_unsafe=0",
}
# The builtin parameters MLX can generate, and their fields in MlxkvBuiltins.
_BUILTINS = (
    "thread_position_in_grid", "threads_per_grid", "threadgroup_position_in_grid",
    "threadgroups_per_grid", "thread_position_in_threadgroup", "threads_per_threadgroup",
    "dispatch_threads_per_threadgroup", "thread_index_in_threadgroup",
    "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup", "threads_per_simdgroup",
    "quadgroup_index_in_threadgroup", "thread_index_in_quadgroup",
)
_RAW = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
# runtime.cpp's TraceRecord
TRACE_RECORD = np.dtype([("group", "<u4"), ("thread", "<u2"), ("buffer", "u1"), ("size", "u1"),
                         ("epoch", "<u4"), ("site", "<u4"), ("offset", "<u8")])


class HarnessError(RuntimeError):
    """The kernel could not be built, or its run failed (stderr attached)."""


def clang_available() -> bool:
    """Whether the harness's tests run: always under CI=true, where a missing clang
    then fails them with the install line (real_parts.py) instead of skipping them."""
    return shutil.which(CLANG) is not None or on_ci()


SKIP_REASON = (
    f"{CLANG} not found: the MSL harness compiles kernels with it "
    f"(apt-get install -y clang-19; .ci/run installs it; or set {CLANG_ENV})"
)


# ---- 1. the generated source -------------------------------------------------


@dataclass(frozen=True)
class Param:
    decl: str  # C type as written, e.g. "const device float16_t*"
    name: str
    attribute: str  # "buffer" or a builtin name
    index: int | None  # buffer index


@dataclass(frozen=True)
class Source:
    text: str  # as MLX printed it
    function: str  # the [[kernel]] function's name
    template_args: str | None  # "float16_t, 64, 2" or None
    params: tuple[Param, ...]


def _capture_fd1(fn):
    """Run fn() and return what it wrote to file descriptor 1."""
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile() as sink:
        libc.fflush(None)
        saved = os.dup(1)
        os.dup2(sink.fileno(), 1)
        try:
            fn()
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return sink.read().decode()


_capture_lock = threading.Lock()


def generated_source(launch) -> Source:
    """The exact Metal source MLX generates for `launch` (a mlxkv.attention.kernels.Launch)."""
    inputs = list(launch.inputs)

    def traced(*arrays):
        return launch(inputs=arrays, verbose=True)

    with _capture_lock:
        printed = _capture_fd1(lambda: mx.export_function(lambda *_: None, traced, *inputs))
    found = re.search(r"```\n(.*?)\n```", printed, re.S)
    if not found:
        raise HarnessError(f"MLX printed no kernel source:\n{printed[-2000:]}")
    return parse_source(found.group(1))


_SIGNATURE = re.compile(r"\[\[kernel\]\] void (\w+)\((.*?)\) \{", re.S)
_PARAM = re.compile(r"^(?P<decl>.+?)\s*\b(?P<name>\w+) \[\[(?P<attr>\w+)(?:\((?P<idx>\d+)\))?\]\]$")
_INSTANTIATION = re.compile(r"^template \[\[host_name\(.*$", re.M)
_TEMPLATE_ARGS = re.compile(r"decltype\((\w+)(?:<(.*)>)?\)")


def parse_source(text: str) -> Source:
    signature = _SIGNATURE.search(text)
    if not signature:
        raise HarnessError("no [[kernel]] function in the generated source")
    params = []
    for raw in signature.group(2).split(",\n"):
        m = _PARAM.match(raw.strip())
        if not m:
            raise HarnessError(f"unexpected kernel parameter {raw.strip()!r}")
        idx = m.group("idx")
        params.append(Param(m.group("decl"), m.group("name"), m.group("attr"),
                            int(idx) if idx is not None else None))
    template_args = None
    line = _INSTANTIATION.search(text)
    if line:
        args = _TEMPLATE_ARGS.search(line.group(0))
        template_args = args.group(2) if args else None
    return Source(text, signature.group(1), template_args, tuple(params))


# ---- 2. translation to C++ -----------------------------------------------------

_TG_ARRAY = re.compile(
    r"^(?P<indent>[ \t]*)threadgroup\s+(?P<type>[\w:<>, ]+?)\s+(?P<name>\w+)\s*"
    r"(?P<dims>(?:\[[^\]\n]+\])+)\s*;",
    re.M,
)


def _rewrite_threadgroup_arrays(text: str) -> str:
    # A static array would be shared by every group (and every thread's
    # view of it must be the same storage): allocate per group instead.
    def sub(m):
        t, dims, name = m.group("type").strip(), m.group("dims"), m.group("name")
        return (f"{m.group('indent')}auto& {name} = *reinterpret_cast<{t}(*){dims}>("
                f"mlxkv_msl_tg_alloc(sizeof({t}{dims}), alignof({t})));")

    return _TG_ARRAY.sub(sub, text)


def _argument(p: Param) -> str:
    if p.attribute == "buffer":
        ctype = re.sub(r"\b(device|constant)\b\s*", "", p.decl).strip()
        if ctype.endswith("*"):
            return f"({ctype})buffers[{p.index}]"
        if ctype.endswith("&"):
            return f"*({ctype[:-1].strip()}*)buffers[{p.index}]"
        raise HarnessError(f"buffer parameter {p.name} of type {p.decl!r}")
    if p.attribute not in _BUILTINS:
        raise HarnessError(f"unsupported kernel parameter attribute {p.attribute!r}")
    if p.decl.endswith("3"):
        return f"{p.decl}(b->{p.attribute}[0], b->{p.attribute}[1], b->{p.attribute}[2])"
    return f"{p.decl}(b->{p.attribute})"


def translate(src: Source) -> str:
    """The C++ translation unit for `src`."""
    body = _INSTANTIATION.sub("", src.text)
    body = _rewrite_threadgroup_arrays(body)
    call = src.function + (f"<{src.template_args}>" if src.template_args else "")
    args = ",\n      ".join(_argument(p) for p in src.params)
    return (
        '#include "metal_shim.h"\n'
        '#line 1 "generated.metal"\n'
        f"{body}\n"
        "extern \"C\" void mlxkv_msl_entry(void* const* buffers, const MlxkvBuiltins* b) {\n"
        "  (void)buffers;\n  (void)b;\n"
        f"  {call}(\n      {args});\n"
        "}\n"
    )


# ---- 3. build -------------------------------------------------------------------


@functools.cache
def _clang_version() -> str:
    require("clang++-19", shutil.which(CLANG))
    return subprocess.run([CLANG, "--version"], capture_output=True, text=True, check=True).stdout


def _support_files_hash() -> str:
    h = hashlib.sha256()
    for name in ("metal_shim.h", "msl_abi.h", "runtime.cpp"):
        h.update((HERE / name).read_bytes())
    return h.hexdigest()


class Harness:
    def __init__(self, cache_dir: Path | None = None):
        base = cache_dir or Path(tempfile.gettempdir()) / f"mlxkv-msl-{os.getuid()}"
        self.cache_dir = Path(base)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._sources: dict = {}
        self._remembered: dict = {}
        self._lock = threading.Lock()

    def _key(self, *parts: str) -> str:
        h = hashlib.sha256()
        for part in (_clang_version(), _support_files_hash(), *parts):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:24]

    def _compile(self, out: Path, args: list[str]) -> None:
        if out.exists():
            return
        tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        done = subprocess.run([CLANG, *args, "-o", str(tmp)], capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise HarnessError(f"clang failed:\n{done.stderr[-6000:]}")
        os.replace(tmp, out)  # atomic: parallel sessions may race here

    def _runtime_object(self, sanitizer: str | None) -> Path:
        flags = _FLAGS + _SANITIZER_FLAGS[sanitizer]
        out = self.cache_dir / f"runtime-{self._key(*flags)}.o"
        self._compile(out, [*flags, "-c", str(HERE / "runtime.cpp")])
        return out

    def build(self, tu: str, sanitizer: str | None = None, traced: bool = False, counted: bool = False) -> Path:
        """The executable for translation unit `tu`, compiled on first use;
        `traced`: its loads reported to the runtime (see runtime.cpp); `counted`: built
        for instruction counts (simd operations out of line: metal_shim.h, ops.py)."""
        flags = _FLAGS + _SANITIZER_FLAGS[sanitizer]
        kernel_flags = flags + (_TRACE_FLAGS if traced else []) + (["-DMLXKV_MSL_OPS"] if counted else [])
        exe = self.cache_dir / f"kernel-{self._key(tu, *kernel_flags)}"
        if exe.exists():
            return exe
        runtime = self._runtime_object(sanitizer)
        src = exe.with_name(exe.name + ".cpp")
        if not src.exists():
            tmp = src.with_name(f"{src.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(tu)
            os.replace(tmp, src)
        # compiler-rt: float -> bfloat conversions (__truncsfbf2) live there.
        self._compile(exe, [*kernel_flags, f"-I{HERE}", str(src), str(runtime),
                            "-rtlib=compiler-rt", "-unwindlib=libgcc"])
        return exe

    def build_many(self, tus: list[tuple[str, str | None]], workers: int | None = None) -> None:
        """Compile several translation units in parallel (one clang per core)."""
        for sanitizer in {s for _, s in tus}:
            self._runtime_object(sanitizer)
        workers = workers or max(1, min(len(tus), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda a: self.build(*a), tus))

    # ---- sources of launches ------------------------------------------------------

    def source(self, launch) -> Source:
        """The generated source of `launch`, cached by what determines it."""
        key = (
            id(launch.kernel),
            repr(launch.template),
            tuple((x.dtype, x.ndim == 0, x.size < 8) for x in launch.inputs),
            tuple(launch.output_dtypes),
        )
        with self._lock:
            if key not in self._sources:
                self._sources[key] = (launch.kernel, generated_source(launch))
            return self._sources[key][1]

    def translation_unit(self, launch) -> str:
        return translate(self.source(launch))

    def digest(self, launch) -> str:
        """What determines a run of `launch`: its generated source, geometry and input bytes."""
        h = hashlib.sha256(repr((self.source(launch).text, launch.grid, launch.threadgroup,
                                 launch.output_shapes)).encode())
        for x in launch.inputs:
            h.update(repr((x.dtype, x.shape)).encode())
            h.update(_raw_bytes(x))
        return h.hexdigest()

    def remembered(self, what: str, launch, compute):
        """compute(), once per (what, launch) in this harness: for results of a run that several
        tests ask for and that cost seconds each (outputs, instruction counts under valgrind)."""
        key = (what, self.digest(launch))
        if key not in self._remembered:
            self._remembered[key] = compute()
        return self._remembered[key]

    # ---- 4. run --------------------------------------------------------------------

    def run(self, launch, sanitizer: str | None = None, tu: str | None = None) -> list[mx.array]:
        """Execute `launch` on the CPU; its outputs as MLX arrays."""
        src = self.source(launch)
        return self._execute(launch, src, self.build(tu or translate(src), sanitizer), {})

    def trace(self, launch, buffers: tuple[int, ...]) -> tuple[list[mx.array], np.ndarray]:
        """Execute `launch` with its loads from input `buffers` (indices) recorded:
        the outputs, and one TRACE_RECORD per load in no particular order."""
        src = self.source(launch)
        exe = self.build(translate(src), traced=True)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "loads"
            env = {"MLXKV_MSL_TRACE": str(path), "MLXKV_MSL_TRACE_BUFFERS": ",".join(map(str, buffers))}
            outs = self._execute(launch, src, exe, env)
            return outs, np.fromfile(path, dtype=TRACE_RECORD)

    def run_under(self, launch, prefix: list[str]) -> list[mx.array]:
        """Execute `launch`, built for instruction counts, run by the command `prefix` (a profiler)."""
        src = self.source(launch)
        return self._execute(launch, src, self.build(translate(src), counted=True), {}, prefix)

    def _execute(self, launch, src: Source, exe: Path, extra_env: dict, prefix=()) -> list[mx.array]:
        n_in = len(launch.inputs)
        buffer_params = sorted((p for p in src.params if p.attribute == "buffer"),
                               key=lambda p: p.index)
        if len(buffer_params) != n_in + len(launch.output_shapes):
            raise HarnessError("kernel takes shape/stride/ndim buffers; not supported")
        ins = [_raw_bytes(x) for x in launch.inputs]
        out_sizes = [int(np.prod(s, dtype=np.int64)) * d.size
                     for s, d in zip(launch.output_shapes, launch.output_dtypes)]
        header = b"MSL1" + struct.pack("<7I", *launch.grid, *launch.threadgroup,
                                       n_in + len(out_sizes))
        header += b"".join(struct.pack("<QI", len(b), 0) for b in ins)
        header += b"".join(struct.pack("<QI", n, 1) for n in out_sizes)
        env = dict(os.environ, **_SANITIZER_ENV, **extra_env)
        done = subprocess.run([*prefix, str(exe)], input=header + b"".join(ins), capture_output=True,
                              env=env, timeout=600)
        if done.returncode != 0:
            err = done.stderr.decode(errors="replace")
            if len(err) > 8000:  # sanitizer reports: the head says what, the tail sums up
                err = f"{err[:5000]}\n...\n{err[-3000:]}"
            raise HarnessError(f"kernel run failed (exit {done.returncode}):\n{err}")
        outs, pos = [], 0
        for shape, dtype, n in zip(launch.output_shapes, launch.output_dtypes, out_sizes):
            raw = np.frombuffer(done.stdout[pos:pos + n], dtype=f"u{dtype.size}")
            outs.append(mx.array(raw).view(dtype).reshape(shape))
            pos += n
        if pos != len(done.stdout):
            raise HarnessError("kernel answered the wrong number of output bytes")
        return outs


def _raw_bytes(x: mx.array) -> bytes:
    """Row-major bytes of x (MLX hands metal_kernel row-contiguous inputs)."""
    raw = x.view(_RAW[x.dtype.size]) if x.ndim else x.reshape(1).view(_RAW[x.dtype.size])
    return np.ascontiguousarray(np.array(raw)).tobytes()


@functools.cache
def shared_harness() -> Harness:
    """One harness per test process: sources and binaries are shared by all tests."""
    return Harness()


def remembered_run(launch) -> list[mx.array]:
    """The shared harness's outputs of `launch`, run once per session: tests of what follows a
    check (its stand-ins, the speed gate, doctor) ask for the same launches again and again."""
    harness = shared_harness()
    return harness.remembered("outputs", launch, lambda: harness.run(launch))
