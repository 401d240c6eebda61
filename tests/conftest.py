"""Shared fixtures: tiny models built from a config, small data, the CPU target. Nothing touches the hub."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
# the host's cost per op pinned (advisor/physics/timing/host.py), so every prediction is the same on any machine and
# no test runs the microbenchmark unless it asks for it (tests/test_time_queues.py); this host's measured values,
# rounded
os.environ.setdefault("ADVISOR_HOST_COST", '{"nograd_us": 5, "grad_us": 5, "backward_us": 3, "loop_us": 3}')
# and every prediction from the shipped constants, whatever calibration files this machine has
# (advisor/physics/timing/calibrate.py)
os.environ.setdefault("ADVISOR_CALIBRATION", "off")

TINY_QWEN2 = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_model():
    from advisor.workload import ModelSpec

    return ModelSpec(name="tiny-qwen2", config=dict(TINY_QWEN2), source="local")


@pytest.fixture
def cpu_target():
    from advisor.workload import GPUSpec

    return GPUSpec(
        name="cpu", kind="cpu", memory_bytes=16 * 2**30, bf16_tflops=0.5, fp16_tflops=0.5, fp32_tflops=0.5,
        memory_bandwidth_gbs=20.0, supports_bf16=True, supports_flash_attention=False,
    )


@pytest.fixture
def h100_target():
    from advisor.workload import GPUSpec

    return GPUSpec(
        name="H100-80GB-SXM", kind="cuda", memory_bytes=80 * 10**9, bf16_tflops=989.0, fp16_tflops=989.0,
        fp32_tflops=67.0, memory_bandwidth_gbs=3350.0, supports_bf16=True, supports_flash_attention=True,
        compute_capability="9.0",
    )


@pytest.fixture
def tiny_data():
    """64 rows, lengths 16..256 (log-normal), prompt/completion split, ids within the tiny vocab."""
    from advisor.data import synthetic

    return synthetic(vocab_size=1024, rows=64, seed=0, median=64, max_len=256)


@pytest.fixture
def tiny_workload(tiny_model, cpu_target, tiny_data):
    from advisor.workload import Goals, Workload

    return Workload(model=tiny_model, gpu=cpu_target, dataset=tiny_data, goals=Goals(tokens_per_step=2048))


@pytest.fixture
def small_workload(tiny_model, cpu_target, tiny_data):
    """The tiny model on the CPU target over tiny_data, with the default goals."""
    from advisor.workload import Goals, Workload

    return Workload(model=tiny_model, gpu=cpu_target, dataset=tiny_data, goals=Goals())


@pytest.fixture
def tiny_pairs():
    """48 preference pairs, prompt + chosen 16..256 tokens (log-normal), rejected of another length."""
    from advisor.trainers.preference import synthetic_preferences

    return synthetic_preferences(vocab_size=1024, rows=48, seed=0, median=64, max_len=256)


@pytest.fixture
def dpo_workload(tiny_model, cpu_target, tiny_pairs):
    """The tiny model on the CPU target over the tiny pairs, with the default goals."""
    from advisor.workload import Goals, Workload

    return Workload(model=tiny_model, gpu=cpu_target, dataset=tiny_pairs, goals=Goals())


@pytest.fixture
def tiny_config(tmp_path, monkeypatch):
    """The tiny model's config.json as a file (what `--model PATH` takes); the advisor's cache under tmp_path."""
    import json

    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_QWEN2))
    return str(path)


def run_offline(argv: list[str], cwd) -> object:
    """A subprocess of this checkout (first on PYTHONPATH), offline, that must succeed (its output's tail shown
    otherwise): the run-as-written tests' `trl <command> --config` and snippet runs."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def save_bpe_qwen2_tokenizer(path, corpus: list[str], vocab_size: int = 400) -> None:
    """A byte-level BPE tokenizer trained on `corpus` on the spot, saved in `path` as Qwen2Tokenizer: the class TRL
    (AutoTokenizer / AutoProcessor) and the advisor's loader both read for a qwen2 model."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split()) for m in model["merges"]]
    Qwen2Tokenizer(vocab=model["vocab"], merges=merges).save_pretrained(path)


def save_tiny_qwen2(path, corpus: list[str]) -> None:
    """A local model directory: TINY_QWEN2 with seeded random weights and save_bpe_qwen2_tokenizer's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    save_bpe_qwen2_tokenizer(path, corpus)
    torch.manual_seed(0)
    config = Qwen2Config(**{k: v for k, v in TINY_QWEN2.items() if k not in ("model_type", "architectures")})
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A word-level tokenizer trained on the spot, with a chat template; saved as a directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"hello world number {i} the quick brown fox jumps over the lazy dog" for i in range(200)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"])
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
    )
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(path)
    return path


@pytest.fixture
def children(monkeypatch):
    """Records every probe child the runner starts (its ChildExit), to check afterwards that its group is gone."""
    from advisor.probing import runner

    seen = []
    original = runner._spawn_and_wait

    def spy(*args, **kwargs):
        exit_ = original(*args, **kwargs)
        seen.append(exit_)
        return exit_

    monkeypatch.setattr(runner, "_spawn_and_wait", spy)
    return seen
