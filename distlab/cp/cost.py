"""Communication-volume model of the CP attentions: bytes each rank sends, forward and backward.

    python -m distlab.cp.cost --seq 65536 --heads 32 --kv-heads 8 --head-dim 128 --world 8 --dtype bf16

The counts follow exactly what ``distlab/comm.py`` logs (tests assert they agree to the byte):

- ring (contiguous or zigzag — a hop sends the whole K/V block either way): forward R−1 hops of K and V,
  ``2·b·(s/R)·kv·d`` elements each; backward R−1 K/V hops again plus R hops of the float32 (dK, dV)
  accumulator (float64 for float64 inputs).
- Ulysses: forward all-to-alls of q, k, v and out, backward of dout, dq, dk, dv; each sends (U−1)/U of
  the local tensor. k and v count kv' heads, the kv heads after replication (``kv_replication``).
- USP: the Ulysses all-to-alls on the local piece plus ring hops of the (b, s/R, kv'/U, d) K/V.
- all-gather KV: forward one all-gather of K and V, (W−1)/W of the full K+V, i.e. (W−1) local blocks;
  backward one reduce-scatter of dK and dV (in K's dtype), the same bytes. Packed documents, windows and
  the balanced layout change what is computed, never what travels: every method sends the same bytes.

The all-to-all and ring bytes are integer floors, as the log counts them.
"""

from __future__ import annotations


import torch

from distlab.comm import sent_bytes
from distlab.cp.ulysses import kv_replication
from distlab.bench import DTYPES, StudyParser, dtype_arg, positive_int, run_study, write_json

def ring_bytes(batch, seq, heads, kv_heads, head_dim, itemsize, ring, acc_itemsize=4):
    """(forward, backward) bytes sent per rank by ring attention over ``ring`` ranks on seq ``seq``."""
    if ring == 1:
        return 0, 0
    block = batch * (seq // ring) * kv_heads * head_dim
    fwd = (ring - 1) * 2 * block * itemsize
    return fwd, fwd + ring * 2 * block * acc_itemsize


def ulysses_bytes(batch, seq, heads, kv_heads, head_dim, itemsize, ulysses):
    """(forward, backward) bytes sent per rank by the Ulysses all-to-alls over ``ulysses`` ranks."""
    if ulysses == 1:
        return 0, 0
    kv = kv_heads * kv_replication(heads, kv_heads, ulysses)
    local = batch * (seq // ulysses) * head_dim * itemsize
    one_way = 2 * sent_bytes("all_to_all", local * heads, ulysses) + 2 * sent_bytes("all_to_all", local * kv, ulysses)   # q and out; k and v
    return one_way, one_way


def allgather_bytes(batch, seq, kv_heads, head_dim, itemsize, world):
    """(forward, backward) bytes sent per rank by all-gather-KV attention over ``world`` ranks."""
    block = 2 * batch * (seq // world) * kv_heads * head_dim * itemsize     # this rank's K and V
    return (world - 1) * block, (world - 1) * block


def cp_bytes(method, batch, seq, heads, kv_heads, head_dim, dtype, ulysses=1, ring=1):
    """{"fwd": bytes, "bwd": bytes, "fwd_bwd": bytes} each rank sends for ``method`` in {ring, ulysses, usp,
    allgather} (allgather: W = ``ring``)."""
    e = dtype.itemsize
    acc = 8 if dtype == torch.float64 else 4
    if method == "ring":
        fwd, bwd = ring_bytes(batch, seq, heads, kv_heads, head_dim, e, ring, acc)
    elif method == "ulysses":
        fwd, bwd = ulysses_bytes(batch, seq, heads, kv_heads, head_dim, e, ulysses)
    elif method == "usp":
        uf, ub = ulysses_bytes(batch, seq // ring, heads, kv_heads, head_dim, e, ulysses)
        kv = kv_heads * kv_replication(heads, kv_heads, ulysses) // ulysses
        rf, rb = ring_bytes(batch, seq, heads // ulysses, kv, head_dim, e, ring, acc)
        fwd, bwd = uf + rf, ub + rb
    elif method == "allgather":
        fwd, bwd = allgather_bytes(batch, seq, kv_heads, head_dim, e, ring)
    else:
        raise ValueError(f"unknown CP method {method!r}")
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}


def main(argv=None):
    p = StudyParser(prog="python -m distlab.cp.cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--seq", type=positive_int, default=65536)
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--world", type=positive_int, default=8)
    p.add_argument("--dtype", type=dtype_arg(), default="bfloat16", help="bf16, fp16, fp32, ... (default bf16)")
    p.add_argument("--json", metavar="PATH", help="write the table as JSON")
    a = p.parse_args(argv)
    if a.heads % a.kv_heads:
        raise ValueError(f"--heads {a.heads} must be a multiple of --kv-heads {a.kv_heads}")
    rows = []
    for u in [d for d in range(1, a.world + 1) if a.world % d == 0]:
        r = a.world // u
        if a.heads % u or a.seq % (u * r):
            continue
        name = "ring" if u == 1 else "ulysses" if r == 1 else f"usp {u}x{r}"
        rows.append({"method": name, "ulysses": u, "ring": r,
                     **cp_bytes("usp", a.batch, a.seq, a.heads, a.kv_heads, a.head_dim, DTYPES[a.dtype], u, r)})
    if a.seq % a.world == 0:
        rows.append({"method": "allgather", "ulysses": 1, "ring": a.world,
                     **cp_bytes("allgather", a.batch, a.seq, a.heads, a.kv_heads, a.head_dim, DTYPES[a.dtype],
                                ring=a.world)})
    if not rows:
        raise ValueError(f"no CP split of W={a.world} fits seq {a.seq} and {a.heads} heads (the seq must divide "
                         f"by W, the heads by the Ulysses degree)")
    print(f"bytes sent per rank, batch {a.batch} · seq {a.seq} · heads {a.heads} (kv {a.kv_heads}) · "
          f"head_dim {a.head_dim} · {a.dtype} · W={a.world}")
    print(f"{'method':<14} {'fwd MB':>10} {'bwd MB':>10} {'fwd+bwd MB':>11}")
    for b in rows:
        print(f"{b['method']:<14} {b['fwd'] / 1e6:>10.2f} {b['bwd'] / 1e6:>10.2f} {b['fwd_bwd'] / 1e6:>11.2f}")
    if a.json:
        write_json(a.json, {"args": vars(a), "bytes_per_rank": rows})


if __name__ == "__main__":
    run_study(main)
