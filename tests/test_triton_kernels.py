"""The Triton kernels (attention fwd/bwd/accumulate, RMSNorm+residual, RoPE, SwiGLU, LSE merge) and the ring
emulator against their references: on CPU under ``TRITON_INTERPRET=1`` in fp32 and fp16 at small odd
shapes (the interpreter's bf16 dot is broken), on a GPU at real sizes in bf16/fp16 too. The checks
themselves are in ``tests/kernel_checks.py`` (outputs poisoned with NaN before each kernel runs)."""

import os
import subprocess
import sys

import pytest
import torch

from distlab import knobs

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = ["attention", "accumulate", "rmsnorm", "rope", "swiglu", "merge", "masked", "packed_ring", "emulate", "copies"]


def test_kernels_in_the_interpreter():
    """float32 (every check) and float16 (the kernels: not the emulator's or the packed ring's schedules, which
    float32 checks and whose kernels float16 checks here) in three processes at once, since the interpreter
    runs on one core: ~100 s on a 2-core machine instead of ~200 one after the other. Not started early beside
    the other tests, even at the lowest priority (``nice -n 19``, ``chrt -i 0``): the gloo tests' many small
    exchanges then wait on the busy cores (the README's first command took 83 s instead of ~30)."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.path.dirname(HERE), "OMP_NUM_THREADS": "1"}
    kernels = [n for n in NAMES if n not in ("packed_ring", "emulate")]
    # balanced by their times alone on one core (2026-12-07, s: the masked kernel 27, attention 26, the packed
    # ring 20, accumulate 9, the rest 1-4 each; float16's 36 in all): 56 s alone on 2 cores instead of 62
    runs = [("float32", ["attention", "accumulate", "rmsnorm", "rope", "swiglu", "merge", "emulate", "copies"]),
            ("float32", ["masked", "packed_ring"]), ("float16", kernels)]
    assert sorted(n for _, names in runs[:2] for n in names) == sorted(NAMES)
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "kernel_checks.py"), "--dtype", dtype, *names],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for dtype, names in runs]
    try:
        outputs = [proc.communicate(timeout=600) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for (dtype, names), proc, (out, err) in zip(runs, procs, outputs):
        assert proc.returncode == 0, (dtype, names, out[-2000:] + err[-4000:])
        assert all(f"OK {n}" in out for n in names), (dtype, out)


WRONG_KERNEL = """
import distlab.kernels.triton_attention as t
import tests.kernel_checks as checks

orig = t.flash_forward

def forgets_the_last_row(q, k, v, *args, **kwargs):
    out, lse = orig(q, k, v, *args, **kwargs)
    out[:, -1] = float("nan")          # as if the kernel never wrote it (the buffer was poisoned)
    return out, lse

