"""What our rules say TRL rejects, TRL rejects; what we allow, TRL trains (tiny model, CPU)."""

from __future__ import annotations

import pytest

from advisor.emit import build_config, peft_config
from advisor.modeling import build_model, placeholder_tokenizer
from advisor.space import Candidate


def _trainer(candidate, tiny_model, tiny_data, tmp_path, **over):
    from trl import SFTTrainer

    args = build_config(
        candidate, None, output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to="none",
        save_strategy="no", logging_steps=1, dataloader_num_workers=0, **over,
    )
    return SFTTrainer(
        model=build_model(tiny_model, candidate), args=args, train_dataset=tiny_data.to_hf(),
        processing_class=placeholder_tokenizer(tiny_model), peft_config=peft_config(candidate, tiny_model),
    )


@pytest.mark.parametrize(
    ("fields", "trl_text"),
    [
        ({"padding_free": True, "packing": False, "max_length": 128}, "`max_length` is not enforced"),
        ({"packing": True, "max_length": None}, "`max_length` can't be `None`"),
        ({"use_lora": True, "lora_target_modules": ("q_proj", "lm_head")}, "PEFT adapter to `lm_head`"),
    ],
)
def test_trl_raises_where_we_say(fields, trl_text, tiny_model, tiny_data, tmp_path):
    cand = Candidate(precision="fp32", **fields)
    assert cand.problems()
    with pytest.raises(ValueError, match=trl_text.replace("`", ".").replace("(", ".").replace(")", ".")):
        _trainer(cand, tiny_model, tiny_data, tmp_path).train()


@pytest.mark.parametrize(
    "fields",
    [
        {"padding_free": True, "packing": False, "max_length": None},
        {"packing": True, "packing_strategy": "wrapped", "padding_free": True, "max_length": 128},
        {"packing": True, "packing_strategy": "bfd_split", "max_length": 128},
        {"use_lora": True, "lora_target_modules": ("q_proj", "v_proj"), "checkpoint_selective": True},
    ],
)
def test_trl_accepts_what_we_allow(fields, tiny_model, tiny_data, tmp_path):
    cand = Candidate(precision="fp32", per_device_train_batch_size=2, **fields)
    assert cand.problems() == []
    out = _trainer(cand, tiny_model, tiny_data, tmp_path).train()
    assert out.global_step == 1
