"""The TP/SP study: one Llama block, tensor-parallel (optionally SP, async TP), against one device.

    distlab run --nproc 4 -m distlab.tp --hidden 512 --ffn 1536 --heads 8 --kv-heads 2 --seq 1024 --sp --check
    torchrun --nproc-per-node 8 -m distlab.tp --hidden 4096 --ffn 14336 --heads 32 --kv-heads 8 --seq 8192 --sp --async-tp

Every rank builds the same one-device block (same seed), keeps its shard (``TPLlamaBlock``), and times
``--iters`` forward and forward+backward passes. It prints the slowest rank's times, the collectives of
one forward and one forward+backward (calls and bytes per rank, ``distlab.comm.CommLog``), the activation
memory each rank keeps for backward, and with ``--check`` the max relative error of the output, the input
gradient and every weight gradient against the one-device block (float64 on CPU).

Activation memory: on GPU, the growth of allocated memory across the forward (what autograd keeps); on
CPU, the bytes of the distinct tensors autograd saves (parameters excluded). The model it is set against
is the one-device block's own figure divided by tp — what full sequence parallelism would give. Without
SP the norms and the residual stream stay replicated, so the measured figure sits above that line.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

from distlab import comm
from distlab.profiling import profile_steps
from distlab.runtime import init_runtime, shutdown
from distlab.tp.block import LlamaBlock, TPLlamaBlock
from distlab.bench import DTYPES, StudyParser, add_common_args, positive_int, resolve_device, time_ranks, write_json



def parse_args(argv=None):
    p = StudyParser(prog="python -m distlab.tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=positive_int, default=None, help="default 4096 on GPU, 256 on CPU")
    p.add_argument("--ffn", type=positive_int, default=None, help="default 14336 on GPU, 768 on CPU")
    p.add_argument("--heads", type=positive_int, default=None, help="default 32 on GPU, 8 on CPU")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="default 8 on GPU, 2 on CPU")
    p.add_argument("--seq", type=positive_int, default=None, help="default 8192 on GPU, 512 on CPU")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.add_argument("--async-tp", action="store_true", help="ring-step AG/RS overlapped with GEMMs (needs --sp)")
    p.add_argument("--check", action="store_true")
    add_common_args(p, warmup=1, dtypes=("float32", "bfloat16", "float64"), profile=True, profile_dir="traces/tp")
    args = p.parse_args(argv)
    gpu = resolve_device(args.device).type == "cuda"
    for name, g, c in (("hidden", 4096, 256), ("ffn", 14336, 768), ("heads", 32, 8), ("kv_heads", 8, 2),
                       ("seq", 8192, 512), ("dtype", "bfloat16", "float32"), ("iters", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, g if gpu else c)
    return args


def saved_activation_bytes(fn, params, device):
    """Bytes autograd keeps for backward across ``fn()`` (GPU: allocator growth; CPU: saved tensors)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before - out.numel() * out.element_size(), out
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def run(args):
    rt = init_runtime(device=args.device)
    tp, rank, dev = rt.world_size, rt.rank, rt.device
    if args.async_tp and not args.sp:
        raise ValueError("--async-tp overlaps the sequence-parallel collectives: add --sp")
    if args.sp and args.seq % tp:
        raise ValueError(f"--seq {args.seq} is not divisible by the tensor-parallel size {tp}")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    ref_dtype = torch.float64 if (args.check and dev.type == "cpu") else dtype
    ref = LlamaBlock(args.hidden, args.ffn, args.heads, args.kv_heads, device=dev, dtype=ref_dtype)
    block = TPLlamaBlock(ref, None, sequence_parallel=args.sp, async_tp=args.async_tp).to(dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(dev, ref_dtype)
    w = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(dev, ref_dtype)
    shard = (lambda t: t.chunk(tp, 1)[rank].contiguous()) if args.sp else (lambda t: t)
    xl = shard(x).to(dtype).requires_grad_(True)
    wl = shard(w).to(dtype)

    def fwd():
        with torch.no_grad():
            return block(xl)

    def fwd_bwd():
        (block(xl) * wl).sum().backward()

    t_fwd = time_ranks(fwd, args.iters, args.warmup, dev)
    t_fb = time_ranks(fwd_bwd, args.iters, args.warmup, dev)
    block.zero_grad(set_to_none=True)
    xl.grad = None
    with comm.CommLog() as log_fwd:
        act_bytes, out = saved_activation_bytes(lambda: block(xl), list(block.parameters()), dev)
    with comm.CommLog() as log_bwd:
        (out * wl).sum().backward()
    block.sync_replicated_kv_grads()
    one_bytes = None
    if rank == 0:  # the one-device block in the same dtype as the shards
        same = copy.deepcopy(ref).to(dtype)
        xs = x.to(dtype).requires_grad_(True)
        one_bytes, _ = saved_activation_bytes(lambda: same(xs), list(same.parameters()), dev)
        del same, xs
    stats = torch.tensor([[t_fwd, t_fb, act_bytes]], dtype=torch.float64)
    per_rank = comm.all_gather_raw(stats, None, 0)
    result = {"tp": tp, "device": str(dev), "args": vars(args), "comm_forward": log_fwd.as_dict(),
              "comm_backward": log_bwd.as_dict(), "one_device_activation_bytes": one_bytes,
              "ranks": [dict(zip(("fwd_s", "fwd_bwd_s", "activation_bytes"), r.tolist())) for r in per_rank]}
    if args.check:
        got = block.full_grads()
        got["out"] = comm.all_gather_raw(out.detach(), None, 1) if args.sp else out.detach()
        got["dx"] = comm.all_gather_raw(xl.grad, None, 1) if args.sp else xl.grad
        errors = torch.zeros(len(got), dtype=torch.float64)
        if rank == 0:
            xr = x.clone().requires_grad_(True)
            out_ref = ref(xr)
            (out_ref * w).sum().backward()
            want = {k: getattr(ref, k).weight.grad for k in ("qkv", "o", "gate_up", "down", "norm1", "norm2")}
            want.update(out=out_ref.detach(), dx=xr.grad)
            errors = torch.tensor([rel(got[k], want[k]) for k in got], dtype=torch.float64)
        dist.broadcast(errors, 0)
        tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
        result.update(max_rel_error=dict(zip(got, errors.tolist())), tolerance=tol,
                      check_passed=bool(errors.max() <= tol))
    if args.profile != "none":
        result["trace"] = profile_steps(fwd_bwd, args.profile, args.profile_dir, rank)
    return rt, result


def report(result) -> str:
    a = result["args"]
    mode = "TP+SP, async" if a["async_tp"] else "TP+SP" if a["sp"] else "TP"
    t_f = max(r["fwd_s"] for r in result["ranks"])
    t_fb = max(r["fwd_bwd_s"] for r in result["ranks"])
    flops = 2 * a["batch"] * a["seq"] * (a["hidden"] * (a["heads"] + 2 * a["kv_heads"]) * a["hidden"] // a["heads"]
                                         + a["hidden"] ** 2 + 3 * a["hidden"] * a["ffn"])
    flops += 2 * a["batch"] * a["seq"] ** 2 * a["hidden"]  # causal attention: 4·b·s²·h / 2
    lines = [f"Llama block, {mode}, tp={result['tp']}, {result['device']}: batch {a['batch']} · seq {a['seq']} · "
             f"hidden {a['hidden']} · ffn {a['ffn']} · heads {a['heads']} (kv {a['kv_heads']}) · {a['dtype']}", "",
             f"{'rank':>4} {'fwd ms':>9} {'fwd+bwd ms':>11} {'activations MB':>15}"]
    for r, row in enumerate(result["ranks"]):
        lines.append(f"{r:>4} {row['fwd_s'] * 1e3:>9.2f} {row['fwd_bwd_s'] * 1e3:>11.2f} {row['activation_bytes'] / 1e6:>15.3f}")
    lines.append(f"slowest rank: fwd {t_f * 1e3:.2f} ms, bwd {(t_fb - t_f) * 1e3:.2f} ms, fwd+bwd {t_fb * 1e3:.2f} ms "
                 f"({3 * flops / t_fb / 1e12 / result['tp']:.3f} TFLOP/s per rank)")
    one = result["one_device_activation_bytes"]
    if one:
        mine = result["ranks"][0]["activation_bytes"]
        lines.append(f"activation memory kept for backward: one device {one / 1e6:.3f} MB; this rank {mine / 1e6:.3f} MB; "
                     f"model one/tp = {one / result['tp'] / 1e6:.3f} MB (measured/model {mine / (one / result['tp']):.2f})")
    for name, log in (("forward", result["comm_forward"]), ("backward", result["comm_backward"])):
        per_op = ", ".join(f"{op} x{log['calls'][op]} {log['bytes'][op] / 1e6:.3f} MB" for op in sorted(log["calls"]))
        lines.append(f"collectives per rank, {name}: {per_op or 'none'}")
    if "max_rel_error" in result:
        worst = max(result["max_rel_error"], key=result["max_rel_error"].get)
        lines.append(f"check vs one device: max rel error {result['max_rel_error'][worst]:.2e} ({worst}) over out, dx "
                     f"and every weight grad (tolerance {result['tolerance']:.0e}): "
                     f"{'PASS' if result['check_passed'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    rt, result = run(args)   # bad input: ValueError on every rank before any collective
    if rt.is_main:
        print(report(result))
        if args.json:
            write_json(args.json, result)
    shutdown()
    if args.check and not result["check_passed"]:
        sys.exit(1)