t.flash_forward = forgets_the_last_row
checks.main(["attention"])
"""


def test_a_kernel_that_leaves_an_element_unwritten_fails_the_checks():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.path.dirname(HERE)}
    proc = subprocess.run([sys.executable, "-c", WRONG_KERNEL], capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(HERE))
    assert proc.returncode != 0 and "NaN in the result" in proc.stderr, proc.stderr[-2000:]


def test_triton_backend_refuses_what_it_cannot_run():
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from distlab.kernels.triton_attention import check_triton_inputs, tile_config

    q = torch.zeros(1, 4, 2, 48)
    with pytest.raises(ValueError, match="head_dim 16, 32, 64, 128 or 256"):
        check_triton_inputs(q, q, q, False)
    with pytest.raises(ValueError, match="causal attention needs seq_q == seq_k"):
        check_triton_inputs(torch.zeros(1, 4, 2, 32), torch.zeros(1, 5, 2, 32), torch.zeros(1, 5, 2, 32), True)
    with knobs.override(TRITON_ATTN_FWD="64,128,4,2"):
        with pytest.raises(ValueError, match="must be a multiple"):
            tile_config("FWD", torch.device("cpu"), 64)
    # knobs and ring buffers are checked before any kernel launches (these tensors are on the CPU, no interpreter)
    from distlab.kernels.triton_attention import tma_kernels
    from distlab.kernels.triton_attention_backward import flash_backward

    q, k = torch.zeros(1, 8, 4, 32), torch.zeros(1, 8, 2, 32)
    for env, value, match in (("TMA", "fwd,dk", "DISTLAB_TRITON_ATTN_TMA='fwd,dk'"),
                              ("DQ_MODE", "atomics", "DQ_MODE='atomics'"),
                              ("SPLIT_GROUPS", "yes", "SPLIT_GROUPS='yes'")):
        with knobs.override(**{f"TRITON_ATTN_{env}": value}):
            with pytest.raises(ValueError, match=match):
                tma_kernels() if env == "TMA" else flash_backward(q, q, k, k, q, torch.zeros(1, 4, 8), True)
    with pytest.raises(ValueError, match="dq_acc must be float32"):
        flash_backward(q, q, k, k, q, torch.zeros(1, 4, 8), True, dq_acc=torch.zeros(q.shape, dtype=torch.float16))


def test_forward_takes_tma_descriptors_for_launches_with_enough_work():
    """``DISTLAB_TRITON_ATTN_TMA=auto`` (the default): a forward launch below ``TMA_MIN_FLOPS`` loads its K/V
    tiles by pointer (host-bound: the descriptors cost more than they gain), one above it through TMA; ``fwd``
    takes TMA whatever the size, ``0`` never. The plan only (CPU tensors, nothing launched)."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from distlab.kernels.triton_attention import TMA_MIN_FLOPS, _forward_plan

    def tma(seq, heads, env):
        q = torch.zeros(1, seq, heads, 128)
        k = torch.zeros(1, seq, 1, 128)
        out, lse = torch.empty_like(q), torch.empty(1, heads, seq)
        with knobs.override(TRITON_ATTN_TMA=env):
            return bool(_forward_plan(q, [(0, seq, k, k, False)], 0.1, out, lse, False, None, None).tma)

    small, big = (128, 4), (2048, 32)   # 4·S²·H·D FLOPs: 3.4e7 and 6.9e10, either side of the bar
    assert 4 * small[0] ** 2 * small[1] * 128 < TMA_MIN_FLOPS < 4 * big[0] ** 2 * big[1] * 128
    assert [tma(*small, "auto"), tma(*big, "auto")] == [False, True]
    assert [tma(*small, "fwd"), tma(*big, "0")] == [True, False]


