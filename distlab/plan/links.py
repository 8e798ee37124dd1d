"""Links and clusters: each link's latency and bus bandwidth with its source, and what a collective costs.

    python -m distlab.plan --links          # the table below

A collective of ``size`` bytes over ``n`` ranks on a link takes ``α + size · factor(op, n) / busbw``: the
nccl-tests model, with the same busbw factors the playground prints (``distlab.comm.bus_factor``: all_reduce
2(n−1)/n; all_gather, reduce_scatter, all_to_all (n−1)/n; sendrecv 1). ``size`` is nccl-tests' size: the
all-reduce buffer, the gathered output, the reduce-scatter input, the all-to-all input, the message.

A group whose ranks sit on one node uses the intra-node link; a group that spans nodes is bound by the
inter-node link (a ring's step waits for its slowest hop, an all-to-all for its slowest pair).
Ranks are placed like ``Layout.build_mesh``: tp innermost, then ulysses, ring, dp_shard, dp_replicate.
"""

from __future__ import annotations

import dataclasses
import json

from distlab.comm import bus_factor


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    alpha_us: float          # per-call latency
    busbw_gbs: float         # large-message bus bandwidth, GB/s (1e9)
    source: str
    overlaps_compute: bool = True   # False where the copies share the cores the compute runs on (gloo on CPU)
    per_op: dict = dataclasses.field(default_factory=dict, compare=False)   # op -> (α µs, busbw), measured links

    def time(self, op: str, size_bytes: float, n: int, calls: int = 1) -> float:
        """Seconds for ``calls`` collectives ``op`` moving ``size_bytes`` in all over ``n`` ranks."""
        if n <= 1 or size_bytes <= 0:
            return 0.0
        alpha_us, busbw = self.per_op.get(op, (self.alpha_us, self.busbw_gbs))
        return calls * alpha_us * 1e-6 + size_bytes * bus_factor(op, n) / (busbw * 1e9)


LINKS = {
    "nvlink4": Link("nvlink4", 20.0, 370.0,
                    "NVLink 4 / NVSwitch, 8xH100/H200 SXM: nccl-tests all_reduce busbw ~370 GB/s at >= 1 GiB "
                    "(NVIDIA's published nccl-tests results; 450 GB/s per direction line rate); α: nccl-tests' "
                    "small-message all_reduce time on 8 GPUs, ~20 us"),
    "nvlink-h800": Link("nvlink-h800", 20.0, 160.0,
                        "H800 SXM: NVLink cut to 400 GB/s bidirectional (200 per direction); busbw taken as 80% "
                        "of the per-direction rate, as NVLink 4 reaches 370 of 450 (assumed, not measured)"),
    "ib-ndr400": Link("ib-ndr400", 30.0, 45.0,
                      "InfiniBand NDR, 400 Gb/s = 50 GB/s per GPU (one HCA per GPU, as on DGX H100/H200 and "
                      "torchtitan's Grand Teton hosts); busbw taken as 90% of line rate, α 30 us (assumed)"),
    "roce-400": Link("roce-400", 35.0, 42.0,
                     "RoCE 400 Gb/s per GPU: as NDR with a little more latency and loss (assumed)"),
    "pcie4": Link("pcie4", 15.0, 22.0,
                  "PCIe 4.0 x16 between GPUs without NVLink: 32 GB/s per direction line rate, NCCL reaches "
                  "~70% of it through the host bridge (assumed)"),
    "pcie5": Link("pcie5", 15.0, 44.0, "PCIe 5.0 x16: 64 GB/s per direction line rate, ~70% (assumed)"),
}


def load_links(path: str | None) -> dict[str, Link]:
    """The built-in links plus a user's table: ``{"name": {"alpha_us": .., "busbw_gbs": .., "source": ..}}``."""
    links = dict(LINKS)
    if path is None:
        return links
    with open(path) as f:
        table = json.load(f)
    for name, row in table.items():
        missing = {"alpha_us", "busbw_gbs"} - set(row)
        if missing:
            raise ValueError(f"link {name!r} in {path}: missing {', '.join(sorted(missing))}")
        if row["busbw_gbs"] <= 0 or row["alpha_us"] < 0:
            raise ValueError(f"link {name!r} in {path}: busbw_gbs must be > 0 and alpha_us >= 0")
        links[name] = Link(name, float(row["alpha_us"]), float(row["busbw_gbs"]), row.get("source", path),
                           bool(row.get("overlaps_compute", True)))
    return links


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``nodes`` × ``gpus_per_node`` GPUs; ``intra`` links the GPUs of a node, ``inter`` the nodes."""

    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link
    cores_per_gpu: float | None = None   # CPU planning: cores each rank gets (None: a GPU each)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def group_link(self, stride: int, size: int) -> Link:
        """The link binding a group of ``size`` ranks ``stride`` apart (rank r, r+stride, ...)."""
        if size <= 1:
            return self.intra
        span = stride * (size - 1) + 1
        return self.intra if span <= self.gpus_per_node and self.gpus_per_node % (stride * size) == 0 else self.inter


def parse_cluster(spec: str, intra: str, inter: str, links: dict[str, Link]) -> Cluster:
    """``"2x8"`` (nodes × GPUs per node) or ``"8"`` (one node) with link names from ``links``."""
    for name in (intra, inter):
        if name not in links:
            raise ValueError(f"unknown link {name!r}; known: {', '.join(sorted(links))} (or give --link-table FILE)")
    nodes, _, per = spec.partition("x") if "x" in spec else ("1", "", spec)
    try:
        nodes, per = int(nodes), int(per)
    except ValueError:
        raise ValueError(f"--cluster {spec!r}: write NODESxGPUS, e.g. 2x8, or GPUS for one node") from None
    if nodes < 1 or per < 1:
        raise ValueError(f"--cluster {spec!r}: nodes and GPUs per node must be positive")
    return Cluster(nodes, per, links[intra], links[inter])
