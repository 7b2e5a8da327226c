"""Run MLX's Linux CPU back-end on a real BLAS.

The Linux `mlx[cpu]` wheel links the netlib reference BLAS it bundles
(`mlx_cpu.libs/libblas-*.so`): about 5 GFLOP/s for an fp32 matmul, where
OpenBLAS gives 150-300. `libmlx.so` leaves `cblas_sgemm` and friends
undefined, and the dynamic linker binds them in the global scope first,
then in libmlx's own dependencies. So a CBLAS loaded with RTLD_GLOBAL
*before* `mlx.core` is imported wins over the bundled one. Once MLX is
loaded its symbols are bound and a BLAS cannot be swapped or unloaded,
which is why this module must not import mlx at module level.

`MLXKV_BLAS` controls it: unset tries a system OpenBLAS, `off`/`0`/`none`
keeps the bundled BLAS, anything else is a library path or soname to load.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import warnings
from dataclasses import dataclass

from mlxkv.errors import MlxkvWarning

log = logging.getLogger(__name__)

ENV_VAR = "MLXKV_BLAS"
OFF_VALUES = frozenset({"off", "0", "none", "false", "no"})

# Sonames tried when MLXKV_BLAS is unset: Debian/Ubuntu's libopenblas0-*,
# the unversioned dev name, Fedora's pthread/OpenMP builds, then BLIS
# (Debian builds it with the CBLAS interface).
DEFAULT_CANDIDATES = (
    "libopenblas.so.0",
    "libopenblas.so",
    "libopenblasp.so.0",
    "libopenblaso.so.0",
    "libblis.so.4",
)

INSTALL_FIX = "sudo apt-get install libopenblas0-pthread"
ORDER_FIX = (
    "import mlxkv before mlx/mlx_lm, or start Python with "
    "LD_PRELOAD=libopenblas.so.0"
)

# Outcomes of load_blas().
LOADED = "loaded"  # we loaded a CBLAS with RTLD_GLOBAL before mlx.core
PRELOADED = "preloaded"  # a CBLAS was already global (e.g. LD_PRELOAD)
DISABLED = "disabled"  # MLXKV_BLAS=off
MISSING = "missing"  # no usable library found; MLX keeps the bundled BLAS
TOO_LATE = "too-late"  # mlx.core was imported first; its symbols are bound
NOT_LINUX = "not-linux"  # macOS uses Accelerate; nothing to do


@dataclass(frozen=True)
class BlasStatus:
    """What load_blas() did, once per process."""

    state: str
    library: str | None  # path of the CBLAS that MLX binds to, when ours
    detail: str  # one line for humans

    @property
    def real_blas(self) -> bool:
        return self.state in (LOADED, PRELOADED)


class BlasOrderWarning(MlxkvWarning):
    """mlx.core was imported before mlxkv, so the real BLAS can't be used."""


# The dynamic linker's state is process-wide and permanent, so the
# outcome is too: computed by the first load_blas() call, then reused.
_status: BlasStatus | None = None


def load_blas() -> BlasStatus:
    """Load a real CBLAS for MLX if possible; idempotent, says things once."""
    global _status
    if _status is None:
        _status = _decide()
        _announce(_status)
    return _status


def _decide() -> BlasStatus:
    if not sys.platform.startswith("linux"):
        return BlasStatus(NOT_LINUX, None, f"{sys.platform}: MLX uses its own BLAS")
    requested = os.environ.get(ENV_VAR, "").strip()
    # Checked before the opt-out: a CBLAS that is already global (say by
    # LD_PRELOAD) is what MLX binds to, whatever MLXKV_BLAS says.
    provider = global_cblas_provider()
    if provider is not None and not _is_bundled(provider):
        return BlasStatus(PRELOADED, provider, "CBLAS already in the global scope")
    if requested.lower() in OFF_VALUES:
        return BlasStatus(DISABLED, None, f"{ENV_VAR}={requested}")
    if "mlx.core" in sys.modules:
        return BlasStatus(TOO_LATE, None, "mlx.core was imported before mlxkv")
    candidates = (requested,) if requested else DEFAULT_CANDIDATES
    for name in candidates:
        path = _load_global(name)
        if path is not None:
            return BlasStatus(LOADED, path, f"loaded {name}")
    tried = ", ".join(candidates)
    return BlasStatus(MISSING, None, f"no CBLAS found (tried {tried})")


def _load_global(name: str) -> str | None:
    """dlopen `name` into the global scope if it exports CBLAS; its path."""
    try:
        # Load locally first so a library without CBLAS never joins the
        # global scope, where it could shadow symbols for everyone.
        local = ctypes.CDLL(name, mode=os.RTLD_LOCAL)
    except OSError:
        return None
    if not hasattr(local, "cblas_sgemm"):
        return None
    # Re-opening a loaded library with RTLD_GLOBAL promotes it in place.
    ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
    return _library_path(ctypes.cast(local.cblas_sgemm, ctypes.c_void_p).value)


