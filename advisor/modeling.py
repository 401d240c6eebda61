"""Models with random weights built from an architecture: same memory and speed as the real ones."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .space import default_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

    from .space import Candidate
    from .workload import ModelSpec


def _torch_dtype(candidate: Candidate | None):
    import torch  # lazy: loads torch

    return getattr(torch, candidate.weights_dtype.value) if candidate is not None else torch.float32


def build_model(spec: ModelSpec, candidate: Candidate | None = None, device: str = "cpu") -> PreTrainedModel:
    """A causal LM with random weights in the candidate's dtype and attention implementation.

    `device="meta"` allocates nothing (for counting and for the simulator).
    """
    import torch  # lazy: loads torch
    from transformers import AutoModelForCausalLM  # lazy: loads transformers
    from transformers.utils.generic import is_flash_attention_requested  # lazy: loads transformers

    config = spec.hf_config()
    chosen = candidate.attn_implementation if candidate is not None else None
    attn = chosen.value if chosen is not None else default_attention(spec).value
    flash = is_flash_attention_requested(requested_attention_implementation=attn)
    if flash and device == "meta":
        # Built with eager (transformers would load the FlashAttention kernel from the Hub, and it cannot run here);
        # then named FlashAttention, so every branch of the fake run takes the flash path and its attention calls
        # reach advisor/simulator/flash.py (the simulator's stand-in for the kernel).
        config._attn_implementation = "eager"
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(candidate))
        if not getattr(model, "_supports_flash_attn", False):
            raise ConfigError(
                f"attn_implementation={attn}: {type(model).__name__} does not support FlashAttention (transformers "
                "raises \"does not support Flash Attention yet\"); use attn_implementation=sdpa or eager"
            )
        model.config._attn_implementation = attn
        return model
    # A real-weights run loads FlashAttention (Hub kernel or flash-attn package) through `model_init_kwargs`; the
    # saved random model keeps sdpa.
    config._attn_implementation = "sdpa" if flash else attn
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(candidate))
    return model


def save_random_model(spec: ModelSpec, directory: str | Path, candidate: Candidate | None = None) -> Path:
    """Save config + safetensors of random weights so TRL loads the model by path and `model_init_kwargs` apply."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = build_model(spec, candidate, device="cpu")
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def reward_model_config(spec: ModelSpec, pad_token_id: int):
    """The config of a reward model given as a model (`--reward-model`): `trl grpo` / `trl rloo` load
    `reward_model_name_or_path` with AutoModelForSequenceClassification.from_pretrained(..., num_labels=1) (GRPOTrainer
    / RLOOTrainer.__init__); the pad token is the reward tokenizer's where the config has none."""
    from transformers import AutoConfig  # lazy: loads transformers

    cfg = dict(spec.config)
    cfg.pop("architectures", None)
    config = AutoConfig.for_model(**{**cfg, "num_labels": 1})
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = pad_token_id
    return config


def save_random_reward_model(spec: ModelSpec, directory: str | Path) -> Path:
    """Save a reward model of `spec`'s architecture with random weights, so the trainer loads it by path as
    `trl grpo` loads `reward_model_name_or_path` (its dtype and attention from model_init_kwargs). Its tokenizer is
    placeholder_tokenizer(spec), given as the reward processing class (AutoTokenizer would read a saved one beside a
    config.json by the model type's class, e.g. Qwen2Tokenizer, which drops a word-level vocabulary)."""
    from transformers import AutoModelForSequenceClassification  # lazy: loads transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = reward_model_config(spec, placeholder_tokenizer(spec).pad_token_id)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory, safe_serialization=True)
    return directory


def input_model(spec: ModelSpec, head: str, *, dtype: Any, pad_token_id: int, device: str = "meta") -> Any:
    """A model given beside the policy (a trainer's ModelInput), of `spec`'s architecture with random weights on
    `device`, built as its `head` says: "score", a one-label sequence classifier as `trl grpo` loads
    reward_model_name_or_path (`reward_model_config`); "lm", a causal LM."""
    import torch  # lazy: loads torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification  # lazy: loads transformers

    if head == "score":
        config, cls = reward_model_config(spec, pad_token_id), AutoModelForSequenceClassification
    else:
        config, cls = spec.hf_config(), AutoModelForCausalLM
    with torch.device(device):
        model = cls.from_config(config, dtype=dtype)
    model.config._name_or_path = spec.name
    return model


def save_random_input_model(spec: ModelSpec, head: str, directory: str | Path) -> Path:
    """Save a model given beside the policy with random weights (`input_model`'s `head`), so the trainer loads it
    by path as `trl <command>` loads it from its YAML key."""
    return save_random_reward_model(spec, directory) if head == "score" else save_random_model(spec, directory)


def placeholder_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerFast:
    """A tokenizer whose vocabulary covers the model's ids, for pre-tokenized data.

    SFTTrainer needs a processing class (for the pad token) even when the dataset is already token ids.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers  # lazy: loads tokenizers
    from transformers import PreTrainedTokenizerFast  # lazy: loads transformers

    vocab_size = spec.vocab_size
    pad_id = _first_int(spec.text_value("pad_token_id"), 0)
    eos_id = _first_int(spec.text_value("eos_token_id"), min(2, vocab_size - 1))
    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    names = {i: f"<t{i}>" for i in (pad_id, eos_id)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=names[eos_id]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=names[pad_id], eos_token=names[eos_id], unk_token=names[eos_id]
    )


def _first_int(value, default: int) -> int:
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if value is not None else default


class BatchFeed:
    """A trainer's dataloader over pre-built batches: yields each once and drops it, so a used batch is freed as
    the real loader's is (the simulator's fake trainer, and a real run of the same batches to compare with it)."""

    def __init__(self, batches: deque) -> None:
        self._batches = batches
        self._n = len(batches)

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        while self._batches:
            yield self._batches.popleft()
