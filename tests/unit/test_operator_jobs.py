"""Stage Job manifests: the launcher for one GPU, one node of several GPUs, and several nodes; what the pods
request and mount."""

from __future__ import annotations

import shlex

from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.compressor.sizing.hostmemory import compression_need
from tailor.operator.jobs import JobSettings, launcher, stage_args, stage_job
from tailor.operator.placement import gpu_terms, scheduling

OWNER = {"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 3}}
ARGS = stage_args("compress")
B200 = scheduling(None, gpu_terms(GpuCatalog.load().get("B200")))


def test_the_launcher_is_tailor_or_torchrun_by_gpus_and_nodes() -> None:
    assert ARGS == ["compress", "--plan", "/plan/plan.yaml", "--result-file", "/dev/termination-log"]
    assert launcher("m-g3-compress", JobSettings(image="i"), ARGS) == ["tailor", *ARGS]
    assert launcher("m-g3-compress", JobSettings(image="i", gpus_per_node=8), ARGS)[:3] == [
        "torchrun", "--standalone", "--nproc-per-node=8"]
    script = launcher("m-g3-compress", JobSettings(image="i", gpus_per_node=8, nodes=4), ARGS)[-1]
    assert "--nnodes 4 --nproc-per-node 8" in script and '--node-rank "$JOB_COMPLETION_INDEX"' in script
    assert "--master-addr m-g3-compress-0.m-g3-compress" in script and script.endswith(" ".join(ARGS))


def test_the_multi_node_launcher_quotes_its_arguments() -> None:
    hostile = [*ARGS[:2], "/plan/plan.yaml; rm -rf /artifacts"]
    script = launcher("m-g3-compress", JobSettings(image="i", gpus_per_node=8, nodes=2), hostile)[-1]
    assert script.endswith(shlex.join(["-m", "tailor.cli.main", *hostile]))
    assert "'/plan/plan.yaml; rm -rf /artifacts'" in script


def test_a_multi_node_stage_is_an_indexed_job_with_a_headless_service() -> None:
    job, service = stage_job(OWNER, "compress", 3, JobSettings(image="i", gpus_per_node=8, nodes=2),
                             B200, "claim", "m-g3-plan")
    assert job["metadata"]["name"] == "m-g3-compress" and job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"] == "m-g3-compress"
    assert service["spec"]["clusterIP"] == "None"
    anti_affinity = job["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    spread = anti_affinity["requiredDuringSchedulingIgnoredDuringExecution"]
    assert "nodeAffinity" in job["spec"]["template"]["spec"]["affinity"]  # one pod per node, each on a B200 node
    assert spread[0]["topologyKey"] == "kubernetes.io/hostname"
    (single,) = stage_job(OWNER, "evaluate", 3, JobSettings(image="i"), B200, "claim", "plan")
    pod = single["spec"]["template"]["spec"]
    assert "completionMode" not in single["spec"] and pod["restartPolicy"] == "Never"
    assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    # on B200 nodes however they are labelled (GFD's product, GKE's accelerator, the EC2 instance type)
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"][0]["key"] for t in terms] == [
        "nvidia.com/gpu.product", "cloud.google.com/gke-accelerator", "node.kubernetes.io/instance-type"]
    assert "nodeSelector" not in pod


def test_stage_pods_are_not_best_effort_are_limited_in_memory_and_multi_gpu_pods_get_shared_memory() -> None:
    """Requests keep a pod out of BestEffort; every stage pod has a memory limit (the old Jobs had none): the
    footprint with headroom where it is known, else the per-GPU allowance, and the /dev/shm it may fill."""
    (job, _) = stage_job(OWNER, "compress", 3, JobSettings(image="i", gpus_per_node=8, nodes=2), B200,
                         "claim", "plan")
    pod = job["spec"]["template"]["spec"]
    requests = pod["containers"][0]["resources"]["requests"]
    assert requests == {"cpu": "4000m", "memory": "16Gi", "nvidia.com/gpu": "8"}
    # 8 GPUs x 32 GiB assumed, x 1.25, and 64 GiB of /dev/shm
    assert pod["containers"][0]["resources"]["limits"] == {"memory": f"{(8 * 32 * 5 // 4 + 64) * 1024}Mi",
                                                           "nvidia.com/gpu": "8"}
    footprint = compression_need(4 * 2**30)  # a CPU run whose ranks hold 4 GiB at their peak stage, as modelled
    (cpu,) = stage_job(OWNER, "compress", 3, JobSettings(image="i", host=footprint), B200, "claim", "plan")
    assert cpu["spec"]["template"]["spec"]["containers"][0]["resources"] == {  # 4 GiB and 1 undercounted, x 1.25
        "requests": {"cpu": "500m", "memory": "5120Mi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "6400Mi", "nvidia.com/gpu": "1"}}
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{64 * 1024}Mi"}} in pod["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    # it writes only to its mounts: a read-only root, HOME and the caches in its scratch folder
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "scratch", "mountPath": "/tmp"} in pod["containers"][0]["volumeMounts"]
    assert {"name": "HOME", "value": "/tmp/home"} in pod["containers"][0]["env"]
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    (package,) = stage_job(OWNER, "package", 3, JobSettings(image="i", gpus_per_node=0), B200, "claim",
                           "plan", pool="b200")
    container = package["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "500m", "memory": "2Gi"},  # no GPU, still Burstable
                                      "limits": {"memory": "10240Mi"}}  # 8 GiB assumed for a step, x 1.25
    assert container["command"] == ["tailor", "package", "--plan", "/plan/plan.yaml", "--result-file",
                                    "/dev/termination-log"]
    assert package["metadata"]["name"] == "m-g3-package-b200"
