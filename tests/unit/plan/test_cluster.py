"""The cluster: presets, flags over a preset, the YAML file, and nonsense refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.plan.cluster import CLUSTER_KEYS, PRESETS, cluster_from_args, load_cluster
from rltune.plan.errors import PlanError
from rltune.plan.spec import Cluster


def test_presets_hold_the_datasheet_figures():
    h100, a100, h200, b200 = (PRESETS[k] for k in ("h100-80gb", "a100-80gb", "h200-141gb", "b200-192gb"))
    # dense bf16 TFLOP/s: half the "with sparsity" datasheet figure (1,979 -> 989; 4,500 -> 2,250)
    assert (h100.tflops, a100.tflops, h200.tflops, b200.tflops) == (989.0, 312.0, 989.0, 2250.0)
    assert (h100.memory_gb, a100.memory_gb, h200.memory_gb, b200.memory_gb) == (80.0, 80.0, 141.0, 192.0)
    assert (h100.hbm_gbps, a100.hbm_gbps, h200.hbm_gbps, b200.hbm_gbps) == (3350.0, 2039.0, 4800.0, 8000.0)
    # NVLink per direction: half of 900 / 600 / 900 / 1,800 GB/s bidirectional
    assert (h100.intra_gbps, a100.intra_gbps, h200.intra_gbps, b200.intra_gbps) == (450.0, 300.0, 450.0, 900.0)
    # 400 Gb/s = 50 GB/s per GPU (HDR 200 Gb/s = 25 GB/s on A100 nodes)
    assert (h100.inter_gbps, a100.inter_gbps) == (50.0, 25.0)


def test_the_h100_preset_is_the_cluster_default():
    # the shared record's defaults describe the same device
    assert PRESETS["h100-80gb"] == Cluster(gpus=8)


def test_flags_replace_the_preset_figures():
    cluster = cluster_from_args(16, memory_gb=40, inter_gbps=12.5, preset="a100-80gb")
    assert (cluster.gpus, cluster.nodes, cluster.memory_gb, cluster.inter_gbps) == (16, 2, 40, 12.5)
    assert (cluster.tflops, cluster.intra_gbps, cluster.name) == (312.0, 300.0, "A100 SXM 80GB")


def test_part_of_one_node_is_allowed():
    cluster = cluster_from_args(4)
    assert (cluster.gpus, cluster.gpus_per_node, cluster.nodes) == (4, 8, 1)


@pytest.mark.parametrize(("kwargs", "expected"), [
    (dict(gpus=0), r"--gpus is 0; it must be an integer >= 1"),
    (dict(gpus=2.5), r"--gpus is 2.5; it must be an integer >= 1"),
    (dict(gpus=None), r"--gpus is missing"),
    (dict(gpus=12), r"--gpus 12 spans more than one node but is not a multiple of --gpus-per-node 8"),
    (dict(gpus=8, gpus_per_node=0), r"--gpus-per-node is 0"),
    (dict(gpus=8, inter_gbps=-5), r"--inter-gbps is -5; it must be a number > 0"),
    (dict(gpus=8, intra_gbps=0), r"--intra-gbps is 0"),
    (dict(gpus=8, memory_gb=float("nan")), r"--gpu-memory-gb is nan"),
    (dict(gpus=8, tflops=-1.0), r"--gpu-tflops is -1.0"),
    (dict(gpus=8, preset="h100"), r"unknown device preset 'h100'; choose one of h100-80gb, a100-80gb"),
])
def test_nonsense_flags_are_named(kwargs, expected):
    with pytest.raises(PlanError, match=expected):
        cluster_from_args(**kwargs)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_yaml_file_with_every_key(tmp_path):
    path = write(tmp_path, "preset: H200-141GB\ngpus: 64\ngpus_per_node: 8\ngpu_memory_gb: 140\n"
                           "gpu_tflops: 900\nintra_gbps: 400\ninter_gbps: 100\nhbm_gbps: 4000\n"
                           "host_gbps: 50\n")
    cluster = load_cluster(path)
    assert cluster == Cluster(gpus=64, gpus_per_node=8, memory_gb=140, tflops=900, hbm_gbps=4000,
                              intra_gbps=400, inter_gbps=100, host_gbps=50,
                              fp32_ratio=67.0 / 989.0, name="H200 SXM 141GB")
    assert set(CLUSTER_KEYS) == {"preset", "gpus", "gpus_per_node", "gpu_memory_gb", "gpu_tflops",
                                 "intra_gbps", "inter_gbps", "hbm_gbps", "host_gbps"}


def test_yaml_defaults_to_the_h100_preset(tmp_path):
    assert load_cluster(write(tmp_path, "gpus: 16\n")) == Cluster(gpus=16)


@pytest.mark.parametrize(("text", "expected"), [
    ("gpus: 8\nmemory_gb: 80\n", r"unknown key memory_gb; the keys are"),
    ("gpus: 8\ninter_gbps: -1\n", r"`inter_gbps` in .*cluster.yaml is -1"),
    ("gpus: 10\n", r"`gpus` in .*cluster.yaml 10 spans more than one node"),
    ("gpu_tflops: 100\n", r"`gpus` in .*cluster.yaml is missing"),
    ("gpus: 8\npreset: tpu\n", r"`preset` in .*cluster.yaml: unknown device preset 'tpu'"),
    ("- gpus: 8\n", r"cluster file .*cluster.yaml must be a mapping"),
    ("gpus: [8\n", r"cannot read cluster file .*cluster.yaml"),
])
def test_bad_yaml_names_the_key_and_file(tmp_path, text, expected):
    with pytest.raises(PlanError, match=expected) as info:
        load_cluster(write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(PlanError, match=r"cannot read cluster file .*absent.yaml"):
        load_cluster(tmp_path / "absent.yaml")
