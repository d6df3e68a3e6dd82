"""A TensorRT-LLM replica's process, started by a real node agent inside a Slurm step with PMIx/MPI wiring.

The agent runs as `python -m exaserve_hpc.agent` with the variables srun --mpi=pmix sets for a task of a
step granted gpu:4; a test socket plays the controller. The trtllm replica (the stand-in TensorRT-LLM,
tests/engine/trtllm_standin, which refuses TP 2 unless two devices are visible) must start with none of the
step's PMIx/MPI/task variables (TensorRT-LLM's own MPI workers would try to join the step), exactly its
reserved devices in CUDA_VISIBLE_DEVICES, and its reservation, which bounds its KV pool (max_tokens). An echo
replica of the same agent keeps the step's environment: only engines that start MPI workers are isolated.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent_harness import TINY
from test_gpu_binding_process import STEP, AgentProcess, environ_of
from exaserve_hpc.agent.replica_process import MPI_WIRING_NAMES, MPI_WIRING_PREFIXES, RESERVED_BYTES_ENV
from exaserve_hpc.cache.checkpoint import create_tiny_checkpoint
from exaserve_hpc.engine.registry import RESERVED_ENV
from exaserve_hpc.engine.trtllm_backend import kv_token_budget
from exaserve_hpc.protocol import AgentHeartbeat, AgentHello, EngineSettings, ReplicaEvent, StartReplica, encode

pytestmark = pytest.mark.process

GiB = 1 << 30
STANDIN = Path(__file__).parents[1] / "engine" / "trtllm_standin"
# What srun --mpi=pmix (and an mpirun above it) put in a task's environment, besides SLURM_STEP_GPUS & co.
MPI_WIRING = {"PMIX_RANK": "0", "PMIX_NAMESPACE": "slurm.pmix.4242.0", "PMIX_SERVER_URI41": "pmix-server.1;tcp4://10.0.0.1:4711",
              "PMIX_SECURITY_MODE": "native", "PMI_FD": "7", "PMI_RANK": "0", "PMI_SIZE": "4",
              "OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_orte_hnp_uri": "1234.0;tcp://10.0.0.1:4712",
              "SLURM_STEPID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
              "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "gpu001",
              "SLURM_MPI_TYPE": "pmix", "SLURM_PMIXP_ABORT_AGENT_PORT": "4713", "SLURM_SRUN_COMM_PORT": "4714",
              "SLURM_GTIDS": "0", "SLURM_CPU_BIND": "quiet,mask_cpu:0x1"}


def is_wiring(name: str) -> bool:
    return name.startswith(MPI_WIRING_PREFIXES) or name in MPI_WIRING_NAMES


def test_a_trtllm_replica_runs_without_the_steps_mpi_wiring_on_exactly_its_devices(tmp_path):
    assert RESERVED_BYTES_ENV == RESERVED_ENV  # the agent writes what the engine reads
    assert all(is_wiring(name) for name in MPI_WIRING) and not is_wiring("SLURM_JOB_ID")
    record = tmp_path / "calls.jsonl"
    checkpoint = create_tiny_checkpoint(tmp_path / "l3" / "tiny-hf", TINY)  # Hugging Face layout, with a manifest
    env = {**STEP, **MPI_WIRING, "TRTLLM_STANDIN_RECORD": str(record),
           "PYTHONPATH": os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")])}
    agent = AgentProcess(tmp_path, env, "--gpus-per-node", "4", "--memory-pool", "16GiB")
    try:
        agent.wait_for(lambda m: isinstance(m, AgentHello))
        agent.controller.send_multipart([agent.peer, encode(StartReplica(
            replica_id="trt/r0", model="tiny", model_dir=str(checkpoint), router_backend=agent.backend,
            settings=EngineSettings(engine="trtllm", max_batch_size=4, max_seq_len=128), drain_timeout=2.0,
            memory_bytes=4 * GiB, devices=2, gpu_indices=[1, 2]))])
        agent.start("echo/r0", GiB, [3])
        agent.wait_for(lambda m: isinstance(m, ReplicaEvent) and m.replica_id == "trt/r0" and m.state == "serving",
                       timeout=60)
        beat = agent.wait_for(lambda m: isinstance(m, AgentHeartbeat) and {
            r.replica_id for r in m.replicas if r.pid and r.state == "serving"} >= {"trt/r0", "echo/r0"})
        status = {r.replica_id: r for r in beat.replicas}
        trt, echo = environ_of(status["trt/r0"].pid), environ_of(status["echo/r0"].pid)

        assert sorted(name for name in trt if is_wiring(name)) == []  # no PMIx, PMI, OMPI, step or task wiring
        assert trt["CUDA_VISIBLE_DEVICES"] == "1,2" == ",".join(status["trt/r0"].devices)  # exactly its devices
        assert trt["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and trt["SLURM_JOB_ID"] == STEP["SLURM_JOB_ID"]
        assert int(trt[RESERVED_ENV]) == 4 * GiB == beat.memory.reservations["trt/r0"] // 2
        assert {name: echo[name] for name in MPI_WIRING} == MPI_WIRING  # other engines keep the step's
        assert echo["CUDA_VISIBLE_DEVICES"] == "3"

        llm = next(json.loads(line) for line in record.read_text().splitlines() if '"call": "LLM"' in line)
        assert llm["tensor_parallel_size"] == 2  # TP over its two devices, TensorRT-LLM's own workers
        l2_copy = Path(llm["model"])
        assert llm["kv_cache_config"]["max_tokens"] == kv_token_budget(
            l2_copy, 4 * GiB, tp=2, pp=1, kv_cache_dtype="fp16", block_size=32, max_seq_len=128)
    finally:
        agent.close()
    assert agent.process.returncode == 0
