"""The advisor tokenizes with the tokenizer `trl <command>` trains with (issue 25): a tokenizer saved the generic
way (`PreTrainedTokenizerFast.save_pretrained`, `tokenizer_class: TokenizersBackend`) beside a qwen2 `config.json`
is rebuilt by AutoProcessor (SFTTrainer, DPOTrainer) and AutoTokenizer (RewardTrainer) as Qwen2Tokenizer, which
tokenizes it otherwise. The advisor had kept the saved class (113 tokens a row where TRL trained on 3); here every
row's token ids equal those of TRL's own trainer built as its script builds it (`model=<directory>`, no
processing_class)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

CHAT = Path(__file__).parent / "assets" / "data" / "chat.jsonl"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny Qwen2 saved with seeded random weights, the conftest's word-level tokenizer copied beside it as
    saved (the generic fast class)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = tmp_path_factory.mktemp("generic-tokenizer-qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(**{k: v for k, v in TINY_QWEN2.items() if k not in ("model_type", "architectures")})
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for f in Path(tiny_tokenizer).iterdir():
        shutil.copy(f, path / f.name)
    saved = json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert saved in ("TokenizersBackend", "PreTrainedTokenizerFast")
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    words = "the quick brown fox jumps over the lazy dog".split()
    rows = [{"prompt": f"hello world number {i}", "chosen": " " + " ".join(words[: 3 + i % 6]),
             "rejected": " " + " ".join(reversed(words[: 2 + i % 5]))} for i in range(12)]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trl_prepared(name: str, model_dir: Path, data: Path, out: Path):
    """TRL's trainer built as `trl <name>` builds it: the model by its directory, no processing_class (the trainer
    loads it), the data through `datasets`; its prepared train_dataset."""
    import datasets
    import trl

    config_class, trainer_class = {"sft": (trl.SFTConfig, trl.SFTTrainer), "dpo": (trl.DPOConfig, trl.DPOTrainer),
                                   "reward": (trl.RewardConfig, trl.RewardTrainer)}[name]
    args = config_class(output_dir=str(out), use_cpu=True, report_to="none", max_length=None)
    trainer = trainer_class(model=str(model_dir), args=args,
                            train_dataset=datasets.load_dataset("json", data_files=str(data), split="train"))
    return trainer.processing_class, trainer.train_dataset


def _advisor(name: str, model_dir: Path, data: Path):
    from advisor.profiles import resolve_model
    from advisor.trainers import get_trainer

    return get_trainer(name).load_dataset(str(data), resolve_model(str(model_dir)))


def _saved_class_differs(model_dir: Path, tok, text: str) -> None:
    """The case is the one of the issue: the class the tokenizer was saved as gives other tokens than TRL's."""
    from transformers import PreTrainedTokenizerFast

    saved = PreTrainedTokenizerFast.from_pretrained(model_dir)
    assert type(tok).__name__ != type(saved).__name__
    assert len(saved(text)["input_ids"]) != len(tok(text)["input_ids"])


def _noted(data, trainer: str, loader: str, command: str) -> None:
    """The dataset's notes say which class was counted and why (the user saved another)."""
    (note,) = [n for n in data.notes if n.startswith("tokenizer: ")]
    assert "saved as TokenizersBackend" in note and f"{trainer} loads it as Qwen2Tokenizer" in note
    assert f"{loader}.from_pretrained" in note and f"`trl {command}`" in note


def test_sft_counts_the_tokens_sfttrainer_trains_on(model_dir, tmp_path):
    tok, prepared = _trl_prepared("sft", model_dir, CHAT, tmp_path)
    _saved_class_differs(model_dir, tok, "hello world the quick brown fox")
    data = _advisor("sft", model_dir, CHAT)
    assert [r["input_ids"] for r in data.rows] == [list(x) for x in prepared["input_ids"]]
    assert data.lengths.tolist() == [len(x) for x in prepared["input_ids"]]
    _noted(data, "SFTTrainer", "AutoProcessor", "sft")


def test_dpo_counts_the_tokens_dpotrainer_trains_on(model_dir, pairs, tmp_path):
    tok, prepared = _trl_prepared("dpo", model_dir, pairs, tmp_path)
    _saved_class_differs(model_dir, tok, "hello world the quick brown fox")
    data = _advisor("dpo", model_dir, pairs)
    for column in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert [r[column] for r in data.rows] == [list(x) for x in prepared[column]], column
    _noted(data, "DPOTrainer", "AutoProcessor", "dpo")


def test_reward_counts_the_tokens_rewardtrainer_trains_on(model_dir, pairs, tmp_path):
    from transformers import AutoTokenizer

    tok, prepared = _trl_prepared("reward", model_dir, pairs, tmp_path)
    assert type(tok) is type(AutoTokenizer.from_pretrained(model_dir))  # RewardTrainer's loader
    _saved_class_differs(model_dir, tok, "hello world the quick brown fox")
    data = _advisor("reward", model_dir, pairs)
    trl_longest = [max(len(c), len(r)) for c, r in zip(prepared["chosen_ids"], prepared["rejected_ids"],
                                                          strict=True)]
    assert data.lengths.tolist() == trl_longest
    assert [len(r["prompt_ids"]) + len(r["chosen_ids"]) for r in data.rows] == [len(x) for x in
                                                                                 prepared["chosen_ids"]]
    assert [len(r["prompt_ids"]) + len(r["rejected_ids"]) for r in data.rows] == [len(x) for x in
                                                                                   prepared["rejected_ids"]]
    _noted(data, "RewardTrainer", "AutoTokenizer", "reward")


def test_each_trainer_declares_its_scripts_loader():
    """SFTTrainer and DPOTrainer load `AutoProcessor`, RewardTrainer `AutoTokenizer` when processing_class is None
    (the TRL 1.16 source each trainer's declaration follows)."""
    import inspect

    import trl

    from advisor.trainers import get_trainer

    for name in ("sft", "dpo", "reward"):
        trainer = get_trainer(name)
        source = inspect.getsource(getattr(trl, trainer.trainer_name).__init__)
        block = source[source.index("if processing_class is None:"):][:200]
        assert f"{trainer.processing_class_loader}.from_pretrained(" in block, name
