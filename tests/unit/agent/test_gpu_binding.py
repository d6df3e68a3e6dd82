"""GPU binding as a pure function: which GPUs a node was granted (environment + NVML readings in, a
grant out), how NVML devices are matched to granted ids, what one replica is given, and what the agent
reports; and the NVML seam against a stand-in pynvml that records what the real library would be asked."""


import pytest

from exaserve_hpc.agent import nvml_probe
from exaserve_hpc.agent.gpu_binding import (
    GpuGrant, GpuGrantError, GrantedGpu, detect_grant, match_nvml, parse_ids, replica_binding
)
from exaserve_hpc.agent.nvml_probe import NvmlDevice

GiB = 1 << 30


def nvml(count: int, minors=None, cpus_per_gpu: int = 0) -> list[NvmlDevice]:
    """Stand-in NVML readings: what read_devices() would return on a node with `count` GPUs."""
    minors = list(range(count)) if minors is None else minors
    return [NvmlDevice(i, f"GPU-uuid-{minors[i]}", minors[i], (10 + i) * GiB,
                       frozenset(range(i * cpus_per_gpu, (i + 1) * cpus_per_gpu))) for i in range(count)]


def ids(grant: GpuGrant) -> list[str]:
    return [g.ident for g in grant.gpus]


@pytest.mark.parametrize("text, expected", [
    ("0,1,2,3", ["0", "1", "2", "3"]), ("0-3", ["0", "1", "2", "3"]), ("1,4-5", ["1", "4", "5"]),
    ("GPU-ab-cd,MIG-ef", ["GPU-ab-cd", "MIG-ef"]), ("", []), ("NoDevFiles", []), ("-1", []), (" 2 ", ["2"]),
])
def test_parse_ids_reads_slurm_and_cuda_lists(text, expected):
    assert parse_ids(text) == expected


