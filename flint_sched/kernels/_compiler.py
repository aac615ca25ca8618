"""NVRTC compilation and the CUBIN caches; with _runtime.py (the driver: loading, launching) the
only modules that import cuda.bindings, lazily, so importing them needs neither the package nor a GPU.

CUBINs are cached on disk under `envs.cache_dir() / "kernels"`, keyed by the source text (with
every included header of ours), the options, the arch and the NVRTC version, and in-process.
`resource_usage` reads ptxas's registers and spills of a build, on any machine with NVRTC.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from flint_sched import envs

DEFAULT_ARCH = "sm_90a"
_CACHE_FORMAT = "1"  # bump to invalidate every cached CUBIN
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


class KernelError(RuntimeError):
    """Base of the errors raised here."""


class KernelRuntimeUnavailable(KernelError):
    """cuda.bindings (NVRTC or the driver API) cannot be imported or used here."""


class KernelCompileError(KernelError):
    """NVRTC rejected a source; `log` holds the compiler's output."""

    def __init__(self, source_name: str, log: str):
        super().__init__(f"NVRTC failed to compile {source_name}:\n{log}")
        self.source_name = source_name
        self.log = log


# ---- lazy imports ---------------------------------------------------------------------------


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise KernelRuntimeUnavailable(f"cuda.bindings.nvrtc cannot be imported: {exc}") from exc
    return nvrtc


def nvrtc_available() -> tuple[bool, str]:
    """(True, version) when NVRTC can be imported and answers, else (False, why)."""
    try:
        return True, ".".join(map(str, nvrtc_version()))
    except Exception as exc:  # noqa: BLE001 - any failure means "not available", with its reason
        return False, f"{type(exc).__name__}: {exc}"


def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    err, major, minor = nvrtc.nvrtcVersion()
    _check_nvrtc(err, "nvrtcVersion")
    return int(major), int(minor)


def _check_nvrtc(err, what: str) -> None:
    nvrtc = _nvrtc()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelError(f"{what} failed: {err!r}")


# ---- sources, options, cache keys ------------------------------------------------------------


def source_dir() -> Path:
    """The folder of .cu/.cuh files (`cuda/` in the repo, `flint_sched/cuda/` when installed)."""
    return Path(str(resources.files("flint_sched") / "cuda"))


def cuda_include_dirs() -> list[str]:
    """CUDA's own headers, for sources that include them (ours need none)."""
    dirs: list[str] = []
    try:
        import cuda.pathfinder as pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            dirs.append(str(found))
    except Exception:  # noqa: BLE001 - optional: fall back to the usual locations
        pass
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and Path(root, "include", "cuda.h").exists() and str(Path(root, "include")) not in dirs:
            dirs.append(str(Path(root, "include")))
    return dirs[:1]


def _local_headers(text: str, folder: Path, seen: dict[str, str]) -> dict[str, str]:
    """Every `#include "x"` of ours reachable from text, name -> contents (for the cache key)."""
    for name in _INCLUDE.findall(text):
        path = folder / name
        if name in seen or not path.exists():
            continue
        seen[name] = path.read_text()
        _local_headers(seen[name], folder, seen)
    return seen


def current_arch() -> str:
    """sm_XY of the current GPU (sm_90a on Hopper), or DEFAULT_ARCH without one."""
    if not torch.cuda.is_available():
        return DEFAULT_ARCH
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def compile_options(arch: str, defines: Mapping[str, object] | None) -> list[str]:
    # NOTE: no --use_fast_math: the router's top-k must reproduce torch's fp32 sigmoid ranking, and
    # flushing subnormals would zero NVFP4 codes of magnitude 0.5 (bf16 subnormals, nvfp4.cuh).
    # Kernels call fast intrinsics explicitly where their error is harmless.
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "-default-device", "-lineinfo",
            f"-I{source_dir()}"]
    opts += [f"-I{d}" for d in cuda_include_dirs()]
    for name, value in sorted((defines or {}).items()):
        opts.append(f"-D{name}" if value is None else f"-D{name}={value}")
    return opts


