"""The emitted GRPO / RLOO files run as written: a CPU candidate over a local prompt jsonl and a local model
directory is written with the trainer's `to_yaml()` and given to the real `trl grpo|rloo --config FILE` (a subprocess,
offline) with nothing but `--max_steps` added, and its `to_python()` snippet runs unchanged (one epoch of the
prompts); both train with the emitted default reward function."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_offline, save_tiny_qwen2

from advisor.space import Candidate, with_knobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 with random weights and a byte-level BPE tokenizer saved as Qwen2Tokenizer (what TRL loads)."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    save_tiny_qwen2(path, [f"hello world number {i} the quick brown fox jumps over the lazy dog" for i in range(200)])
    return path


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_the_yaml_and_the_snippet_run_as_written(trainer, model_dir, tmp_path):
    from advisor.emit import load_run_config
    from advisor.inputs import build_workload
    from advisor.trainers import get_trainer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"hello world number {i}"}) + "\n" for i in range(8)))
    wl = build_workload(str(model_dir), gpu="cpu", dataset=str(prompts), trainer=trainer)
    assert wl.dataset.unit == "prompts" and len(wl.dataset.rows) == 8
    t = get_trainer(trainer)
    cand = with_knobs(Candidate(per_device_train_batch_size=4, activation_checkpointing=False,
                                expandable_segments=False, optim="adamw_torch"),
                      num_generations=2, max_completion_length=8)
    cand = t.knobs(cand).apply(cand)  # canonical: num_generations at RLOO's own default is its None
    assert t.problems(cand, wl.gpu, wl.model) == []
    text = t.to_yaml(cand, model_name_or_path=str(model_dir), workload=wl)
    written = yaml.safe_load(text)
    assert written["use_cpu"] is True
    assert written["datasets"] == [{"path": "json", "data_files": str(prompts), "split": "train"}]
    run = tmp_path / "run.yaml"
    run.write_text(text)
    assert load_run_config(run, trainer=trainer).candidate == cand
    trl = shutil.which("trl", path=str(Path(sys.executable).parent)) or shutil.which("trl")
    assert trl, "the trl command is not installed beside this Python"
    (tmp_path / "yaml").mkdir()
    run_offline([trl, trainer, "--config", str(run), "--max_steps", "1", "--output_dir",
                 str(tmp_path / "yaml" / "out")], tmp_path / "yaml")
    code = t.to_python(cand, model_name_or_path=str(model_dir), workload=wl)
    (tmp_path / "snippet").mkdir()
    (tmp_path / "snippet" / "train.py").write_text(code)
    run_offline([sys.executable, "train.py"], tmp_path / "snippet")  # one epoch: 8 prompts x 2 completions, 4 a step
    assert (tmp_path / "snippet" / f"advisor-{trainer}").is_dir()
