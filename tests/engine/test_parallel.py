"""TP/PP over MPI: shard maths in-process, and real mpirun -n 2 / -n 4 replicas
giving the same greedy tokens as TP=PP=1."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint, load_checkpoint
from exaserve_hpc.engine.model import LlamaModel
from exaserve_hpc.engine.parallel import shard_model, stage_layers
from exaserve_hpc.engine.reference import ReferenceEngine

sys.path.insert(0, str(Path(__file__).parent))
import mpi_parallel_check as check  # noqa: E402

SPEC = TinyModelSpec(layers=4, hidden=64, heads=8, kv_heads=4, intermediate=176,
                     max_position=128, shards=1, seed=4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return create_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", SPEC)


def test_stage_layers_partition():
    assert [list(stage_layers(5, 2, s)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [len(stage_layers(4, 4, s)) for s in range(4)] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="pipeline_parallel_size 5 must be between 1 and"):
        stage_layers(4, 5, 0)


def test_tensor_shards_sum_to_the_full_model(ckpt):
    """Shards summing their partial wo / w_down outputs (what the all-reduce
    does) reproduce the unsharded logits; pipeline stages chain to the same."""
    model = LlamaModel(*load_checkpoint(ckpt))
    ids = [256, 5, 6, 7, 8, 9, 10]
    want = model.prefill(ids, model.new_cache())
    for tp in (2, 4):
        np.testing.assert_allclose(_tp_logits(model, tp, ids), want, rtol=1e-5, atol=1e-5)
    stages = [shard_model(model, 1, 0, stage_layers(4, 3, s)) for s in range(3)]
    caches = [stage.new_cache() for stage in stages]
    batch = stages[0].prepare([ids], caches[:1])
    x = model.embed[batch.flat]
    for stage, cache in zip(stages, caches):
        x = stage.run_layers(x, batch, [cache])
    np.testing.assert_allclose(stages[-1].logits(x, batch)[0], want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide heads"):
        shard_model(model, 3, 0, range(4))


def _tp_logits(model, tp, ids):
    """TP forward with an in-process all-reduce: run shards in lockstep threads."""
    import threading

    shards = [shard_model(model, tp, r, range(model.num_layers)) for r in range(tp)]
    barrier = threading.Barrier(tp)
    slots = [None] * tp
    results = [None] * tp

    def make_reduce(r):
        def reduce(partial):
            slots[r] = partial
            barrier.wait()
            total = sum(slots[i] for i in range(tp))
            barrier.wait()
            return total
        return reduce

    def run(r):
        shards[r].reduce = make_reduce(r)
        results[r] = shards[r].prefill(ids, shards[r].new_cache())

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(results[0], results[-1])
    return results[0]


def reference_tokens(ckpt):
    return check.run(ReferenceEngine.from_weights(*load_checkpoint(ckpt), **check.engine_kwargs()))


needs_mpi = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI's mpirun")


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
def test_mpirun_replica_matches_single_rank(ckpt, tp, pp):
    pytest.importorskip("mpi4py")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(tp * pp),
           sys.executable, str(Path(check.__file__)), "--tp", str(tp), "--pp", str(pp),
           "--ckpt", str(ckpt)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    want = reference_tokens(ckpt)
    assert result["tokens"] == want and all(len(t) == 12 for t in want.values())
    assert result["prefix_hit_tokens"] > 0  # prompts 0 and 1 share blocks
    # Each rank holds K/V for its layers and kv heads only.
    assert result["kv_bytes_per_token"] == 2 * (4 // pp) * (4 // tp) * 8 * 4