def _cache_key(source_name: str, text: str, options: Sequence[str], arch: str) -> str:
    h = hashlib.sha256()
    parts = [_CACHE_FORMAT, source_name, text, arch, ".".join(map(str, nvrtc_version()))]
    for name, contents in sorted(_local_headers(text, source_dir(), {}).items()):
        parts += [name, contents]
    parts += [o for o in options if not o.startswith("-I")]  # paths vary by machine, not meaning
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _source_text(source_name: str, source_text: str | None) -> str:
    """source_text, or cuda/<source_name>'s."""
    return source_text if source_text is not None else (source_dir() / source_name).read_text()


def _kernel_cache_dir() -> Path:
    return envs.cache_dir() / "kernels"


# ---- compilation -----------------------------------------------------------------------------

_cubin_lock = threading.Lock()
_cubins: dict[str, bytes] = {}


def _nvrtc_compile(source_name: str, text: str, options: Sequence[str], want_log: bool = False):
    """The CUBIN bytes, or with want_log (CUBIN, NVRTC's log)."""
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), source_name.encode(), 0, [], [])
    _check_nvrtc(err, "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(source_name, _program_log(prog))
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check_nvrtc(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check_nvrtc(err, "nvrtcGetCUBIN")
        return (cubin, _program_log(prog)) if want_log else cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _program_log(prog) -> str:
    nvrtc = _nvrtc()
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return "(no log)"
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    return log.rstrip(b"\0").decode(errors="replace")


def compile_only(source_name: str, defines: Mapping[str, object] | None = None, arch: str = DEFAULT_ARCH,
                 *, source_text: str | None = None) -> bytes:
    """CUBIN bytes of cuda/<source_name> (or of `source_text` under that name); no GPU needed.

    Cached on disk and in-process; raises KernelCompileError with NVRTC's log on failure.
    """
    text = _source_text(source_name, source_text)
    options = compile_options(arch, defines)
    key = _cache_key(source_name, text, options, arch)
    with _cubin_lock:
        if key in _cubins:
            return _cubins[key]
    path = _kernel_cache_dir() / f"{Path(source_name).stem}-{arch}-{key[:24]}.cubin"
    cubin = _read_cached(path)
    if cubin is None:
        cubin = _nvrtc_compile(source_name, text, options)
        _write_cached(path, cubin)
    with _cubin_lock:
        _cubins[key] = cubin
    return cubin


@dataclass(frozen=True)
class ResourceUsage:
    """What ptxas reports for one entry point: registers a thread, stack frame and spill bytes, and its
    static shared memory."""
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int = 0


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)'(.*?)(?=Compiling entry function|\Z)", re.S)


def resource_usage(source_name: str, defines: Mapping[str, object] | None = None, arch: str = DEFAULT_ARCH,
                   *, source_text: str | None = None) -> dict[str, ResourceUsage]:
    """Entry point -> its ResourceUsage, from ptxas -v through NVRTC (compiled afresh, not cached;
    no GPU needed): spills and register counts of every build, on the CPU machine."""
    text = _source_text(source_name, source_text)
    _, log = _nvrtc_compile(source_name, text, compile_options(arch, defines) + ["--ptxas-options=-v"], True)

    def number(pattern: str, body: str) -> int:
        found = re.search(pattern, body)
        return int(found.group(1)) if found else 0

    return {name: ResourceUsage(number(r"Used (\d+) registers", body), number(r"(\d+) bytes stack frame", body),
                                number(r"(\d+) bytes spill stores", body), number(r"(\d+) bytes spill loads", body),
                                number(r"(\d+) bytes smem", body))
            for name, body in _PTXAS_ENTRY.findall(log)}


def _read_cached(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _write_cached(path: Path, data: bytes) -> None:
    """Atomic (temp file + rename); a cache that cannot be written is skipped, not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass
