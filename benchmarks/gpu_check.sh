#!/usr/bin/env bash
# The TensorRT-LLM engine on a real GPU, end to end, in under 10 minutes:
#   bash benchmarks/gpu_check.sh [WORK_DIR]
#
# On a machine with an NVIDIA GPU (nvidia-smi works) and a Python package index: installs tensorrt-llm and
# exaserve into a virtual environment under WORK_DIR, makes a tiny random Llama checkpoint in Hugging Face
# layout (`exaserve model create-tiny`), serves it with `exaserve serve` and the trtllm engine (router in
# precise prefix mode), and checks with the openai client: a chat completion, a streamed one, an abort (a
# stream closed early, then the server still serves); NVML telemetry in /metrics; the replica's
# CUDA_VISIBLE_DEVICES (and no PMIx/MPI variables); the replica's KV events reaching the router (prefix
# hits). Prints TTFT, tokens/s and the prefix hit rate; the last line is "gpu check: passed" or
# "gpu check: FAILED: <why>" (exit 1). Without a GPU it prints "no GPU: not run" and exits 0 at once.
#
# Environment: PYTHON (default python3, 3.10 or 3.12 for tensorrt-llm's wheels), TRTLLM_SPEC (default
# "tensorrt-llm>=1.2,<1.3"), TRTLLM_PIP_ARGS (extra pip arguments, e.g. an extra index that serves the
# tensorrt-llm wheels: the package on PyPI itself is a placeholder that fetches the real wheel from
# NVIDIA's own index at install time), GPU_CHECK_BUDGET (seconds, default 600).
set -uo pipefail

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "no GPU: not run"
    exit 0
fi

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-$(mktemp -d "${TMPDIR:-/tmp}/exaserve-gpu-check.XXXXXX")}"
mkdir -p "$WORK"
PYTHON="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-600}"
SPEC="${TRTLLM_SPEC:-tensorrt-llm>=1.2,<1.3}"
START=$SECONDS
SERVE_PID=""

fail() {
    echo "gpu check: FAILED: $*"
    [ -n "$SERVE_PID" ] && kill -TERM "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID" 2>/dev/null
    exit 1
}
left() { echo $((BUDGET - (SECONDS - START))); }

echo "== GPU"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
GPU_MEM_MIB="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | tr -d ' ')"

echo "== install (tensorrt-llm: $SPEC) into $WORK/venv"
[ -x "$WORK/venv/bin/python" ] || "$PYTHON" -m venv "$WORK/venv" || fail "cannot make a virtual environment with $PYTHON"
PY="$WORK/venv/bin/python"
timeout "$(left)" "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1
# shellcheck disable=SC2086
if ! timeout "$(left)" "$PY" -m pip install -q ${TRTLLM_PIP_ARGS:-} "$SPEC" openai httpx >"$WORK/pip-trtllm.log" 2>&1; then
    tail -25 "$WORK/pip-trtllm.log"
    fail "tensorrt-llm did not install (log: $WORK/pip-trtllm.log); the PyPI package is a placeholder that" \
         "downloads the real wheel from NVIDIA's index: make that index reachable, or give it in TRTLLM_PIP_ARGS"
fi
timeout "$(left)" "$PY" -m pip install -q -e "$ROOT" >"$WORK/pip-exaserve.log" 2>&1 || fail "exaserve did not install ($WORK/pip-exaserve.log)"
"$PY" -c "import tensorrt_llm, sys; print('tensorrt_llm', tensorrt_llm.__version__)" 2>"$WORK/import.log" \
    || { tail -5 "$WORK/import.log"; fail "tensorrt_llm does not import"; }
echo "   installed in $((SECONDS - START)) s"

echo "== tiny Llama checkpoint (Hugging Face layout)"
MODELS="$WORK/models"
rm -rf "$MODELS/tiny-llama"
# head_dim 64 (hidden 256 / 4 heads): a size TensorRT-LLM's attention kernels take
"$WORK/venv/bin/exaserve" model create-tiny "$MODELS/tiny-llama" --layers 2 --hidden 256 --heads 4 --kv-heads 2 \
    --intermediate 512 --max-position 2048 || fail "create-tiny failed"
ls "$MODELS/tiny-llama"

cat >"$WORK/site.yaml" <<EOF
site: gpu-check
cluster: {name: gpu-check, nodes: 1, nodelist: localhost, gpus_per_node: 1, gpu_memory: ${GPU_MEM_MIB}MiB}
scheduler: {min_replicas_per_model: 1, tick_interval: 1s}
heartbeat: {interval: 1s, misses: 5}
weight_cache: {l2_capacity: 1GiB, l3_path: $MODELS}
router: {policy: prefix_affinity, prefix_mode: precise, block_size: 32, first_token_timeout: 120s}
gateway: {host: 127.0.0.1, port: 0}
run_dir: $WORK/run
models:
  - model_name: tiny-llama
    engine: trtllm
    model_path: $MODELS/tiny-llama
    replicas: 1
    min_replicas: 1
    max_seq_len: 1024
    gpu_memory_utilization: 0.3
EOF
"$WORK/venv/bin/exaserve" config check "$WORK/site.yaml" || fail "config check refused the site"

