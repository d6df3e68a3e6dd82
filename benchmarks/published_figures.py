"""Published serving throughput that the timing model is checked against (benchmarks/calibrate_timing.py
--published).

Source: NVIDIA TensorRT-LLM, docs/source/performance/perf-overview.md, the tables of release 0.17 ("All data
in the table below was generated using version 0.17 and presents token throughput in tokens/second") and of
release 0.14 for H100 in FP16. `trtllm-bench throughput`: offline, every request queued at once, fixed input
and output lengths (ISL/OSL), pipeline parallel 1; the figure is output tokens per second of the whole
tensor-parallel group. FP8 rows run FP8 weights and an FP8 KV cache; A100 rows FP16 (no FP8 tensor cores).

Llama 3.1 405B on H100 (FP8, TP8), which releases 0.14-0.17 do not measure, comes from the same file of release
0.19 (https://nvidia.github.io/TensorRT-LLM/0.19.0/performance/perf-overview.html, table "Llama 3.1 405B FP8",
column "H100 80GB HBM3", TP Size 8; checkpoint nvidia/Llama-3.1-405B-Instruct-FP8): the same `trtllm-bench
throughput` offline method and ISL/OSL grid, but run on the PyTorch backend ("Starting with v0.19") and mostly
with --kv_cache_free_gpu_mem_fraction 0.95. The file's later tables (v0.20, v0.21 and v1.0 data) repeat the
column within ~12%. No table of releases 0.14-1.0 measures 405B on A100 (FP16 weights, 811 GB, exceed eight
80 GB GPUs; Ampere has no FP8 GEMMs).

Left out, as the page's own numbers show they are bound by something the model does not claim to capture:
70B at TP1 and TP2 on 80 GB GPUs (the weights leave almost no KV cache: e.g. A100 TP2 2048/2048 at 261
tokens/s against 1,394 at TP4), and the 20000/2000 rows (beyond the 8,192-token step budget's regime).
"""

from __future__ import annotations

from typing import NamedTuple


class Published(NamedTuple):
    model: str      # engine/gpu_specs.MODEL_SHAPES key
    gpu: str        # engine/gpu_specs.GPU_SPECS key
    precision: str  # "fp8" (weights and KV cache) or "fp16"
    tp: int
    isl: int
    osl: int
    tokens_per_s: float  # output tokens/s of the tensor-parallel group
    source: str


V017 = "TensorRT-LLM 0.17 perf-overview.md"
V014 = "TensorRT-LLM 0.14 perf-overview.md"
V019 = "TensorRT-LLM 0.19 perf-overview.md"
L8, L70, L405 = "Llama-3-8B", "Llama-3-70B", "Llama-3.1-405B"

_ROWS = [  # (model, tp, isl, osl, H200 FP8, H100 FP8, A100 FP16), release 0.17
    (L8, 1, 128, 128, 29526.04, 28836.77, 6627.27),
    (L8, 1, 128, 2048, 25398.86, 21109.38, 5255.99),
    (L8, 1, 128, 4096, 17370.8, 13593.65, 3453.79),
    (L8, 1, 500, 2000, 21020.81, 16500.69, 4276.58),
    (L8, 1, 1000, 1000, 17537.96, 15244.78, 3786.83),
    (L8, 1, 2048, 128, 3794.14, 3556.73, 799.61),
    (L8, 1, 2048, 2048, 11968.5, 9488.42, 2424.16),
    (L8, 1, 5000, 500, 3987.79, 3559.36, 825.13),
    (L70, 4, 128, 128, 11098.63, 11127.53, 2733.48),
    (L70, 4, 128, 2048, 14156, 11511.93, 2811.27),
    (L70, 4, 128, 4096, 10574.06, 7439.41, 1976.49),
    (L70, 4, 1000, 1000, 8911.29, 7430.99, 1921.77),
    (L70, 4, 2048, 128, 1358.06, 1302.6, 325.15),
    (L70, 4, 2048, 2048, 7130.44, 5480.03, 1393.64),
    (L70, 4, 5000, 500, 1811.55, 1602.78, 392.62),
    (L70, 8, 128, 128, 15355.84, 14730.69, 4717.62),
    (L70, 8, 128, 2048, 21195.88, 17061.82, 5241.5),
    (L70, 8, 128, 4096, 16941.52, 14171.43, 3724.67),
    (L70, 8, 500, 2000, 17278.4, 14679.33, 4445.37),
    (L70, 8, 1000, 1000, 13181.24, 11451.16, 3320.41),
    (L70, 8, 2048, 128, 1983.03, 1923.41, 542.38),
    (L70, 8, 2048, 2048, 11142.47, 8801.95, 2553.71),
    (L70, 8, 5000, 500, 2717.83, 2457.42, 696.34),
]
_405B_H200 = [  # release 0.17, TP8, H200 FP8 only (the page has no H100 or A100 row for 405B)
    (128, 128, 3874.19), (128, 2048, 5938.09), (128, 4096, 5168.37), (500, 2000, 5084.29), (1000, 1000, 3399.69),
    (2048, 128, 463.42), (2048, 2048, 2940.62), (5000, 500, 669.13),
]
_405B_H100 = [  # release 0.19, TP8, H100 FP8 ("Llama 3.1 405B FP8" table; its 20000/2000 row left out as above)
    (128, 128, 3732.40), (128, 2048, 4572.23), (128, 4096, 2911.42), (500, 2000, 3661.85), (1000, 1000, 2963.36),
    (1000, 2000, 3253.17), (1024, 2048, 3089.16), (2048, 128, 448.89), (2048, 2048, 2139.94), (5000, 500, 579.14),
]
_H100_FP16 = [  # release 0.14, H100 80GB FP16
    (L8, 1, 128, 128, 15571.6549), (L8, 1, 128, 2048, 9150.7477), (L8, 1, 2048, 128, 1904.3259),
    (L8, 1, 2048, 2048, 4159.6857), (L8, 1, 5000, 500, 1708.0353),
    (L70, 4, 128, 128, 5846.8413), (L70, 4, 2048, 128, 688.0344), (L70, 4, 2048, 2048, 2393.1359),
    (L70, 8, 128, 2048, 7605.5295), (L70, 8, 2048, 128, 1316.3086), (L70, 8, 2048, 2048, 4023.6978),
]

PUBLISHED: list[Published] = (
    [Published(m, "h200", "fp8", tp, i, o, h200, V017) for m, tp, i, o, h200, _, _ in _ROWS]
    + [Published(m, "h100-sxm", "fp8", tp, i, o, h100, V017) for m, tp, i, o, _, h100, _ in _ROWS]
    + [Published(m, "a100-80gb", "fp16", tp, i, o, a100, V017) for m, tp, i, o, _, _, a100 in _ROWS]
    + [Published(L405, "h200", "fp8", 8, i, o, t, V017) for i, o, t in _405B_H200]
    + [Published(m, "h100-sxm", "fp16", tp, i, o, t, V014) for m, tp, i, o, t in _H100_FP16]
    + [Published(L405, "h100-sxm", "fp8", 8, i, o, t, V019) for i, o, t in _405B_H100]
)