def test_backward_plan_is_kept_per_shape_strides_alignment_and_flags():
    """The backward's host plan (#24) is found again for a call like an earlier one and made anew when
    anything Triton or the integer arguments read differs: strides, a pointer's 16-byte alignment, a flag,
    a knob. Launches skipped (CPU tensors, no interpreter); the plan's numbers are checked by the parity runs."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from distlab.kernels import triton_attention_backward as tab

    base = torch.zeros(1, 65, 4, 32)
    q, k = base[:, :64], torch.zeros(1, 64, 2, 32)
    out, lse = torch.zeros_like(q), torch.zeros(1, 4, 64)
    tab._BACKWARD_PLANS.clear()
    with knobs.override(TRITON_LAUNCH="skip"):
        def plans(*args, **kw):
            tab.flash_backward(*args, **kw)
            return len(tab._BACKWARD_PLANS)

        assert plans(q, q, k, k, out, lse, True) == 1
        assert plans(q.clone(), q.clone(), k.clone(), k.clone(), out, lse, True) == 1   # same key: found again
        assert plans(q, q, k, k, out, lse, False) == 2                                   # a flag
        shifted = base[:, 1:]                                                            # 4·32 floats on: aligned
        assert plans(shifted, q, k, k, out, lse, True) == 2
        odd = torch.zeros(1, 64 * 4 * 32 + 1)[:, 1:].view(1, 64, 4, 32)                # off 16-byte alignment
        assert plans(odd, q, k, k, out, lse, True) == 3
        wide = torch.zeros(1, 64, 8, 32)[:, :, :4]                                       # other strides
        assert plans(wide, q, k, k, out, lse, True) == 4
        with knobs.override(TRITON_ATTN_SPLIT_GROUPS="1"):                               # a knob
            assert plans(q, q, k, k, out, lse, True) == 5
        # a ring backward's BackwardSteps: the query side's key worked out once, the same key as without it
        steps = tab.BackwardSteps()
        for t, causal in ((q, True), (q, False), (wide, True), (odd, True)):
            n = plans(t, q, k, k, out, lse, causal)
            assert plans(t, q, k, k, out, lse, causal, steps=steps) == n
            assert plans(t, q, k.clone(), k.clone(), out, lse, causal, steps=steps) == n
        assert len(steps._query_sides) == 3
        assert plans(q[:, :32], q[:, :32], k[:, :32], k[:, :32], out[:, :32], lse[..., :32], True, steps=steps) == n + 1
        lent = steps.buffers((2, 3), q.device)
        assert lent is steps.buffers((2, 3), q.device) and lent[0] is not lent[1]
        with pytest.raises(ValueError, match="dk_out and dv_out together"):
            tab.flash_backward(q, q, k, k, out, lse, True, dk_out=torch.zeros(k.shape))


class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _FakeKernel:
    """Stands in for a ``triton.jit`` kernel ``k(X, n, B: constexpr)``: each launch through ``k[grid]``
    compiles (a new ``_FakeCompiled``) unless ``n`` keeps its specialisation class, as Triton would."""

    def __init__(self):
        self.params = [type("P", (), {"name": n, "is_constexpr": c})() for n, c in (("X", False), ("n", False),
                                                                                    ("B", True))]
        self.__name__ = "fake"
        self.compiled, self.plain = {}, 0

    def __getitem__(self, grid):
        def launch(x, n, B, num_warps):
            self.plain += 1
            return self.compiled.setdefault((n % 16 == 0, B), _FakeCompiled())
        return launch


def test_cached_launch_binds_once_per_key(monkeypatch):
    """``CachedLaunch``: the first launch of a key goes through ``kernel[grid]``, later ones straight to the
    compiled kernel's launcher with every parameter in order (constexprs last) and the grid padded to 3-D;
    ``plain`` always goes through Triton; ``check`` raises when a key would reuse a kernel Triton specialised
    differently."""
    from distlab.kernels import launch

    driver = type("D", (), {"get_current_device": lambda self: 0, "get_current_stream": lambda self, d: 77})()
    chain = type("HookChain", (), {"calls": []})   # Triton 3.5+: hooks are a chain object, empty when unset
    hooks = type("K", (), {"runtime": type("R", (), {"launch_enter_hook": chain(), "launch_exit_hook": None})})()
    monkeypatch.setattr(launch, "_triton_runtime", lambda: (driver, hooks))
    kernel = _FakeKernel()
    cached = launch.CachedLaunch(kernel)
    x = torch.zeros(4)
    cached("k16", (2,), (x, 16), dict(B=8, num_warps=4))
    cached("k16", (3, 2), (x, 32), dict(B=8, num_warps=4))
    assert kernel.plain == 1
    compiled = kernel.compiled[(True, 8)]
    assert compiled.runs == [(3, 2, 1, 77, "fn", "meta", None, None, None, x, 32, 8)]
    with knobs.override(TRITON_LAUNCH="plain"):
        cached("k16", (2,), (x, 48), dict(B=8, num_warps=4))
    assert kernel.plain == 2 and len(compiled.runs) == 1
    with knobs.override(TRITON_LAUNCH="check"):
        cached("k16", (2,), (x, 64), dict(B=8, num_warps=4))   # same specialisation: fine
        with pytest.raises(RuntimeError, match="'k16'.*misses something"):
            cached("k16", (2,), (x, 17), dict(B=8, num_warps=4))   # a key that ignores n % 16
    hooks.runtime.launch_enter_hook.calls = [print]   # a profiler's hook: every launch through Triton
    cached("k16", (2,), (x, 16), dict(B=8, num_warps=4))
    assert kernel.plain == 5 and len(compiled.runs) == 1
    with knobs.override(TRITON_LAUNCH="fast"):
        with pytest.raises(ValueError, match="use cached, plain, check or skip"):
            cached("k16", (2,), (x, 16), dict(B=8, num_warps=4))
    assert launch.tensor_key(x) == (x.shape, x.stride(), x.dtype, x.data_ptr() % 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,launch", [("bfloat16", "cached"), ("float16", "cached"), ("bfloat16", "check")])
def test_kernels_on_the_gpu(dtype, launch):
    """At real sizes, outputs poisoned; ``check``: every launch also through Triton's own binding, raising if a
    ``CachedLaunch`` key would have reused a kernel specialised for other arguments."""
    sys.path.insert(0, HERE)
    import kernel_checks

    kernel_checks.poison_allocations()
    try:
        with knobs.override(TRITON_LAUNCH=launch):
            for name in NAMES:
                kernel_checks.CHECKS[name](torch.device("cuda"), getattr(torch, dtype), big=True)
    finally:
        torch.empty, torch.empty_like = kernel_checks._empty, kernel_checks._empty_like
