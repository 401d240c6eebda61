"""Candidate's rules: each one's text, and that TRL itself agrees (exactly as strict as TRL, no stricter)."""

from __future__ import annotations

import pytest

from advisor.errors import ConfigError
from advisor.space import Candidate, Optimizer, PackingStrategy, Quantization, SearchSpace


@pytest.mark.parametrize(
    ("fields", "text"),
    [
        ({"packing": True, "max_length": None}, "When packing is enabled, `max_length` can't be `None`."),
        ({"padding_free": True, "packing": False, "max_length": 512}, "set max_length=None, enable packing"),
        ({"quantization": "4bit"}, "You cannot perform fine-tuning on purely quantized models"),
        ({"quantization": "8bit"}, "set use_lora=True (QLoRA) or quantization=none"),
        ({"use_lora": True, "lora_target_modules": ("q_proj", "lm_head")}, "Applying a PEFT adapter to `lm_head`"),
        ({"use_lora": True, "lora_target_modules": ()}, "no lora_target_modules"),
        ({"precision": "fp16", "weights_dtype": "float16"}, "Attempting to unscale FP16 gradients"),
    ],
)
def test_rule_text(fields, text):
    problems = Candidate(**fields).problems()
    assert len(problems) == 1
    assert text in problems[0]


def test_device_rules(cpu_target, h100_target):
    cand = Candidate(activation_offloading=True, optim="adamw_bnb_8bit", precision="fp16",
                     attn_implementation="kernels-community/flash-attn2")
    cpu = cand.problems(cpu_target)
    assert any("activation_offloading=True on the CPU" in p for p in cpu)
    assert any("bitsandbytes optimizers need CUDA" in p for p in cpu)
    assert any("fp16 mixed precision needs a GPU" in p for p in cpu)
    assert any("FlashAttention needs CUDA" in p for p in cpu)
    assert cand.problems(h100_target) == []
    t4 = h100_target.__class__(**{**h100_target.__dict__, "name": "T4", "supports_bf16": False,
                                  "supports_flash_attention": False})
    assert any("doesn't support bf16/gpu" in p for p in Candidate().problems(t4))


def test_model_rules(tiny_model):
    problems = Candidate(use_lora=True, lora_target_modules=("qkv",)).problems(model=tiny_model)
    assert len(problems) == 1 and "'qkv'" in problems[0] and "not found in the base model" in problems[0]
    # PEFT accepts a list where at least one module matches: so do we
    assert Candidate(use_lora=True, lora_target_modules=("q_proj", "qkv")).problems(model=tiny_model) == []
    # transformers accepts every_n_layers beyond the depth (it checkpoints layer 0 only): so do we
    assert Candidate(checkpoint_every_n_layers=3).problems(model=tiny_model) == []


def test_every_problem_at_once():
    with pytest.raises(ConfigError) as info:
        Candidate(packing=True, max_length=None, quantization="4bit").check()
    assert len(info.value.problems) == 2
    assert "2 problems" in str(info.value)


def test_construction_validates_types_and_values():
    with pytest.raises(ConfigError) as info:
        Candidate(per_device_train_batch_size=0, optim="sgd-ish", max_length=-1)
    text = str(info.value)
    assert "per_device_train_batch_size=0" in text and "optim='sgd-ish'" in text and "max_length=-1" in text


def test_not_stricter_than_trl():
    # Legal in TRL 1.16: padding-free without packing once max_length is None; wrapped packing + padding-free.
    assert Candidate(padding_free=True, packing=False, max_length=None).problems() == []
    assert Candidate(padding_free=True, packing=True, packing_strategy="wrapped").problems() == []
    assert Candidate(use_lora=True, quantization="4bit").problems() == []


def test_bfd_implies_padding_free_and_canonical_dedup():
    a = Candidate(packing=True, packing_strategy="bfd", padding_free=False)
    b = Candidate(packing=True, packing_strategy="bfd", padding_free=True)
    assert a.effective_padding_free and b.effective_padding_free
    assert a.canonical() == b.canonical()
    assert not Candidate(packing=True, packing_strategy="wrapped").effective_padding_free
    assert Candidate(activation_checkpointing=False, checkpoint_selective=True).canonical() == \
        Candidate(activation_checkpointing=False)


def test_quality_cost():
    q = Candidate(use_lora=True, quantization=Quantization.NF4, weights_dtype="bfloat16", packing=True,
                  packing_strategy=PackingStrategy.WRAPPED).quality_cost(truncated_fraction=0.02)
    assert q.adapters and q.low_precision_weights and q.mixed_examples and not q.neutral
    assert len(q.describe()) == 5
    assert Candidate().quality_cost().neutral


def test_dict_round_trip():
    c = Candidate(optim=Optimizer.ADAFACTOR, use_lora=True, lora_target_modules=["q_proj"])
    assert Candidate.from_dict(c.to_dict()) == c
    with pytest.raises(ConfigError, match="unknown knob 'batch'"):
        Candidate.from_dict({"batch": 3})


def test_search_space_yields_valid_distinct(cpu_target, tiny_model):
    space = SearchSpace({
        "packing": (False, True), "padding_free": (False, True), "max_length": (None, 256),
        "activation_offloading": (False, True), "per_device_train_batch_size": (1, 2),
    })
    cands = list(space.candidates(cpu_target, tiny_model))
    assert len(cands) == len(set(cands))
    assert all(c.problems(cpu_target, tiny_model) == [] for c in cands)
    assert not any(c.activation_offloading for c in cands)
    assert Candidate(packing=True, max_length=None) not in cands
    assert space.fix(packing=True).values["packing"] == (True,)
    with pytest.raises(ConfigError, match="unknown knob"):
        SearchSpace({"nope": (1,)})


def test_public_functions_are_not_shadowed_by_their_modules():
    import advisor
    import advisor.estimator
    import advisor.probing
    import advisor.regress
    import advisor.simulator  # noqa: F401  (binding submodules must not replace the functions)

    for name in ("estimate", "simulate", "probe", "suggest", "check"):
        assert callable(getattr(advisor, name)) and not isinstance(getattr(advisor, name), type(advisor)), name
    assert set(advisor.__all__) <= set(dir(advisor))


def test_requirements_name_the_extra_packages():
    assert Candidate().requirements() == ()
    assert Candidate(optim="paged_adamw_8bit").requirements() == ("bitsandbytes",)
    assert Candidate(use_lora=True, quantization="4bit", attn_implementation="kernels-community/flash-attn2"
                     ).requirements() == ("bitsandbytes", "kernels")
