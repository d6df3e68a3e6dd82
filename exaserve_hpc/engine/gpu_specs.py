"""Where the timing engine's constants come from: datasheet figures, a model shape, efficiencies.

No GPU was measured for this project, so each kind's `GpuTimings` is a
roofline: the vendor's peak dense fp16/bf16 tensor FLOP/s and HBM bandwidth,
times the fraction real serving engines reach, for one model shape.

Sources (peak figures are dense, i.e. half of the "with sparsity" numbers
the datasheets print first):
- H100 SXM5 80 GB: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3 (NVIDIA H100 Tensor
  Core GPU datasheet; 1,979 TFLOP/s "with sparsity").
- H200 SXM 141 GB: same Hopper die, 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e
  (NVIDIA H200 product page / datasheet: "1.4x the bandwidth of H100").
- GH200 96 GB: H100 compute, 4.0 TB/s HBM3 (NVIDIA GH200 Grace Hopper datasheet).
- A100 SXM 80 GB: 312 TFLOP/s bf16 dense, 2.039 TB/s HBM2e (NVIDIA A100 datasheet).
- MI250X, one GCD: 191.5 TFLOP/s fp16 (383 per package), 1.6 TB/s (3.2 per
  package) (AMD Instinct MI250X data sheet).

Efficiencies (assumptions, stated so they can be replaced by measurements):
- prefill GEMMs at 55% of peak (model FLOP utilisation of large-token-count
  bf16 GEMMs in vLLM and TensorRT-LLM prefill);
- prefill attention at 40% of peak (FlashAttention-2 forward reaches 35-50%
  of H100 peak with a causal mask; FlashAttention-3, Shah et al. 2024,
  reports up to 75% in fp16, not what paged, variable-length serving kernels get);
- HBM reads at 80% of the datasheet bandwidth (weights once per step, K/V per decode);
- 0.5 ms a step of launch and scheduler overhead (CUDA graphs on).

Check against a published serving figure (Llama-3.1-8B, bf16, one H100):
decode at batch 256 with ~600 tokens of context gives 6.5 ms (weights) +
7.5 ms (per-sequence GEMMs, additive: no overlap credited) + 7.5 ms (K/V)
= 21.5 ms a step, 11.9k output tokens/s, against ~12.5k tok/s published for
vLLM with FlashInfer on one H100 (morphllm.com "vLLM benchmarks", citing
third-party runs); batch-1 decode is the weight read, 6.5 ms a token.
Prefill of an 8k-token prompt: 0.24 s of GEMMs + 0.04 s of attention; of a
32k one 0.95 s + 0.69 s (attention's quadratic term at its real order).
`tests/engine/test_timing_engine.py` pins these figures.

Model shape: Llama-3-8B (32 layers, 32 query heads and 8 K/V heads of 128,
8.03e9 parameters, bf16): 2 x params FLOP per token, 4 x layers x heads x
head_dim FLOP per causal (query, key) pair (QK^T and PV, 2 FLOP a
multiply-add), 2 x layers x kv_heads x head_dim x 2 bytes = 128 KiB of K/V
per token. Llama-3-70B (80 layers, 64 heads, 8 K/V heads) is given for a
TP=8 replica by dividing compute and bandwidth among 8 GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    dense_fp16_flops: float     # FLOP/s, tensor cores, no sparsity
    hbm_bytes_per_s: float
    memory_gb: float
    source: str
    dense_fp8_flops: float = 0.0   # FLOP/s; 0: no FP8 tensor cores (A100: FP8 runs as FP16)
    nvlink_bytes_per_s: float = 0.0  # one direction, per GPU (half the datasheet's bidirectional total)


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int = 4096  # the residual stream: what a tensor-parallel all-reduce carries per token

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.params

    @property
    def flops_per_pair(self) -> float:
        return 4.0 * self.layers * self.heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params


GPU_SPECS: dict[str, GpuSpec] = {
    # FP8 dense: 1,979 TFLOP/s on Hopper (3,958 "with sparsity"); NVLink 4: 900 GB/s a GPU, both directions
    "h100-sxm": GpuSpec(989e12, 3.35e12, 80, "NVIDIA H100 datasheet (SXM5)", 1979e12, 450e9),
    "h200": GpuSpec(989e12, 4.8e12, 141, "NVIDIA H200 datasheet (SXM)", 1979e12, 450e9),
    "gh200": GpuSpec(989e12, 4.0e12, 96, "NVIDIA GH200 datasheet (96 GB HBM3)", 1979e12, 450e9),
    # NVLink 3: 600 GB/s a GPU, both directions; no FP8 tensor cores
    "a100-80gb": GpuSpec(312e12, 2.039e12, 80, "NVIDIA A100 datasheet (SXM 80 GB)", 0.0, 300e9),
    "mi250x-gcd": GpuSpec(191.5e12, 1.6e12, 64, "AMD MI250X data sheet, one of two GCDs"),
}

LLAMA3_8B = ModelShape("Llama-3-8B", 8.03e9, layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096)
LLAMA3_70B = ModelShape("Llama-3-70B", 70.6e9, layers=80, heads=64, kv_heads=8, head_dim=128, hidden=8192)
# Llama 3.1 405B: 126 layers, 128 query heads, 8 K/V heads of 128, hidden 16,384 (its config.json)
LLAMA31_405B = ModelShape("Llama-3.1-405B", 405.8e9, layers=126, heads=128, kv_heads=8, head_dim=128, hidden=16384)
# Mistral 7B v0.3: 32 layers, 32 query heads and 8 K/V heads of 128, hidden 4,096, 7.25e9 parameters
MISTRAL_7B = ModelShape("Mistral-7B", 7.25e9, layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096)
MODEL_SHAPES = {m.name: m for m in (LLAMA3_8B, LLAMA3_70B, LLAMA31_405B, MISTRAL_7B)}
ARCHITECTURES = {"llama-3-8b": LLAMA3_8B, "llama-3-70b": LLAMA3_70B, "llama-3.1-405b": LLAMA31_405B,
                 "mistral-7b": MISTRAL_7B}  # models[].architecture

GEMM_EFFICIENCY = 0.55
ATTENTION_EFFICIENCY = 0.40
BANDWIDTH_EFFICIENCY = 0.80
STEP_LAUNCH_S = 0.5e-3


# Tensor parallelism adds two all-reduces of the residual stream per layer (after attention and after the
# MLP; Megatron-LM's split, Shoeybi et al. 2019, which TensorRT-LLM and vLLM use). A ring all-reduce moves
# 2 (tp - 1) / tp of the message over each GPU's NVLink; small messages are latency bound.
ALLREDUCE_BANDWIDTH_EFFICIENCY = 0.70  # nccl-tests all_reduce bus bandwidth reaches ~70-80% of NVLink's
ALLREDUCE_LATENCY_S = 8e-6  # one small all-reduce (assumption: NCCL's ring on one NVLink node is ~10-20 us;
#                             TensorRT-LLM's one-shot custom all-reduce kernel a few us)


def roofline(gpu: GpuSpec, model: ModelShape = LLAMA3_8B, gpus: int = 1) -> dict[str, float]:
    """The timing constants (GpuTimings' fields) of ``model`` in bf16 on ``gpus`` GPUs of kind ``gpu``
    (tensor parallel, without its communication: replica_roofline counts that)."""
    flops, bandwidth = gpu.dense_fp16_flops * gpus, gpu.hbm_bytes_per_s * gpus * BANDWIDTH_EFFICIENCY
    per_token = model.flops_per_token / (flops * GEMM_EFFICIENCY)
    return dict(step_overhead_s=STEP_LAUNCH_S + model.weight_bytes / bandwidth,
                prefill_per_token_s=per_token,
                decode_per_seq_s=per_token,  # a decode is one token through the same GEMMs
                kv_read_per_token_s=model.kv_bytes_per_token / bandwidth,
                prefill_per_pair_s=model.flops_per_pair / (flops * ATTENTION_EFFICIENCY),
                kv_bytes_per_token=model.kv_bytes_per_token)


def replica_roofline(gpu: GpuSpec, model: ModelShape, tp: int = 1, pp: int = 1, weights: str = "bf16",
                     kv_cache: str = "bf16") -> dict[str, float]:
    """GpuTimings' fields for one replica of ``model`` split tp x pp over GPUs of kind ``gpu``.

    - GEMMs: 2 x params FLOP a token, at the FP8 peak with FP8 weights (where the GPU has FP8 tensor
      cores; W8A8, as TensorRT-LLM's FP8 checkpoints run), else the FP16 one, divided among the tp GPUs.
    - Attention: 4 x layers x query heads x head_dim FLOP a causal (query, key) pair, divided among tp (each
      GPU holds heads / tp); the K/V dtype changes the bytes read, not the arithmetic.
    - HBM: the weights once a step and each decode's K/V, in their dtypes, over tp GPUs' bandwidth.
    - Tensor parallel: two all-reduces of hidden x 2 bytes a token per layer, 2 (tp - 1) / tp of it over each
      GPU's NVLink, plus a latency per all-reduce per step.
    - Pipeline parallel: stages run in series, so a step's latency is the whole model's on one stage's tp
      GPUs plus a hop per stage boundary; the pp stages add memory, not speed. Micro-batching (pp batches
      in flight, as TensorRT-LLM and vLLM do) is not modelled: a PP replica's throughput is understated by
      up to pp times, its latency is not.
    """
    fp8_weights = weights == "fp8" and gpu.dense_fp8_flops > 0
    flops = (gpu.dense_fp8_flops if fp8_weights else gpu.dense_fp16_flops) * tp
    attention_flops = gpu.dense_fp16_flops * tp
    bandwidth = gpu.hbm_bytes_per_s * tp * BANDWIDTH_EFFICIENCY
    weight_bytes = model.params * (1 if weights in ("fp8", "int8") else 0.5 if weights == "int4" else 2)
    kv_bytes = model.kv_bytes_per_token // (2 if kv_cache == "fp8" else 1)
    per_token = model.flops_per_token / (flops * GEMM_EFFICIENCY)
    if tp > 1 and gpu.nvlink_bytes_per_s:
        moved = 2 * model.layers * model.hidden * 2 * 2 * (tp - 1) / tp
        per_token += moved / (gpu.nvlink_bytes_per_s * ALLREDUCE_BANDWIDTH_EFFICIENCY)
    latency = STEP_LAUNCH_S + (2 * model.layers * ALLREDUCE_LATENCY_S if tp > 1 else 0.0) \
        + (pp - 1) * STAGE_HOP_S
    return dict(step_overhead_s=latency + weight_bytes / bandwidth, prefill_per_token_s=per_token,
                decode_per_seq_s=per_token, kv_read_per_token_s=kv_bytes / bandwidth,
                prefill_per_pair_s=model.flops_per_pair / (attention_flops * ATTENTION_EFFICIENCY),
                kv_bytes_per_token=kv_bytes)


STAGE_HOP_S = 20e-6  # activations from one pipeline stage to the next (NVLink or InfiniBand send/recv)