echo "== exaserve serve (trtllm)"
"$WORK/venv/bin/exaserve" serve --site "$WORK/site.yaml" --port 0 >"$WORK/serve.log" 2>&1 &
SERVE_PID=$!
URL=""
while [ -z "$URL" ]; do
    [ "$(left)" -gt 0 ] || fail "exaserve serve printed no URL in time (log: $WORK/serve.log)"
    kill -0 "$SERVE_PID" 2>/dev/null || { tail -30 "$WORK/serve.log"; fail "exaserve serve exited"; }
    URL="$(grep -oE 'serving .* at http://[^ ]+/v1' "$WORK/serve.log" | head -1 | sed -E 's#.* at (http://[^ ]+)/v1#\1#')"
    sleep 1
done
echo "   $URL"

cat >"$WORK/check.py" <<'EOF'
"""The checks against the running server; prints one line per check and the measurements."""
import json, os, sys, time, urllib.request

import openai

url, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def get(path):
    with urllib.request.urlopen(f"{url}{path}", timeout=30) as r:
        return r.read().decode()


def replicas(status):
    found = []
    def walk(x):
        if isinstance(x, dict):
            if "pid" in x and "devices" in x and x.get("pid"):
                found.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(status)
    return found


while True:  # TensorRT-LLM loads, profiles memory and warms up: minutes on a first start
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            if r.status == 200:
                break
    except Exception:
        pass
    if time.monotonic() > deadline:
        sys.exit("no replica became ready in time")
    time.sleep(2)
print("ready")

chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hello there"}],
                                      max_tokens=16, temperature=0)
assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1, chat
print(f"chat: ok ({chat.usage.completion_tokens} tokens, finish {chat.choices[0].finish_reason})")

started = time.perf_counter(); first = None; chunks = 0
stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Count: one two"}],
                                        max_tokens=128, temperature=0, stream=True)
for event in stream:
    if event.choices and event.choices[0].delta.content:
        first = first or time.perf_counter()
        chunks += 1
done = time.perf_counter()
assert first is not None, "the stream carried no text"
ttft_ms = (first - started) * 1000
print(f"streaming: ok ({chunks} chunks)")

stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "A long story"}],
                                        max_tokens=900, temperature=0, stream=True)
for n, _ in enumerate(stream):
    if n >= 3:
        break
stream.close()  # the gateway aborts the request on the replica
after = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "still there?"}],
                                       max_tokens=4)
assert after.usage.completion_tokens >= 1
print("abort: ok (stream closed early; the replica serves on)")

n, t0, generated = 8, time.perf_counter(), 0
for i in range(n):
    r = client.completions.create(model="tiny-llama", prompt=f"throughput {i} " * 8, max_tokens=64, temperature=0)
    generated += r.usage.completion_tokens
tps = generated / (time.perf_counter() - t0)

metrics = get("/metrics")
gpu = [line for line in metrics.splitlines() if line.startswith("exaserve_gpu_memory_used_bytes")]
assert gpu, "no exaserve_gpu_memory_used_bytes in /metrics (NVML telemetry)"
print(f"nvml telemetry: ok ({gpu[0]})")

status = json.loads(get("/v1/exaserve/status"))
reps = replicas(status)
assert reps, "no replica with a pid in /v1/exaserve/status"
for rep in reps:
    raw = open(f"/proc/{rep['pid']}/environ", "rb").read().decode(errors="replace").split("\0")
    env = dict(item.split("=", 1) for item in raw if "=" in item)
    assert env.get("CUDA_VISIBLE_DEVICES", "").split(",") == rep["devices"], (env.get("CUDA_VISIBLE_DEVICES"), rep)
    wiring = [k for k in env if k.startswith(("PMIX_", "PMI_", "OMPI_", "SLURM_STEP_"))]
    assert not wiring, wiring
    print(f"replica {rep.get('replica_id', '?')}: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} ok, no MPI wiring")

prompt = "A shared system prompt, long enough to fill several KV blocks of thirty-two tokens each. " * 6
router = {}
before = json.loads(get("/v1/exaserve/status"))["router"]["routing"].get("affinity", 0)
for _ in range(30):  # the first stores the prefix; TensorRT-LLM's events reach the router
    client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2)
    time.sleep(1.5)  # the replica's stats (its prefix hits) reach the router every stats interval
    router = json.loads(get("/v1/exaserve/status"))["router"]
    if router["routing"].get("affinity", 0) > before and router.get("prefix_hit_tokens", 0) > 0:
        break
hits, queried = router.get("prefix_hit_tokens", 0), router.get("prefix_query_tokens", 0)
assert router["routing"].get("affinity", 0) > before, f"the router never routed by a held prefix ({router})"
assert hits > 0, f"no prefix hit: the replica's KV events named no block of a repeated prompt ({router})"
print(f"kv events: ok (the router routed {router['routing']['affinity'] - before} request(s) by the replica's blocks)")
print(f"TTFT {ttft_ms:.1f} ms | {tps:.1f} tokens/s (8 sequential requests) | prefix hit rate "
      f"{hits / max(1, queried):.1%} ({hits}/{queried} tokens)")
EOF

echo "== checks"
timeout "$(left)" "$PY" "$WORK/check.py" "$URL" "$(left)" || { tail -40 "$WORK/serve.log"; fail "a check failed"; }
kill -TERM "$SERVE_PID" 2>/dev/null
wait "$SERVE_PID" 2>/dev/null
SERVE_PID=""
echo "gpu check: passed in $((SECONDS - START)) s"
