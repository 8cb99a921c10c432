"""What N data-parallel ranks cost and gain (llmc.distributed), from a model's Linear shapes alone: the bytes each
rank receives per decoder layer, the memory each rank holds, and a time model T(N) that `llmc plan --nproc N` and
benchmarks/distributed_scaling.py print.

Volumes follow the collectives llmc.distributed issues, per layer and per rank (bytes received from the others):
  - ranges (static activation, KV): one all-reduce max of every Linear's input channels: 4·Σ in (ring: 2(N-1)/N of it);
  - GPTQ Hessians: all-gather of each distinct input's in×in float32 Hessian, then a rank-order float64 sum:
    (N-1)·4·Σ in² (a 70B down_proj alone is 28672² floats: 3.3 GB from each other rank);
  - AWQ: the input means (8·Σ in per rank), one float per candidate loss, the Gram matrix of a lone Linear, and the
    at most `clip_tokens` rows the clip search samples;
  - the quantized layer: codes (1 byte a weight) + scales, broadcast from the rank that computed them.
Time: T(N) = layers · (F/N + Q_serial + V(N)/link) + S, where F is one layer's calibration forwards over every window
on one device, Q the layer's quantization solve (GPTQ true-sequential: on rank 0, so serial; RTN/spread groups:
divided by N), S what does not depend on N (reading and writing files, start-up).
"""

from __future__ import annotations

from dataclasses import dataclass

# Linears that read one input (one Hessian, one stack) in Llama-family layers.
SHARED_INPUT_SUFFIXES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


def layer_shapes(all_shapes: dict[str, tuple[int, int]], layer: int = 0) -> dict[str, tuple[int, int]]:
    """{layer-relative Linear name: (out, in)} of one decoder layer, from every Linear's shape by full name."""
    marker = f".layers.{layer}."
    return {name.split(marker, 1)[1]: shape for name, shape in all_shapes.items() if marker in name}


def input_groups(shapes: dict[str, tuple[int, int]]) -> list[list[str]]:
    """The Linears of a layer grouped by the input they read (q/k/v, gate/up; every other Linear alone)."""
    groups: dict[str, list[str]] = {}
    for name in sorted(shapes):
        parent, _, leaf = name.rpartition(".")
        key = name
        for members in SHARED_INPUT_SUFFIXES:
            if leaf in members:
                key = f"{parent}.{members[0]}"
        groups.setdefault(key, []).append(name)
    return list(groups.values())


@dataclass(frozen=True)
class Workload:
    """What one scheme's calibration asks per layer: ranges, Hessians, AWQ's search."""

    ranges: bool
    hessians: bool
    module_calls: bool  # AWQ's search: input means, candidate losses, Gram matrices
    solve_on_rank0: bool  # GPTQ true-sequential quantizes inside the forward, on rank 0
    clip_tokens: int = 512
    candidates: int = 20


def bytes_per_layer(shapes: dict[str, tuple[int, int]], nproc: int, work: Workload) -> dict[str, float]:
    """Bytes each rank receives from the other ranks per decoder layer, by collective."""
    if nproc <= 1:
        return {}
    others = nproc - 1
    groups = input_groups(shapes)
    width = {g[0]: shapes[g[0]][1] for g in groups}
    out: dict[str, float] = {}
    if work.ranges:
        out["ranges (all-reduce max)"] = 2 * others / nproc * 4 * sum(i for _, i in shapes.values())
    if work.hessians:
        out["Hessians (all-gather, fp32)"] = others * 4 * sum(w * w for w in width.values())
    if work.module_calls:
        out["search: input means, losses, Gram, clip rows"] = others * (
            8 * sum(width.values()) + 8 * work.candidates * len(groups)
            + 4 * sum(w * w for g, w in width.items() if g.endswith("o_proj"))  # a lone Linear's Gram matrix
        ) + 4 * work.clip_tokens * sum(i for _, i in shapes.values()) * others / nproc
    weights = sum(o * i for o, i in shapes.values())
    # codes (1 byte) + one float32 scale per 64 weights, from rank 0 (broadcast) or from each group's rank (spread)
    out["quantized weights"] = weights * (1 + 4 / 64) * (1 if work.solve_on_rank0 else others / nproc)
    return out


def deferred_bytes(shapes: dict[str, tuple[int, int]], tokens: float, expert_share: float, elem: int) -> float:
    """Bytes a rank after the first keeps per layer of a Mixture-of-Experts model's Hessian inputs until the ranks
    before it have accumulated theirs (llmc.distributed.chain_hessians): its `tokens` rows of each distinct input,
    an expert's inputs being the `expert_share` of them routed to it (top-k / experts)."""
    return sum(shapes[g[0]][1] * tokens * (expert_share if ".experts." in g[0] else 1.0) * elem
               for g in input_groups(shapes))