def _announce(status: BlasStatus) -> None:
    if status.state == TOO_LATE:
        warnings.warn(
            "mlxkv: mlx.core was imported before mlxkv, so MLX keeps its slow "
            f"bundled reference BLAS. Fix: {ORDER_FIX}.",
            BlasOrderWarning,
            stacklevel=3,
        )
    elif status.state == MISSING:
        # Logged, not printed: a library that prints on import is a bad
        # neighbour. The CLI says it again once its log handler is set up.
        log.warning(slow_blas_notice(status))


def slow_blas_notice(status: BlasStatus) -> str | None:
    """One line saying MLX runs on the slow bundled BLAS and how to fix it, or None."""
    if status.state != MISSING:
        return None
    return (f"{status.detail}; MLX uses its slow bundled reference BLAS. "
            f"Fix: {_fix(status)} (or {ENV_VAR}=off to silence).")


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _library_path(address: int | None) -> str | None:
    """The file that holds `address`, via dladdr."""
    if not address:
        return None
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except (OSError, AttributeError):
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def global_cblas_provider() -> str | None:
    """Path of the library that `cblas_sgemm` resolves to in the global scope."""
    try:
        symbol = ctypes.CDLL(None).cblas_sgemm
    except (OSError, AttributeError):
        return None
    return _library_path(ctypes.cast(symbol, ctypes.c_void_p).value)


def _is_bundled(path: str) -> bool:
    return "mlx_cpu.libs" in path


def mapped_blas_libraries() -> list[str]:
    """BLAS-like libraries mapped into this process, from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in lines if line.count("/")}
    names = ("blas", "blis", "mkl_rt")
    return sorted(p for p in paths if any(n in os.path.basename(p) for n in names))


def blas_report() -> dict:
    """Facts for `mlxkv doctor`: which BLAS MLX uses, Metal, versions."""
    status = load_blas()
    import mlx.core as mx  # after load_blas, so importing can't undo it

    mapped = mapped_blas_libraries()
    return {
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx_version": mx.__version__,
        "metal_available": bool(mx.metal.is_available()),
        "status": status.state,
        "detail": status.detail,
        "env": os.environ.get(ENV_VAR),
        "mlx_blas": _mlx_blas(status, mapped),
        "fix": _fix(status),
        "blas_config": _openblas_config(status.library),
        "mapped": mapped,
    }


def _mlx_blas(status: BlasStatus, mapped: list[str]) -> str:
    if status.real_blas and status.library:
        return status.library
    if status.state == NOT_LINUX:
        return "Accelerate" if sys.platform == "darwin" else "platform default"
    bundled = [p for p in mapped if _is_bundled(p) and "libblas" in p]
    return bundled[0] if bundled else "unknown"


def _fix(status: BlasStatus) -> str | None:
    if status.state == TOO_LATE:
        return ORDER_FIX
    if status.state == MISSING:
        return f"check {ENV_VAR}" if os.environ.get(ENV_VAR) else INSTALL_FIX
    return None


def _openblas_config(path: str | None) -> str | None:
    """OpenBLAS's build string (version, core, threads), if it has one."""
    if path is None:
        return None
    try:
        get_config = ctypes.CDLL(path).openblas_get_config
    except (OSError, AttributeError):
        return None
    get_config.restype = ctypes.c_char_p
    return get_config().decode(errors="replace").strip()


def format_doctor(report: dict, extra: list[tuple[str, str]] = ()) -> str:
    """The report as aligned `key  value` lines, `extra` lines last."""
    blas = report["mlx_blas"]
    kind = "real BLAS" if report["status"] in (LOADED, PRELOADED) else "reference"
    if report["status"] == NOT_LINUX:
        kind = "platform"
    lines = [
        ("platform", report["platform"]),
        ("mlx", report["mlx_version"]),
        ("metal", "available" if report["metal_available"] else "not available"),
        ("blas", f"{blas} ({kind})"),
        ("blas status", f"{report['status']}: {report['detail']}"),
        (ENV_VAR, report["env"] if report["env"] is not None else "(unset)"),
    ]
    if report["blas_config"]:
        lines.append(("blas build", report["blas_config"]))
    lines += [("mapped", path) for path in report["mapped"]]
    if report["fix"]:
        lines.append(("fix", report["fix"]))
    lines += list(extra)
    width = max(len(key) for key, _ in lines)
    return "\n".join(f"{key.ljust(width)}  {value}" for key, value in lines)
