"""Every file under profiles/ is valid; names, aliases and paths resolve; unknown names fail with a useful message."""

from __future__ import annotations

import json
import os

import pytest

from advisor import profiles
from advisor.errors import ProfileError, UnknownGPUError, UnknownModelError
from advisor.profiles import (
    PROFILES_DIR,
    check_profiles,
    detect_gpu,
    list_gpus,
    list_models,
    match_gpu,
    resolve_gpu,
    resolve_model,
)

# Parameter counts of the real checkpoints (model cards / safetensors metadata).
REAL_PARAMS = {
    "Qwen/Qwen2.5-0.5B": 494_032_768,
    "Qwen/Qwen2.5-1.5B": 1_543_714_304,
    "Qwen/Qwen2.5-7B": 7_615_616_512,
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
    "mistralai/Mistral-7B-v0.3": 7_248_023_552,
    "google/gemma-2-2b": 2_614_341_888,
    "HuggingFaceTB/SmolLM2-135M": 134_515_008,
}
REQUIRED_GPUS = ["H200", "H100-80GB-SXM", "H100-80GB-PCIe", "A100-80GB", "A100-40GB", "L40S", "L4", "A10G",
                 "RTX-4090", "RTX-3090", "T4", "V100-16GB", "cpu"]


def test_every_file_under_profiles_is_valid():
    assert check_profiles() == []
    # Model configs load with AutoConfig and build on the meta device with the real parameter count.
    import torch
    from transformers import AutoModelForCausalLM

    shipped = list_models()
    assert set(REAL_PARAMS) <= set(shipped)
    for model_id in shipped:
        spec = resolve_model(model_id)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(spec.hf_config())
        n = sum(p.numel() for p in model.parameters())
        if model_id in REAL_PARAMS:
            assert n == REAL_PARAMS[model_id], model_id
    for name in list_gpus():
        gpu = resolve_gpu(name)
        assert gpu.memory_bytes > 2**30
        if gpu.is_cuda:
            assert gpu.fp16_tflops > gpu.fp32_tflops > 0 and gpu.memory_bandwidth_gbs > 100
    for sub in ("baselines", "measurements"):
        for path in (PROFILES_DIR / sub).glob("*.json"):
            data = json.loads(path.read_text())
            assert "schema" in data or "schema_version" in data, path


def test_required_gpus_and_their_values():
    assert set(REQUIRED_GPUS) <= set(list_gpus())
    h100 = resolve_gpu("H100-80GB")
    assert h100.name == "H100-80GB-SXM" and h100.memory_bytes == 81559 * 2**20
    assert h100.supports_bf16 and h100.supports_flash_attention and h100.compute_capability == "9.0"
    t4 = resolve_gpu("T4")
    assert not t4.supports_bf16 and not t4.supports_flash_attention and t4.bf16_tflops == 0


