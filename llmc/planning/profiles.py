"""Named machines people plan builds for (`llmc plan --machine h100-sxm:8`): one GPU node each, from the GPU's
published spec sheet. These are ESTIMATES, not measurements: a plan made with one says so. For a plan from
measured rates, run `llmc probe --out FILE` on the machine itself and pass that file instead.

Per GPU, from the vendor's data sheet (dense figures, no sparsity): memory, memory bandwidth, BF16/FP16, FP8 and
FP32 (non-tensor) TFLOPS. What llmc's work reaches of them is the stated efficiency, not measured on these GPUs:
GEMM_EFFICIENCY of the peak for a large GEMM (the plan's forward then applies its own GPU share,
llmc.planning.machine.forward_efficiency), and the quantizer's elementwise passes at the memory bandwidth over
QUANTIZE_BYTES_PER_ELEMENT (float32 temporaries read and written several times; FAKE_QUANTIZE_... the same for the
activations' fake quantization). The host (CPU cores, memory, disk, sha256) is what a typical node of that GPU
carries (DGX/HGX-class for the SXM parts), an assumption stated here and in the plan's line.
"""

from __future__ import annotations

from dataclasses import dataclass

GEMM_EFFICIENCY = 0.7  # share of the spec sheet's dense peak a large GEMM reaches (stated, not measured here)
QUANTIZE_BYTES_PER_ELEMENT = 32.0  # memory traffic per weight element of quantize_weight (float32 passes)
FAKE_QUANTIZE_BYTES_PER_ELEMENT = 16.0  # per activation element of fake_quantize
# per logit element scored (llmc.engines.agreement.score_logits): a baseline's logsumexp, top-k and gathers read the
# float32 logits a few times; an artifact's exact KL adds two log-softmaxes, an exp and a float64 sum (stated)
SCORE_BYTES_PER_ELEMENT = {False: 16.0, True: 48.0}


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model's spec-sheet numbers and the host a node of it typically has (per GPU)."""

    gpu: str  # the name torch reports for it
    memory_gb: float  # per GPU, GB (1e9 bytes)
    bandwidth_tbs: float  # memory bandwidth, TB/s
    bf16_tflops: float  # dense BF16 / FP16 tensor-core TFLOPS
    fp8_tflops: float | None  # dense FP8 TFLOPS (None: no FP8 tensor cores)
    fp32_tflops: float  # FP32, not TF32 (torch's default float32 matmul)
    source: str  # where the numbers are from
    host_memory_gb_per_gpu: float = 256.0  # DGX H100: 2 TB for 8 GPUs
    host_cpus_per_gpu: int = 14  # DGX H100: 112 cores for 8 GPUs
    disk_write_gbs: float = 2.0  # a node's local NVMe, sequential write + fsync (assumed)
    disk_read_gbs: float = 5.0  # sequential read (assumed)
    host_sha256_gbs: float = 1.5  # one core's hashlib sha256 (as measured quiet on the development VM)
    # a mapped file the page cache holds, copied out (assumed: 8.8 GB/s measured quiet on the 2-core AMD EPYC
    # development VM, 2026-12-03; a node's host is assumed no faster)
    host_page_cache_gbs: float = 8.0
    # a quantized original's codes decoded to float32 on the host, elements/s (assumed: the development VM's decoders
    # ran at 10-49 M/s on 2 cores, llmc.model.source_formats.decode_rate; a node's host cores are assumed no faster)
    host_decode_elements_s: float = 2e7


PROFILES: dict[str, GpuProfile] = {
    "h100-sxm": GpuProfile("NVIDIA H100 80GB HBM3", 80, 3.35, 989, 1979, 67,
                           "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    "h100-pcie": GpuProfile("NVIDIA H100 PCIe", 80, 2.0, 756, 1513, 51,
                            "NVIDIA H100 Tensor Core GPU datasheet (PCIe)", host_memory_gb_per_gpu=128,
                            host_cpus_per_gpu=8),
    "h200": GpuProfile("NVIDIA H200", 141, 4.8, 989, 1979, 67, "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    "b200": GpuProfile("NVIDIA B200", 180, 8.0, 2250, 4500, 75, "NVIDIA HGX B200 datasheet (per GPU)",
                       host_memory_gb_per_gpu=512),
    "a100-80gb": GpuProfile("NVIDIA A100-SXM4-80GB", 80, 2.039, 312, None, 19.5,
                            "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)", host_cpus_per_gpu=16),
    "l40s": GpuProfile("NVIDIA L40S", 48, 0.864, 362, 733, 91.6, "NVIDIA L40S datasheet",
                       host_memory_gb_per_gpu=128, host_cpus_per_gpu=8),
}


def rates(p: GpuProfile) -> dict[str, float]:
    """The profile's rates by rate class (llmc.planning.target.rate_class): GPU GEMMs per dtype, the quantizer's
    elementwise passes, the host's hashing and disk."""
    gemm = {"bfloat16": p.bf16_tflops, "float16": p.bf16_tflops, "float32": p.fp32_tflops}
    if p.fp8_tflops:
        gemm["float8_e4m3fn"] = p.fp8_tflops
    out = {f"matmul {dtype} cuda": tflops * 1e12 * GEMM_EFFICIENCY for dtype, tflops in gemm.items()}
    out["quantize cuda"] = p.bandwidth_tbs * 1e12 / QUANTIZE_BYTES_PER_ELEMENT
    out["fake_quantize cuda"] = p.bandwidth_tbs * 1e12 / FAKE_QUANTIZE_BYTES_PER_ELEMENT
    for reference, per_element in SCORE_BYTES_PER_ELEMENT.items():
        out[f"score_logits reference={reference} cuda"] = p.bandwidth_tbs * 1e12 / per_element
    out["sha256"] = p.host_sha256_gbs * 1e9
    out["write+sha256"] = 1 / (1 / (p.disk_write_gbs * 1e9) + 1 / (p.host_sha256_gbs * 1e9))
    out["disk write+fsync"] = p.disk_write_gbs * 1e9
    out["disk read uncached"] = p.disk_read_gbs * 1e9
    out["page cache read"] = p.host_page_cache_gbs * 1e9
    out["source decode"] = p.host_decode_elements_s
    return out