def test_slurm_step_gpus_win_over_the_job_and_cuda_visible_devices():
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_GPUS": "2,3", "SLURM_JOB_GPUS": "0,1,2,3", "CUDA_VISIBLE_DEVICES": "0,1"}
    grant = detect_grant(env, [], 2)
    assert [g.granted_id for g in grant.gpus] == ["2", "3"] and grant.source == "SLURM_STEP_GPUS=2,3"
    # without NVML, a GPU is named as CUDA in the step numbers it: its entry in the step's (zero-based
    # under a device cgroup) CUDA_VISIBLE_DEVICES, paired in order with Slurm's node-wide ids
    assert ids(grant) == ["0", "1"]
    assert ids(detect_grant({"SLURM_STEP_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0"}, [], 2)) == ["2", "3"]
    assert ids(detect_grant({"SLURM_STEP_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}, nvml(4), 2)) == \
        ["GPU-uuid-2", "GPU-uuid-3"]  # a UUID needs no numbering at all


def test_the_job_gpus_then_the_steps_cuda_visible_devices():
    assert detect_grant({"SLURM_JOB_GPUS": "1", "CUDA_VISIBLE_DEVICES": "0"}, [], 1).source == "SLURM_JOB_GPUS=1"
    grant = detect_grant({"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0,1"}, [], 2)
    assert ids(grant) == ["0", "1"] and grant.source == "CUDA_VISIBLE_DEVICES=0,1"


def test_nvml_when_slurm_says_nothing_and_its_uuids_name_the_devices():
    grant = detect_grant({}, nvml(2, cpus_per_gpu=4), None)
    assert ids(grant) == ["GPU-uuid-0", "GPU-uuid-1"] and grant.source.startswith("NVML")
    assert grant.gpus[1].memory_free == 11 * GiB and grant.gpus[1].cpus == frozenset({4, 5, 6, 7})


def test_the_site_config_only_outside_slurm_and_without_nvml():
    grant = detect_grant({}, [], 4)
    assert ids(grant) == ["0", "1", "2", "3"] and grant.source == "cluster.gpus_per_node"
    # a Slurm job that names no GPU was granted none: never bind GPUs another job may hold
    with pytest.raises(GpuGrantError, match="granted 0 GPU"):
        detect_grant({"SLURM_JOB_ID": "7"}, [], 4)


def test_no_site_no_slurm_no_nvml_is_a_cpu_node():
    assert detect_grant({}, [], None) == GpuGrant()
    assert detect_grant({"SLURM_JOB_ID": "7"}, [], None).gpus == ()


def test_a_cpu_site_binds_no_gpu_whatever_the_node_has():
    grant = detect_grant({"SLURM_STEP_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "0,1"}, nvml(2), 0)
    assert grant.gpus == () and "cluster.gpus_per_node is 0" in grant.source


def test_asking_for_more_gpus_than_granted_is_refused_naming_the_setting_the_count_and_the_source():
    with pytest.raises(GpuGrantError) as info:
        detect_grant({"SLURM_JOB_ID": "7", "SLURM_STEP_GPUS": "0,1"}, nvml(8), 4)
    message = str(info.value)
    assert "cluster.gpus_per_node is 4" in message and "granted 2 GPU(s)" in message
    assert "SLURM_STEP_GPUS=0,1" in message and "--gpus-per-node=4" in message
    with pytest.raises(GpuGrantError, match=r"granted 2 GPU\(s\) \(NVML"):
        detect_grant({}, nvml(2), 8)


def test_a_larger_grant_is_used_up_to_gpus_per_node():
    assert ids(detect_grant({"SLURM_STEP_GPUS": "0,1,2,3"}, [], 2)) == ["0", "1"]


def test_nvml_is_matched_by_minor_number_when_slurm_names_device_files():
    # NVML sees all four (no device cgroup); PCI order differs from /dev/nvidiaN order
    devices = nvml(4, minors=[1, 0, 3, 2])
    matched = match_nvml(["2", "3"], devices)
    assert matched["2"].uuid == "GPU-uuid-2" and matched["3"].uuid == "GPU-uuid-3"
    grant = detect_grant({"SLURM_STEP_GPUS": "2,3"}, devices, 2)
    assert ids(grant) == ["GPU-uuid-2", "GPU-uuid-3"]


def test_nvml_is_matched_in_order_when_a_cgroup_hides_the_other_gpus():
    # Slurm's CUDA_VISIBLE_DEVICES is zero-based inside the cgroup; NVML sees the two granted GPUs
    hidden = [NvmlDevice(0, "GPU-x", -1, GiB), NvmlDevice(1, "GPU-y", -1, GiB)]
    assert ids(detect_grant({"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0,1"}, hidden, 2)) == ["GPU-x", "GPU-y"]
    assert {k: v.uuid for k, v in match_nvml(["GPU-y"], hidden).items()} == {"GPU-y": "GPU-y"}


def test_ids_nvml_cannot_place_are_bound_as_granted():
    assert ids(detect_grant({"CUDA_VISIBLE_DEVICES": "5,6"}, nvml(3, minors=[7, 8, 9]), None)) == ["5", "6"]


def test_a_replica_gets_its_devices_the_pci_order_and_the_cpus_near_them():
    grant = detect_grant({}, nvml(4, cpus_per_gpu=2), 4)
    binding = replica_binding(grant, (2, 3), frozenset(range(5)))
    assert binding.devices == ("GPU-uuid-2", "GPU-uuid-3")
    assert binding.env == {"CUDA_VISIBLE_DEVICES": "GPU-uuid-2,GPU-uuid-3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert binding.cpus == frozenset({4})  # near GPUs 2-3 are CPUs 4-7; the agent may use 0-4
    assert replica_binding(grant, (3,), frozenset({0, 1})).cpus is None  # none near and allowed: leave it


def test_without_nvml_affinity_is_left_alone_and_the_granted_ids_are_used():
    binding = replica_binding(GpuGrant((GrantedGpu("0", "0"), GrantedGpu("1", "1")), "SLURM_STEP_GPUS=0,1"),
                              (1,), frozenset({0, 1}))
    assert binding.devices == ("1",) and binding.env["CUDA_VISIBLE_DEVICES"] == "1" and binding.cpus is None


def test_a_host_replica_sees_no_gpu():
    binding = replica_binding(GpuGrant(), (0,), frozenset({0, 1}))
    assert binding.devices == () and binding.env["CUDA_VISIBLE_DEVICES"] == "" and binding.cpus is None


def test_telemetry_covers_the_granted_gpus_numbered_as_the_pool_numbers_them():
    from exaserve_hpc.agent.gpu_binding import granted_telemetry
    from exaserve_hpc.protocol import GpuInfo
    readings = [GpuInfo(index=i, name="H200", memory_total=GiB, memory_used=i) for i in range(4)]
    grant = detect_grant({"SLURM_STEP_GPUS": "2,3"}, nvml(4), 2)  # NVML sees all four, two are ours
    assert [(g.index, g.memory_used) for g in granted_telemetry(grant, readings)] == [(0, 2), (1, 3)]
    assert granted_telemetry(detect_grant({}, [], 4), readings) == []  # stand-in ids: NVML knows none
    assert granted_telemetry(detect_grant({}, nvml(4), 0), readings) == []  # a CPU site reports no GPU


class StandInNvml:
    """Records what nvidia-ml-py would be asked and answers as a two-GPU, 72-CPU node would (no GPU here)."""

    class Memory:
        free, total, used = 70 * GiB, 80 * GiB, 10 * GiB

    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        answers = {
            "nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetCount": lambda: 2,
            "nvmlDeviceGetHandleByIndex": lambda i: f"handle{i}",
            "nvmlDeviceGetUUID": lambda h: b"GPU-11" if h == "handle0" else "GPU-22",  # bytes in old releases
            "nvmlDeviceGetMinorNumber": lambda h: 5 if h == "handle0" else self._fail(),
            "nvmlDeviceGetMemoryInfo": lambda h: self.Memory(),
            # CPUs 0-1 and 64-65 near GPU 0 (the mask spans two 64-bit words); nothing reported for GPU 1
            "nvmlDeviceGetCpuAffinity": lambda h, n: [0b11, 0b11] if h == "handle0" else self._fail(),
        }
        if name not in answers:
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, *args))
            return answers[name](*args)
        return call

    @staticmethod
    def _fail():
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")


def test_read_devices_asks_nvml_for_identity_memory_and_nearby_cpus(monkeypatch):
    stand_in = StandInNvml()
    monkeypatch.setattr(nvml_probe, "pynvml", stand_in)  # the module the probe imported at its top
    monkeypatch.setattr(nvml_probe.os, "cpu_count", lambda: 72)
    devices, why = nvml_probe.read_devices()
    assert why == ""
    assert devices == [NvmlDevice(0, "GPU-11", 5, 70 * GiB, frozenset({0, 1, 64, 65})),
                       NvmlDevice(1, "GPU-22", -1, 70 * GiB, frozenset())]
    assert ("nvmlDeviceGetCpuAffinity", "handle0", 2) in stand_in.calls  # two 64-bit words for 72 CPUs
    assert stand_in.calls[-1] == ("nvmlShutdown",)


def test_read_devices_without_nvml_is_an_empty_list_and_a_reason(monkeypatch):
    monkeypatch.setattr(nvml_probe, "pynvml", None)  # what the probe holds when nvidia-ml-py does not import
    assert nvml_probe.read_devices() == ([], "nvidia-ml-py is not installed")