@pytest.mark.parametrize(
    "given, expected",
    [("H100-80GB", "H100-80GB-SXM"), ("h100_80gb", "H100-80GB-SXM"), ("H100 PCIe", "H100-80GB-PCIe"),
     ("L4", "L4"), ("l4", "L4"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("rtx 4090", "RTX-4090"),
     ("Tesla T4", "T4"), ("CPU", "cpu")],
)
def test_aliases_resolve_case_and_separator_insensitive(given, expected):
    assert resolve_gpu(given).name == expected


def test_cpu_memory_is_the_hosts():
    cpu = resolve_gpu("cpu")
    assert cpu.kind == "cpu"
    assert cpu.memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_unknown_gpu_lists_known_and_suggests_nearest():
    with pytest.raises(UnknownGPUError) as info:
        resolve_gpu("H100-90GB")
    msg = str(info.value)
    assert "--gpu 'H100-90GB'" in msg and "Did you mean 'H100-80GB-SXM'" in msg
    for name in REQUIRED_GPUS:
        assert name in msg
    assert info.value.exit_code == 2


def test_detect_gpu_without_nvml_returns_none():
    import torch

    if torch.cuda.is_available():
        assert detect_gpu() is not None
        return
    assert detect_gpu() is None


def test_match_gpu_by_nvml_name_and_fallback():
    h200 = match_gpu("NVIDIA H200", 143771 * 2**20, "9.0")
    assert h200.name == "H200" and h200.memory_bytes == 143771 * 2**20
    other = match_gpu("NVIDIA RTX A6000", 48 * 2**30, "8.6")
    assert other.name == "NVIDIA RTX A6000" and other.memory_bytes == 48 * 2**30
    assert other.compute_capability == "8.6" and "no profile" in other.description


def test_offline_resolution_from_profiles(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = resolve_model("Qwen/Qwen2.5-0.5B")
    assert spec.source == "profile" and spec.num_layers == 24 and spec.hidden_size == 896
    assert spec.vocab_size == 151936 and spec.tie_word_embeddings
    assert resolve_model("qwen/qwen2.5-0.5b").name == "Qwen/Qwen2.5-0.5B"


def test_unknown_model_offline_lists_shipped_ids(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UnknownModelError) as info:
        resolve_model("Qwen/Qwen2.5-0.6B")
    msg = str(info.value)
    assert "Did you mean 'Qwen/Qwen2.5-0.5B'" in msg and "config.json" in msg
    for model_id in REAL_PARAMS:
        assert model_id in msg


def test_local_directory_and_config_file(tmp_path, tiny_model):
    (tmp_path / "config.json").write_text(json.dumps(dict(tiny_model.config)))
    by_dir = resolve_model(str(tmp_path))
    assert by_dir.source == "local" and by_dir.local_dir == tmp_path.resolve() and by_dir.num_layers == 2
    by_file = resolve_model(str(tmp_path / "config.json"))
    assert by_file.source == "local" and by_file.hidden_size == 64
    with pytest.raises(UnknownModelError, match="no config.json"):
        resolve_model(str(_empty(tmp_path)))
    with pytest.raises(UnknownModelError, match="no such file"):
        resolve_model(str(tmp_path / "missing.json"))


def _empty(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_malformed_model_config_names_file_and_problem(tmp_path, tiny_model):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    with pytest.raises(ProfileError, match="bad.json.*JSON"):
        resolve_model(str(bad_json))
    data = dict(tiny_model.config)
    del data["hidden_size"]
    data["num_hidden_layers"] = 0
    missing = tmp_path / "config.json"
    missing.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as info:
        resolve_model(str(missing))
    assert "hidden_size=None" in str(info.value) and "num_hidden_layers=0" in str(info.value)
    assert str(missing) in str(info.value)


def test_malformed_gpu_profile_reports_every_problem(tmp_path):
    (tmp_path / "gpus").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "gpus" / "bad.yaml").write_text(
        "name: X\nkind: tpu\nmemory: 12\nbf16_tflops: 10\nfp16_tflops: 10\nfp32_tflops: 1\n"
        "memory_bandwidth_gbs: 100\nsupports_bf16: false\nsupports_flash_attention: true\n"
        "compute_capability: '7.0'\naliases: []\ndescription: ''\nsped: 3\n"
    )
    problems = check_profiles(tmp_path)
    assert len(problems) >= 1
    text = " ".join(problems)
    assert "bad.yaml" in text and "unknown key 'sped'" in text
    (tmp_path / "gpus" / "bad.yaml").write_text(
        "name: X\nkind: tpu\nmemory: 12\nbf16_tflops: 10\nfp16_tflops: 10\nfp32_tflops: 1\n"
        "memory_bandwidth_gbs: 100\nsupports_bf16: false\nsupports_flash_attention: true\n"
        "compute_capability: '7.0'\naliases: []\ndescription: ''\n"
    )
    profiles._gpu_index.cache_clear()
    text = " ".join(check_profiles(tmp_path))
    for fragment in ("kind='tpu'", "memory=12", "bf16_tflops must be > 0 exactly when", "FlashAttention 2 needs"):
        assert fragment in text
    (tmp_path / "baselines").mkdir()
    (tmp_path / "baselines" / "b.json").write_text('{"peak": 1}')
    assert any("schema" in p for p in check_profiles(tmp_path))
    profiles._gpu_index.cache_clear()