def moe_layer(all_shapes: dict[str, tuple[int, int]]) -> int:
    """The index of the first decoder layer holding routed experts (0 when none does): the layer a Mixture-of-Experts
    model's per-rank costs are figured on (DeepSeek's first layers are dense)."""
    layers = sorted({int(n.split(".layers.", 1)[1].split(".", 1)[0]) for n in all_shapes
                     if ".layers." in n and ".experts." in n})
    return layers[0] if layers else 0


def solve_flops(shapes: dict[str, tuple[int, int]], hessians: bool) -> float:
    """Floating-point operations of one layer's quantization: GPTQ's inverse Hessian (~in³ per input) and column
    loop (~2·out·in² per Linear); RTN ~10 per weight."""
    if not hessians:
        return 10.0 * sum(o * i for o, i in shapes.values())
    groups = input_groups(shapes)
    return float(sum(shapes[g[0]][1] ** 3 for g in groups) + sum(2 * o * i * i for o, i in shapes.values()))


def predict(layers: int, forward_s: float, solve_s: float, bytes_layer: float, nproc: int, link_bytes_per_s: float,
            serial_s: float = 0.0, solve_serial: bool = True) -> float:
    """T(N) in seconds: per layer F/N + Q (serial when one rank solves, else Q/N) + V/link, plus S."""
    solve = solve_s if solve_serial or nproc == 1 else solve_s / nproc
    comm = bytes_layer / link_bytes_per_s if nproc > 1 else 0.0
    return layers * (forward_s / nproc + solve + comm) + serial_s


def amdahl_fit(t1: float, tn: float, nproc: int) -> tuple[float, float]:
    """(parallel seconds P, serial seconds S) with t1 = P + S and tn = P/N + S: what a pair of timings implies."""
    parallel = (t1 - tn) * nproc / (nproc - 1)
    return parallel, t1 - parallel


# Link bandwidths the planner assumes (bytes/s a rank receives): NVLink-class GPUs in one node; gloo over loopback TCP.
LINK_BYTES_PER_S = {"cuda": 100e9, "cpu": 1e9}


def plan_estimate(layers: int, device: str, calibration_s: float, peak_memory_gb: float,
                  shapes: dict[str, tuple[int, int]], work: Workload, nproc: int, activations_gb: float,
                  flops_per_s: float, deferred_gb: float = 0.0) -> dict:
    """Per-rank memory and time, bytes per layer and predicted speed-up for `llmc plan` (see the module doc), from
    the one-process plan's `layers`, calibration `device`, `calibration_s` and `peak_memory_gb`: every rank holds the
    layer and 1/N of the calibration activations; calibration forwards divide by N. `deferred_gb`: what a rank
    after the first keeps of a Mixture-of-Experts layer's Hessian inputs (`deferred_bytes`)."""
    device = "cuda" if device.startswith("cuda") else "cpu"
    volume = bytes_per_layer(shapes, nproc, work)
    per_layer = sum(volume.values())
    solve_s = solve_flops(shapes, work.hessians) / flops_per_s
    forward_s = max(calibration_s / max(layers, 1) - solve_s, 0.0)
    t1 = predict(layers, forward_s, solve_s, 0.0, 1, 1.0)
    tn = predict(layers, forward_s, solve_s, per_layer, nproc, LINK_BYTES_PER_S[device],
                 solve_serial=work.solve_on_rank0)
    gather_gb = nproc * 4 * min(1 << 24, max((i * i for _, i in shapes.values()), default=0)) / 1e9 \
        if work.hessians else 0.0
    link = "NVLink-class" if device == "cuda" else "gloo, loopback TCP"
    return {"nproc": nproc,
            "memory_gb_per_rank": peak_memory_gb - activations_gb * (1 - 1 / nproc) + gather_gb + deferred_gb,
            "calibration_s_per_rank": tn, "bytes_per_layer": volume, "speedup": t1 / tn if tn else 1.0,
            "link": f"{LINK_BYTES_PER_S[device] / 1e9:.0f} GB/s assumed ({link})"}


def render(estimate: dict) -> list[str]:
    if "note" in estimate:
        return [f"  distributed: {estimate['nproc']} ranks: {estimate['note']}"]
    volume = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in estimate["bytes_per_layer"].items())
    return [(f"  distributed: {estimate['nproc']} ranks: ~{estimate['memory_gb_per_rank']:.2f} GB and "
             f"~{estimate['calibration_s_per_rank']:.0f} s calibration per rank, predicted speed-up "
             f"{estimate['speedup']:.2f}x; per layer each rank receives {volume} (link {estimate['link']})")]
