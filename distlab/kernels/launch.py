"""Whether Triton can run here, the launch knobs of the memory-bound Triton kernels (RMSNorm, RoPE,
SwiGLU, LSE merge) for tuning sweeps, and ``CachedLaunch``: Triton launches bound once per key (#24's host
cost: the attention forward's launch 74 → 35 µs of host time on the H200).

    DISTLAB_KERNEL_WARPS=8 python -m distlab.kernels.bench --only memory      # warps per program, every kernel
    DISTLAB_KERNEL_RMSNORM_ROWS=2 DISTLAB_KERNEL_ROPE_TOKENS=4 python -m distlab.kernels.bench --only memory
    python -m distlab.kernels.host_cost --profile "triton launch"             # GPU: where a launch's host time goes
"""

from __future__ import annotations

import functools
import os

import torch

from distlab import knobs


def sm_major(device) -> int:
    """The CUDA device's compute-capability major (9 on Hopper), cached per device: the query costs host
    time on every kernel launch that asks (TMA, PDL)."""
    device = torch.device(device)
    return _sm_major(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _sm_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def triton_runs_on(device) -> bool:
    """Triton is importable and the tensors are on CUDA (or on CPU with ``TRITON_INTERPRET=1``). The one
    guard of the triton import: modules whose kernels are Triton are imported only after it says yes (or
    define their kernels lazily), so an install without the gpu extra never imports triton."""
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _triton_importable()


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def num_warps(default: int) -> int:
    """Knob ``KERNEL_WARPS`` when set (a tuning sweep), else the kernel's own default."""
    value = knobs.get("KERNEL_WARPS")
    return int(value) if value is not None else default


def knob(name: str, default: int) -> int:
    """Knob ``KERNEL_<name>`` (``distlab.knobs``: e.g. rows or tokens per program), else ``default``."""
    value = knobs.get(f"KERNEL_{name}")
    return int(value) if value is not None else default


class CachedLaunch:
    """``kernel[grid](*args, **kwargs)`` with Triton's per-call work done once per key (#24: host cost).

    Triton binds and specialises every argument on every launch (dtype, 16-byte alignment, integer ranges),
    builds a cache-key string from them and finds the compiled kernel. The caller gives a ``key`` that fixes
    all of that: the dtypes, the shapes and strides the integer arguments are computed from, whether every
    pointer is 16-byte aligned, the constexprs and launch options. The first launch of a key goes through
    Triton and keeps the compiled kernel it returns; later ones call its launcher directly
    (``CompiledKernel.run``, what Triton's ``JITFunction.run`` ends with), with every argument in the kernel's
    parameter order. Knob ``DISTLAB_TRITON_LAUNCH``: ``cached`` (default), ``plain`` (Triton's launch every
    call), ``check`` (Triton's launch every call, raising if it picked another compiled kernel than the
    key's: the GPU tests run so), ``skip`` (no launch at all: ``distlab.kernels.host_cost --skip-launches``
    times the host work around the launches on a CPU). Under the interpreter, and while a Triton launch hook
    is set (profilers), every call is plain."""

    MAX_KEYS = 4096

    def __init__(self, kernel):
        self.kernel = kernel
        self.interpreted = not hasattr(kernel, "params")   # TRITON_INTERPRET=1: an InterpretedFunction
        self.names = None if self.interpreted else [p.name for p in kernel.params]
        self.entries: dict = {}

    def __call__(self, key, grid, args, kwargs):
        mode = knobs.get("TRITON_LAUNCH")
        if mode not in ("cached", "plain", "check", "skip"):
            raise ValueError(f"DISTLAB_TRITON_LAUNCH={mode!r}: use cached, plain, check or skip")
        if mode == "skip":   # everything up to the launch, and no launch (host cost on a machine without a GPU)
            return
        if self.interpreted:
            self.kernel[grid](*args, **kwargs)
            return
        driver, triton_knobs = _triton_runtime()
        device = driver.get_current_device()   # Triton compiles and launches for the current device
        key = (device, key)
        entry = self.entries.get(key) if mode == "cached" else None
        if entry is not None and _no_hook(triton_knobs.runtime.launch_enter_hook) \
                and _no_hook(triton_knobs.runtime.launch_exit_hook):
            compiled, tail = entry
            compiled.run(*grid, *(1,) * (3 - len(grid)), driver.get_current_stream(device), compiled.function,
                         compiled.packed_metadata, None, None, None, *args, *tail)
            return
        compiled = self.kernel[grid](*args, **kwargs)
        if mode == "check" and key in self.entries and self.entries[key][0] is not compiled:
            raise RuntimeError(f"CachedLaunch({self.kernel.__name__}): key {key!r} reused for arguments Triton "
                               f"specialises differently: the caller's key misses something")
        if len(self.entries) >= self.MAX_KEYS:
            self.entries.clear()
        tail = tuple(kwargs[name] for name in self.names[len(args):])   # the constexprs, in parameter order
        self.entries.setdefault(key, (compiled, tail))


def _no_hook(hook) -> bool:
    """No launch hook is set: None (older Triton) or an empty ``HookChain`` (Triton 3.5+, where the hooks are
    always a chain object: testing ``is None`` alone sent every launch down Triton's slow path)."""
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


@functools.lru_cache(maxsize=1)
def _triton_runtime():
    """(Triton's active driver, ``triton.knobs``), looked up once."""
    import triton
    from triton import knobs as triton_knobs

    return triton.runtime.driver.active, triton_knobs


def tensor_key(x):
    """What Triton's specialisation and a launch's integer arguments read of one argument: a tensor's shape,
    strides, dtype and pointer alignment; a TMA descriptor's base and block; anything else as it is."""
    if hasattr(x, "data_ptr"):
        return x.shape, x.stride(), x.dtype, x.data_ptr() % 16
    if hasattr(x, "block_shape"):
        return tensor_key(x.base), tuple(x.block_shape)
    return x


def pointer_key(x):
    """What Triton's specialisation reads of a pointer argument: its dtype and alignment (a tensor's sizes and
    strides reach a kernel only as integer arguments, which ``launch_keyed`` keys on as they are); a TMA
    descriptor's ``tensor_key``; anything else as it is."""
    if isinstance(x, torch.Tensor):
        return x.dtype, x.data_ptr() % 16
    return tensor_key(x)


def launch_keyed(cached: CachedLaunch, grid, tensors, scalars, kwargs):
    """``cached`` launched with ``(*tensors, *scalars)`` (the kernel's parameters in that order) and the
    constexprs/options ``kwargs``, keyed on every argument: the scalars and constexprs as they are, the
    tensors by ``pointer_key`` — for launches whose integer arguments are not all derived from a caller's
    plan."""
    key = (tuple(map(pointer_key, tensors)), scalars, grid, tuple(kwargs.items()))
    cached(key, grid, (*tensors, *scalars), kwargs)


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for a launch grid on the host (``triton.cdiv`` became a constexpr function in Triton 3.7:
    ~6 µs a call from Python)."""
    return -(-a // b)
