"""GPUs into containers on the NVIDIA stack: CDI devices or the nvidia runtime, chosen from what
the engine offers; a GPU job the engine can give no GPU is refused with the reason."""
from __future__ import annotations

import pytest

from colo.runtimes import nvidia
from colo.runtimes.base import StartError
from colo.runtimes.docker import DockerRuntime

pytestmark = pytest.mark.docker

UUIDS = ["GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000"]
DISCOVERED = [{"Source": "cdi", "ID": f"nvidia.com/gpu={n}"} for n in ("0", "1", "all", *UUIDS)]

YAML_SPEC = """---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
- name: GPU-11111111-2222-3333-4444-555555555555
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
containerEdits:
  hooks:
  - hookName: createContainer
    path: /usr/bin/nvidia-cdi-hook
"""


def test_cdi_preferred_when_the_engine_lists_nvidia_devices():
    a = nvidia.from_info({"CDISpecDirs": ["/etc/cdi", "/var/run/cdi"], "DiscoveredDevices": DISCOVERED,
                          "Runtimes": {"runc": {}, "nvidia": {}}})
    assert a.via == "cdi" and "5 nvidia.com/gpu devices" in a.detail
    (req,) = a.device_requests(UUIDS)
    assert req["Driver"] == "cdi" and req["DeviceIDs"] == [f"nvidia.com/gpu={u}" for u in UUIDS]


def test_cdi_without_the_gpus_uuid_name_is_refused_with_the_fix():
    a = nvidia.from_info({"CDISpecDirs": ["/etc/cdi"],
                          "DiscoveredDevices": [{"Source": "cdi", "ID": "nvidia.com/gpu=0"}]})
    with pytest.raises(StartError, match=r"do not include nvidia.com/gpu=GPU-1111.*lists nvidia.com/gpu=0.*"
                                         r"nvidia-ctk cdi generate"):
        a.device_requests(UUIDS[:1])


def test_cdi_on_without_nvidia_devices_falls_back_to_the_runtime():
    info = {"CDISpecDirs": ["/etc/cdi"], "DiscoveredDevices": [{"Source": "cdi", "ID": "vendor.com/fpga=0"}],
            "Runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}}
    a = nvidia.from_info(info)
    assert a.via == "nvidia" and "hold no nvidia.com/gpu device" in a.detail
    (req,) = a.device_requests(UUIDS)
    assert req["Driver"] == "" and req["DeviceIDs"] == UUIDS and req["Capabilities"] == [["gpu"]]
    del info["Runtimes"]
    a = nvidia.from_info(info)
    assert a.via is None and "nvidia-ctk cdi generate" in a.detail


def test_engine_older_than_api_1_50_cdi_names_read_from_its_spec_dirs(tmp_path):
    (tmp_path / "nvidia.yaml").write_text(YAML_SPEC)
    (tmp_path / "other.json").write_text('{"cdiVersion": "0.6.0", "kind": "vendor.com/x", "devices": [{"name": "a"}]}')
    (tmp_path / "more.json").write_text('{"kind": "nvidia.com/gpu", "devices": [{"name": "' + UUIDS[1] + '"}]}')
    a = nvidia.from_info({"CDISpecDirs": [str(tmp_path), str(tmp_path / "absent")]})
    assert a.via == "cdi"
    assert a.cdi_names == {"nvidia.com/gpu=0", f"nvidia.com/gpu={UUIDS[0]}", f"nvidia.com/gpu={UUIDS[1]}"}
    a.device_requests(UUIDS)
    # spec folders colo cannot read (the engine elsewhere): CDI on, the names are the engine's to check
    assert nvidia.from_info({"CDISpecDirs": [str(tmp_path / "absent")]}).cdi_names is None


def test_this_engine_offers_neither_and_a_gpu_job_is_refused_with_the_reason(rt, launch, docker_client):
    access = nvidia.detect(docker_client)
    if access.via is not None:
        pytest.skip(f"this engine gives containers GPUs ({access.detail})")
    assert "neither CDI devices nor the `nvidia` runtime" in access.detail
    assert "nvidia-ctk" in access.detail and rt.gpu_refusal().startswith("container jobs get no GPU here: ")
    ln = launch(["true"], gpus=UUIDS[:1])
    with pytest.raises(StartError, match="the Docker engine cannot give a container a GPU: neither CDI"):
        rt.start(ln)
    assert not docker_client.api.containers(all=True, filters={"label": f"colo.job={ln.job_id}"})


def test_simulated_gpus_need_nothing_of_the_engine(rt, launch, docker_client):
    h = rt.start(launch(["true"], gpus=UUIDS[:1], env={"COLO_FAKEGPU_STATE": "/opt/colo/fakegpu/state"}))
    assert rt.wait(h) == 0
    assert not docker_client.api.inspect_container(h)["HostConfig"].get("DeviceRequests")


def test_the_engine_takes_the_requests_as_docker_run_sends_them(launch, docker_client):
    """What the engine stored is what `docker run --device nvidia.com/gpu=...` / `--gpus` send."""
    ln = launch(["true"], gpus=UUIDS[:1])
    for access, driver, ids, caps in (
            (nvidia.GpuAccess("cdi", "CDI", None), "cdi", [f"nvidia.com/gpu={UUIDS[0]}"], []),
            (nvidia.GpuAccess("nvidia", "runtime"), "", UUIDS[:1], [["gpu"]])):
        r = DockerRuntime(docker_client, gpu_access=access)
        c = docker_client.api.create_container(ln.image, ["true"], host_config=r._host_config(ln),
                                               labels=ln.labels)
        try:
            (req,) = docker_client.api.inspect_container(c["Id"])["HostConfig"]["DeviceRequests"]
            assert (req["Driver"], req["DeviceIDs"], req["Capabilities"]) == (driver, ids, caps)
        finally:
            docker_client.api.remove_container(c["Id"], v=True)
