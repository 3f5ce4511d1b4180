"""Stage Job manifests: the launcher for one GPU, one node of several GPUs, and several nodes."""

from __future__ import annotations

from tailor.operator.jobs import JobSettings, launcher, stage_job

OWNER = {"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 3}}
ARGS = ["compress", "--config", "/plan/plan.yaml", "--out", "/artifacts/m/g3"]


def test_the_launcher_is_tailor_or_torchrun_by_gpus_and_nodes() -> None:
    assert launcher("m-g3-compress", JobSettings(image="i"), ARGS) == ["tailor", *ARGS]
    assert launcher("m-g3-compress", JobSettings(image="i", gpus_per_node=8), ARGS)[:3] == [
        "torchrun", "--standalone", "--nproc-per-node=8"]
    script = launcher("m-g3-compress", JobSettings(image="i", gpus_per_node=8, nodes=4), ARGS)[-1]
    assert "--nnodes 4 --nproc-per-node 8 --node-rank $JOB_COMPLETION_INDEX" in script
    assert "--master-addr m-g3-compress-0.m-g3-compress" in script and script.endswith(" ".join(ARGS))


def test_a_multi_node_stage_is_an_indexed_job_with_a_headless_service() -> None:
    job, service = stage_job(OWNER, "compress", 3, ARGS, JobSettings(image="i", gpus_per_node=8, nodes=2),
                             "NVIDIA-B200", "claim", "m-g3-plan")
    assert job["metadata"]["name"] == "m-g3-compress" and job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"] == "m-g3-compress"
    assert service["spec"]["clusterIP"] == "None"
    anti_affinity = job["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    spread = anti_affinity["requiredDuringSchedulingIgnoredDuringExecution"]
    assert spread[0]["topologyKey"] == "kubernetes.io/hostname"
    (single,) = stage_job(OWNER, "evaluate", 3, ["evaluate"], JobSettings(image="i"), "NVIDIA-B200", "claim", "plan")
    pod = single["spec"]["template"]["spec"]
    assert "completionMode" not in single["spec"] and pod["restartPolicy"] == "Never"
    assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-B200"}
