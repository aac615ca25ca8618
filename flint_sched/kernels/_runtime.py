"""Kernel launches: CUBINs (from _compiler.py) loaded into the current GPU's context and launched on
torch's current stream; with _compiler.py the only modules that import cuda.bindings, lazily.

Launches never allocate or synchronize, so CUDA-graph capture records them (load each kernel once
before capturing: `Kernel.load()`). The compiler's names are re-exported here: kernels and tests
use `_runtime.compile_only`, `_runtime.source_dir` and the errors as before.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping, Sequence

import torch

from flint_sched.kernels._compiler import (  # noqa: F401 - re-exported
    DEFAULT_ARCH,
    KernelCompileError,
    KernelError,
    KernelRuntimeUnavailable,
    ResourceUsage,
    compile_only,
    compile_options,
    cuda_include_dirs,
    current_arch,
    nvrtc_available,
    nvrtc_version,
    resource_usage,
    source_dir,
)

# Scalar kernel arguments must carry their C type: pass I32(n), F32(eps), ...
I32 = ctypes.c_int32
U32 = ctypes.c_uint32
I64 = ctypes.c_int64
U64 = ctypes.c_uint64
F32 = ctypes.c_float


class TensorMap(ctypes.Structure):
    """A CUtensorMap (cuTensorMapEncodeTiled's 128 opaque bytes), passed by value to a kernel's
    `const __grid_constant__` parameter of the same size (the kernel's TMA descriptor)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


_SCALAR_TYPES = (I32, U32, I64, U64, F32, TensorMap)
_PTR = "ptr"


class KernelLaunchError(KernelError):
    """A driver call for a named kernel failed (load, attribute or launch)."""


# ---- the driver, imported lazily -----------------------------------------------------------


_driver_module = None


def _driver():
    global _driver_module
    if _driver_module is None:    # imported once: launches call this on every kernel
        try:
            from cuda.bindings import driver
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise KernelRuntimeUnavailable(f"cuda.bindings.driver cannot be imported: {exc}") from exc
        _driver_module = driver
    return _driver_module


# ---- compiled kernels --------------------------------------------------------------------------

_kernels_lock = threading.Lock()
_kernels: dict[tuple, Kernel] = {}


def compile_kernel(source_name: str, function_name: str, defines: Mapping[str, object] | None = None) -> Kernel:
    """The kernel `function_name` (an extern "C" entry) of cuda/<source_name>, for the current GPU."""
    arch = current_arch()
    key = (source_name, function_name, tuple(sorted((defines or {}).items())), arch)
    with _kernels_lock:
        kernel = _kernels.get(key)
    if kernel is None:
        kernel = Kernel(function_name, compile_only(source_name, defines, arch))
        with _kernels_lock:
            kernel = _kernels.setdefault(key, kernel)
    return kernel


# ---- loading and launching -------------------------------------------------------------------

_contexts: dict[int, object] = {}
_modules: dict[tuple[int, int], object] = {}  # (device, id of cubin bytes) -> CUmodule
_load_lock = threading.Lock()


def _check(result, what: str, error=KernelError):
    """Unpack a cuda.bindings result tuple, raising on any status but CUDA_SUCCESS."""
    driver = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise error(f"{what}: {name.decode() if isinstance(name, bytes) else err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def _ensure_context(device: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    driver = _driver()
    if device not in _contexts:
        torch.cuda.init()
        _check(driver.cuInit(0), "cuInit")
        dev = _check(driver.cuDeviceGet(device), "cuDeviceGet")
        _contexts[device] = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    ctx = _contexts[device]
    current = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(current) != int(ctx):
        _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


_MAX_CONFIGS = 512
# Kernels (by entry-point name) launched without programmatic dependent launch whatever the caller
# asks: an A/B knob for how early launches interact (benchmarks/ab_decode.py --variant
# "x:flint_sched.kernels._runtime.NO_PDL={'moe_route'}"); their griddepcontrol instructions are no-ops.
NO_PDL: frozenset[str] = frozenset()
# torch's raw current-stream handle without building a Stream object (CUDA builds of torch have it).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream_handle(device: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


def encode_tensor_map(tensor: torch.Tensor, box: Sequence[int], swizzle_128b: bool = True) -> TensorMap:
    """The TMA descriptor of a CUDA bf16 tensor with a contiguous last dimension, in boxes of `box`
    elements (innermost first: box[0] along the last dimension), 128-byte swizzled by default."""
    driver = _driver()
    if tensor.dtype != torch.bfloat16 or not tensor.is_cuda or tensor.stride(-1) != 1:
        raise ValueError("encode_tensor_map takes a CUDA bf16 tensor with a contiguous last dimension")
    rank = tensor.dim()
    if len(box) != rank:
        raise ValueError(f"a box of {len(box)} dims for a tensor of {rank}")
    dims = [driver.cuuint64_t(n) for n in reversed(tensor.shape)]
    strides = [driver.cuuint64_t(2 * s) for s in reversed(tensor.stride()[:-1])]
    types = driver.CUtensorMapDataType, driver.CUtensorMapInterleave, driver.CUtensorMapSwizzle
    err, encoded = driver.cuTensorMapEncodeTiled(
        types[0].CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, tensor.data_ptr(), dims, strides,
        [driver.cuuint32_t(b) for b in box], [driver.cuuint32_t(1)] * rank, types[1].CU_TENSOR_MAP_INTERLEAVE_NONE,
        types[2].CU_TENSOR_MAP_SWIZZLE_128B if swizzle_128b else types[2].CU_TENSOR_MAP_SWIZZLE_NONE,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    _check((err,), f"cuTensorMapEncodeTiled (shape {tuple(tensor.shape)}, box {tuple(box)})", KernelLaunchError)
    out = TensorMap()
    ctypes.memmove(ctypes.addressof(out), encoded.getPtr(), ctypes.sizeof(TensorMap))
    return out


class _ArgPack:
    """Prebuilt kernelParams for one argument signature: a void*[] of pointers to ctypes slots."""

    __slots__ = ("slots", "array", "address")

    def __init__(self, kinds: tuple):
        self.slots = [ctypes.c_uint64() if kind is _PTR else kind() for kind in kinds]
        self.array = (ctypes.c_void_p * max(1, len(kinds)))(*[ctypes.addressof(s) for s in self.slots])
        self.address = ctypes.addressof(self.array)

    def fill(self, args: Sequence) -> int:
        for slot, arg in zip(self.slots, args):
            if arg is None:
                slot.value = 0
            elif isinstance(arg, torch.Tensor):
                slot.value = arg.data_ptr()
            elif isinstance(arg, TensorMap):
                ctypes.memmove(ctypes.addressof(slot), ctypes.addressof(arg), ctypes.sizeof(TensorMap))
            else:
                slot.value = arg.value
        return self.address


def _kind(arg):
    if arg is None or isinstance(arg, torch.Tensor):
        return _PTR
    if type(arg) in _SCALAR_TYPES:
        return type(arg)
    raise TypeError(f"kernel argument {arg!r}: pass tensors, None (null pointer) or a typed scalar "
                    "(I32, U32, I64, U64, F32) or TensorMap")


class Kernel:
    """One extern "C" entry point of a compiled CUBIN; loaded per device on first use.

    Not thread-safe per instance (argument slots are reused): launch from one thread.
    """

    def __init__(self, name: str, cubin: bytes):
        self.name = name
        self.cubin = cubin
        self._functions: dict[int, object] = {}
        self._dynamic_shared: dict[int, int] = {}
        self._packs: dict[tuple, _ArgPack] = {}    # by the arguments' types
        self._streams: dict[int, object] = {}
        self._configs: dict[tuple, object] = {}    # PDL launch configs by grid, block, shared bytes, stream

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"

    def load(self, device: int | None = None):
        """Load the module into `device` (default: current) and return the CUfunction."""
        device = torch.cuda.current_device() if device is None else device
        function = self._functions.get(device)
        if function is not None:
            return function
        driver = _driver()
        with _load_lock:
            _ensure_context(device)
            key = (device, id(self.cubin))
            module = _modules.get(key)
            if module is None:
                module = _check(driver.cuModuleLoadData(self.cubin), f"cuModuleLoadData for {self.name}",
                                KernelLaunchError)
                _modules[key] = module
            function = _check(driver.cuModuleGetFunction(module, self.name.encode()),
                              f"cuModuleGetFunction({self.name})", KernelLaunchError)
            self._functions[device] = function
        return function

    def _allow_dynamic_shared(self, device: int, function, shared_bytes: int) -> None:
        # NOTE: the 48 KB default covers static + dynamic shared memory together, so any dynamic
        # request is declared (once per size): 48 KB dynamic beside static memory fails otherwise.
        if shared_bytes <= self._dynamic_shared.get(device, 0):
            return
        driver = _driver()
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(function, attr, shared_bytes),
               f"{self.name}: dynamic shared memory of {shared_bytes} bytes", KernelLaunchError)
        self._dynamic_shared[device] = shared_bytes

    def prefer_shared(self, shared_bytes: int = 0, device: int | None = None):
        """Loads the kernel, allows `shared_bytes` of dynamic shared memory and sets the carveout in
        favour of shared memory (so that as many CTAs fit a SM as their shared memory allows);
        returns the CUfunction."""
        device = torch.cuda.current_device() if device is None else device
        function = self.load(device)
        if shared_bytes:
            self._allow_dynamic_shared(device, function, shared_bytes)
        driver = _driver()
        carveout = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        _check(driver.cuFuncSetAttribute(function, carveout, 100), f"{self.name}: shared memory carveout",
               KernelLaunchError)
        return function

    def resident_blocks(self, block_threads: int, shared_bytes: int = 0, device: int | None = None) -> int:
        """How many CTAs of `block_threads` threads and `shared_bytes` of dynamic shared memory a SM
        holds at once (the driver's occupancy), the carveout set to favour shared memory: what a
        kernel whose CTAs wait on each other must know before it launches."""
        function = self.prefer_shared(shared_bytes, device)
        return int(_check(_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(function, block_threads, shared_bytes),
                          f"{self.name}: occupancy", KernelLaunchError))

    def _stream(self, handle: int):
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = _driver().CUstream(handle)
        return stream

    def launch(self, grid: Sequence[int], block: Sequence[int], args: Sequence, shared_bytes: int = 0,
               stream: torch.cuda.Stream | int | None = None, pdl: bool = False,
               device: int | None = None) -> None:
        """Launch on `stream` (default: torch's current stream of `device`).

        args: tensors (their data_ptr), None (a null pointer) or typed scalars (I32(...), F32(...)).
        pdl: programmatic dependent launch (the kernel may start before its predecessor ends and
        must call griddepcontrol.wait before touching that predecessor's outputs).
        """
        device = torch.cuda.current_device() if device is None else device
        function = self._functions.get(device)
        if function is None:
            function = self.load(device)
        if shared_bytes:
            self._allow_dynamic_shared(device, function, shared_bytes)
        types = tuple(map(type, args))       # C-level; the kinds are worked out once per signature
        pack = self._packs.get(types)
        if pack is None:
            pack = self._packs[types] = _ArgPack(tuple(map(_kind, args)))
        params = pack.fill(args)
        if stream is None:
            handle = _current_stream_handle(device)
        elif isinstance(stream, int):
            handle = stream
        else:
            handle = stream.cuda_stream
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        driver = _driver()
        if pdl and self.name not in NO_PDL:
            key = (gx, gy, gz, bx, by, bz, shared_bytes, handle)
            config = self._configs.get(key)
            if config is None:
                if len(self._configs) >= _MAX_CONFIGS:   # prompt steps vary the grid; keep the cache small
                    self._configs.clear()
                config = self._configs[key] = self._pdl_config(*key)
            result = driver.cuLaunchKernelEx(config, function, params, 0)
        else:
            result = driver.cuLaunchKernel(function, gx, gy, gz, bx, by, bz, shared_bytes,
                                           self._stream(handle), params, 0)
        if result[0] != driver.CUresult.CUDA_SUCCESS:    # the message is built on failure only
            _check(result, f"launch of {self.name} (grid {gx}x{gy}x{gz}, block {bx}x{by}x{bz}, "
                           f"{shared_bytes} B dynamic shared)", KernelLaunchError)

    def _pdl_config(self, gx, gy, gz, bx, by, bz, shared_bytes, handle):
        driver = _driver()
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
        config.blockDimX, config.blockDimY, config.blockDimZ = bx, by, bz
        config.sharedMemBytes = shared_bytes
        config.hStream = self._stream(handle)
        config.attrs = [attr]
        config.numAttrs = 1
        return config
