"""The emitted distillation files run as written: a CPU candidate over a local prompt jsonl, a local student directory
and a local teacher of another width (the student's vocabulary) is written with the trainer's `to_yaml()` and given to
the real `trl distillation --config FILE` (a subprocess, offline) with nothing but `--max_steps 2` added, and its
`to_python()` snippet runs unchanged (one epoch of the prompts)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY_QWEN2, run_offline, save_tiny_qwen2

from advisor.space import Candidate, with_knobs


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen2 student with random weights and a byte-level BPE tokenizer saved as Qwen2Tokenizer (what TRL
    loads), and a teacher 96 wide and 3 deep with the student's vocabulary (no tokenizer: TRL uses the student's)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    student = tmp_path_factory.mktemp("student")
    save_tiny_qwen2(student, [f"hello world number {i} the quick brown fox jumps over the lazy dog"
                              for i in range(200)])
    teacher = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(1)
    config = Qwen2Config(**{**{k: v for k, v in TINY_QWEN2.items() if k not in ("model_type", "architectures")},
                            "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3,
                            "num_attention_heads": 6})
    AutoModelForCausalLM.from_config(config).save_pretrained(teacher)
    return student, teacher


@pytest.mark.slow
def test_the_yaml_and_the_snippet_run_as_written(model_dirs, tmp_path):
    from advisor.emit import load_run_config
    from advisor.inputs import build_workload
    from advisor.trainers import get_trainer

    student, teacher = model_dirs
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"hello world number {i}"}) + "\n" for i in range(8)))
    wl = build_workload(str(student), gpu="cpu", dataset=str(prompts), trainer="distillation", teacher=str(teacher))
    assert wl.dataset.unit == "prompts" and len(wl.dataset.rows) == 8 and wl.model_of("teacher").name == str(teacher)
    t = get_trainer("distillation")
    cand = with_knobs(Candidate(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                activation_checkpointing=False, expandable_segments=False, optim="adamw_torch"),
                      max_completion_length=8, beta=0.5, teacher_dtype="bfloat16")
    assert t.problems(cand, wl.gpu, wl.model) == []
    text = t.to_yaml(cand, model_name_or_path=str(student), workload=wl)
    written = yaml.safe_load(text)
    assert written["use_cpu"] is True
    assert written["teacher_model_name_or_path"] == str(teacher)
    assert written["teacher_model_init_kwargs"]["dtype"] == "bfloat16" and written["beta"] == 0.5
    assert written["datasets"] == [{"path": "json", "data_files": str(prompts), "split": "train"}]
    run = tmp_path / "run.yaml"
    run.write_text(text)
    back = load_run_config(run, trainer="distillation").candidate
    assert back == cand.replace(base={**cand.base.as_dict(), "teacher_model_name_or_path": str(teacher)})
    trl = shutil.which("trl", path=str(Path(sys.executable).parent)) or shutil.which("trl")
    assert trl, "the trl command is not installed beside this Python"
    (tmp_path / "yaml").mkdir()
    run_offline([trl, "distillation", "--config", str(run), "--max_steps", "2", "--output_dir",
                 str(tmp_path / "yaml" / "out")], tmp_path / "yaml")
    code = t.to_python(cand, model_name_or_path=str(student), workload=wl)
    assert f"teacher_model={str(teacher)!r}" in code
    (tmp_path / "snippet").mkdir()
    (tmp_path / "snippet" / "train.py").write_text(code)
    run_offline([sys.executable, "train.py"], tmp_path / "snippet")  # one epoch: 8 prompts, 2 a micro-step, GA 2
    assert (tmp_path / "snippet" / "advisor-distillation").is_dir()
