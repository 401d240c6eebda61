"""The knob registry (advisor/knobs.py): a knob declared once reaches --fix, emit, the read-back and the labels;
use_kernels and activation_checkpointing_kwargs offload go through `trl sft`'s own parser, and their memory and time
move the way the run would."""

from __future__ import annotations

import dataclasses

import pytest

from advisor import knobs
from advisor.emit import build_config, load_run_config, run_config_dict, to_yaml
from advisor.errors import ConfigError
from advisor.knobs import KNOBS, Home, Kind, memory_le
from advisor.search import build_space, parse_fix
from advisor.space import Candidate, with_knobs
from advisor.trainers import get_trainer, names
from advisor.workload import Goals, ModelSpec, Workload


def _other_value(k: knobs.Knob):
    """A valid value other than the knob's default, from its kind alone (so a new knob needs no entry here)."""
    if k.kind is Kind.BOOL:
        return not k.default
    if k.kind is Kind.INT:
        return k.default + 1
    if k.kind is Kind.OPTIONAL_INT:
        return 8 if k.default is None else k.default // 2
    if k.kind is Kind.FLOAT:
        return (k.bounds[0] + k.bounds[1]) / 4
    if k.kind is Kind.MODULES:
        return ("q_proj", "v_proj")
    return next(v for v in k.enum if v != k.default and "flash" not in v.value)


def _where_active(k: knobs.Knob, value) -> Candidate:
    """The default candidate, or one where the knob has an effect (LoRA on, packing on)."""
    for ctx in ({}, {"use_lora": True}, {"packing": True}, {"packing": True, "packing_strategy": "wrapped"}):
        c = Candidate(**ctx)
        if k.is_active(c):
            return c.replace(**{k.name: value})
    raise AssertionError(f"{k.name} is active nowhere")


def test_candidate_fields_are_the_registry():
    assert {f.name for f in dataclasses.fields(Candidate)} - {"base"} == {k.name for k in KNOBS}
    for k in KNOBS:
        assert getattr(Candidate(), k.name) == k.default


def test_the_registry_is_below_candidate():
    """knobs.py imports the value types, not space.py (whose Candidate derives its fields from KNOBS): no circle."""
    import subprocess
    import sys

    code = "import sys, advisor.knobs; print('advisor.space' in sys.modules, 'advisor.trainers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_a_field_without_declaration_fails_loudly():
    @dataclasses.dataclass(frozen=True)
    class Grown(Candidate):
        dpo_beta: float = 0.1

    with pytest.raises(ConfigError) as info:
        knobs.verify(Grown)
    assert "Candidate.dpo_beta has no declaration in advisor/knobs.py KNOBS" in str(info.value)

    @dataclasses.dataclass(frozen=True)
    class Retyped(Candidate):
        use_kernels: int = 0

    with pytest.raises(ConfigError, match="use_kernels is annotated 'int'; its declaration says 'bool'"):
        knobs.verify(Retyped)


@pytest.mark.parametrize("k", KNOBS, ids=[k.name for k in KNOBS])
def test_declared_once_reaches_fix_emit_readback(k, tmp_path):
    value = _other_value(k)
    cand = _where_active(k, value)
    # --fix: its name and TRL's names pin it
    assert k.name in knobs.fix_names()
    for name in (k.name, *knobs.yaml_keys(k)):
        if name in k.extra_fix:
            continue  # TRL's spelling of another value type (bf16=true, load_in_4bit=true): tested in test_search
        text = ",".join(value) if isinstance(value, tuple) else getattr(value, "value", value)
        pins = parse_fix({name: str(text).lower() if isinstance(text, bool) else str(text)})
        assert pins.values[k.name] == (value,), name
    # emit: the YAML differs from the default's, goes through trl sft's parser and reads back to the candidate
    base = _where_active(k, k.default)
    if k.home is Home.ACCELERATE:
        # lives in the accelerate config, not the TRL YAML: the two accelerate configs differ and the TRL YAML is
        # the same (it reads back to the default, what accelerate's own file carries)
        from advisor.accelerate_config import accelerate_config

        def acc(c):
            return accelerate_config(c, c.parallelism.parallelism, 8).yaml

        assert acc(cand) != acc(base)
        assert to_yaml(cand, model_name_or_path="m") == to_yaml(base, model_name_or_path="m")
        return
    yaml_text = to_yaml(cand, model_name_or_path="m")
    assert yaml_text != to_yaml(base, model_name_or_path="m")
    path = tmp_path / "run.yaml"
    path.write_text(yaml_text)
    assert load_run_config(path).candidate == cand
    # the read-back of one knob's key alone gives it
    if k.home in (Home.TRAINING_ARGUMENTS, Home.TRAINER_CONFIG) and k.kind is not Kind.ENUM and not k.extra_fix:
        assert getattr(load_run_config_dict({k.key: k.plain(value), **_context(cand)}), k.name) == value


# Other values a rule between knobs asks for: GRPO / RLOO's generation batch (8 completions at TRL's defaults) holds
# whole groups of num_generations (GRPOConfig refuses 9 completions in groups of 8), and GRPO's own default is 8;
# DistillationConfig refuses a beta outside [0, 1] (GRPO's and RLOO's KL coefficient takes 0.5 too).
# values a knob's rule or meaning picks: teacher_dtype float32 over float32 weights is the teacher's default load
_RULED = {"per_device_train_batch_size": 16, "num_generations": 4, "beta": 0.5, "teacher_dtype": "bfloat16"}


def _accepted() -> list[tuple[str, knobs.Knob]]:
    return [(t, k) for t in names() for k in knobs.registry() if get_trainer(t).accepts(k)]


def _plain(v):
    from enum import Enum

    return v.value if isinstance(v, Enum) else v


@pytest.mark.parametrize(("trainer", "k"), _accepted(), ids=[f"{t}-{k.name}" for t, k in _accepted()])
def test_every_trainers_knob_round_trips_fix_yaml_trl_parser(trainer, k, tmp_path, monkeypatch):
    """Every knob every registered trainer accepts: `--fix` pins it, the trainer's YAML carries it, `trl <command>`'s
    own parser (the trainer's make_parser()) takes that YAML with nothing left over, and what the parser built,
    written back, reads back to the same candidate."""
    import yaml

    tr = get_trainer(trainer)
    value = _RULED.get(k.name, _other_value(k))
    cand = with_knobs(Candidate(), **{k.name: value}) if k.carried else _where_active(k, value)
    base = with_knobs(Candidate(), **{k.name: k.default}) if k.carried else _where_active(k, k.default)
    # --fix: its name and TRL's names pin it, for this trainer
    for name in (k.name, *knobs.yaml_keys(k)):
        if name in k.extra_fix:
            continue  # TRL's spelling of another value type (bf16=true, load_in_4bit=true): tested in test_search
        text = ",".join(value) if isinstance(value, tuple) else getattr(value, "value", value)
        pins = parse_fix({name: str(text).lower() if isinstance(text, bool) else str(text)}, trainer)
        assert pins.values[k.name] == (value,), name
    if k.home is Home.ACCELERATE:  # the accelerate config, not the TRL YAML: see test_declared_once_...
        assert tr.run_config_dict(cand, model_name_or_path="m") == tr.run_config_dict(base, model_name_or_path="m")
        return
    # the YAML: differs from the default's, and reads back to the candidate
    data = tr.run_config_dict(cand, model_name_or_path="m", dataset_name="d")
    assert data != tr.run_config_dict(base, model_name_or_path="m", dataset_name="d")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    from advisor.emit import load_run_config

    assert load_run_config(path, trainer=trainer).candidate == cand
    # trl <command>'s parser: nothing left over, every key it parsed as written; rebuilt from what it parsed, the
    # YAML reads back to the same candidate
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)  # the parser sets the YAML's env: block; restored after the test
    *parsed, config_left, args_left = tr.make_parser().parse_args_and_config(
        ["--config", str(path), "--use_cpu", "True"], return_remaining_strings=True, separate_remaining_strings=True)
    assert config_left == [] and args_left == []
    back = {}
    for key, written in data.items():
        if key == "env":
            back[key] = written
            continue
        owner = next(o for o in parsed if key in {f.name for f in dataclasses.fields(o)})
        got = getattr(owner, key)
        got = [_plain(x) for x in got] if isinstance(got, list) else _plain(got)
        if isinstance(written, dict) and isinstance(got, dict):
            assert {kk: got[kk] for kk in written} == written, key  # TRL may add its own (use_reentrant)
            back[key] = written
            continue
        assert got == written, key
        back[key] = got
    path.write_text(yaml.safe_dump(back, sort_keys=False))
    assert load_run_config(path, trainer=trainer).candidate == cand


def test_a_knob_another_trainer_owns_is_refused_by_name():
    with pytest.raises(ConfigError, match="--fix precompute_ref_log_probs: a knob of dpo, kto, not of trainer 'sft'"):
        parse_fix({"precompute_ref_log_probs": "true"}, "sft")
    with pytest.raises(ConfigError, match="--fix packing: a knob of sft, not of trainer 'reward'"):
        parse_fix({"packing": "true"}, "reward")


def test_a_taken_knob_name_is_refused():
    with pytest.raises(ConfigError, match="max_length already taken"):
        knobs.register_knobs(knobs.Knob("max_length", Kind.INT, 1, Home.TRAINER_CONFIG, "max_length", "x",
                                        carried=True))
    with pytest.raises(ConfigError, match="a trainer's own knob is carried"):
        knobs.register_knobs(knobs.Knob("fresh", Kind.INT, 1, Home.TRAINER_CONFIG, "fresh", "x"))


def test_the_space_takes_each_trainers_values_from_the_declarations(dpo_workload, small_workload):
    """What a trainer searches comes from the knobs' declarations (`search`) and the trainer's (`accepts`: its config
    class's fields; `searches`: what its space holds)."""
    import dataclasses as dc

    from advisor.workload import Method

    dpo = dc.replace(dpo_workload, trainer="dpo")
    for wl in (small_workload, dpo, dc.replace(dpo, trainer="reward")):
        space = build_space(wl, Method.FULL).values
        tr = get_trainer(wl.trainer)
        for k in knobs.registry():
            if k.name not in space:
                assert k.search is None or (k.carried and not tr.accepts(k)), (wl.trainer, k.name)
            elif not tr.searches(k):
                assert space[k.name] == (k.default,), (wl.trainer, k.name)
            elif k.search is not None:
                assert space[k.name] == k.search, (wl.trainer, k.name)
    assert build_space(dpo, Method.FULL).values["precompute_ref_log_probs"] == (False, True)
    assert build_space(dpo, Method.FULL, {"precompute_ref_log_probs": "true"}).values["precompute_ref_log_probs"] == (
        True,)
    reward = build_space(dc.replace(dpo, trainer="reward"), Method.FULL).values
    assert reward["pad_to_multiple_of"] == (None, 8, 64) and "precompute_ref_log_probs" not in reward


def load_run_config_dict(data):
    from advisor.emit import candidate_from_run_dict

    return candidate_from_run_dict(data)


def _context(c: Candidate) -> dict:
    return {"use_peft": True} if c.use_lora else ({"packing": True} if c.packing else {})


def test_labels_come_from_the_declarations():
    on = Candidate(use_kernels=True, checkpoint_offload=True, activation_offloading=True, group_by_length=True,
                   use_lora=True, quantization="4bit", weights_dtype="bfloat16", attn_implementation="eager",
                   parallelism="fsdp2")
    label = knobs.trial_label(on)
    for token in ("8x1", "L=1024", "ckpt=1/1", "ckpt-offload", "offload", "gbl", "lora16/4bit", "bfloat16", "eager",
                  "kernels", "fsdp2"):
        assert token in label.split(), token
    rows = dict(knobs.summary_rows(on))
    assert rows["hub kernels"] == "True" and rows["checkpoint offload"] == "True"
    # a knob at its default that is shown only when on leaves no row
    assert "hub kernels" not in dict(knobs.summary_rows(Candidate()))
    assert {k.label for k in KNOBS if k.summary is not None} <= set(rows)


def test_a_trainers_own_knob_gets_label_and_memory_order_from_its_declaration():
    """DPO's precompute_ref_log_probs (advisor/trainers/dpo.py): the trial cell's token, the report's row, the
    ledger's order, as a shared knob gets them."""
    on = with_knobs(Candidate(), precompute_ref_log_probs=True)
    off = Candidate()
    assert knobs.trial_label(on) == knobs.trial_label(off) + " ref=precomputed"
    dpo = get_trainer("dpo")
    assert knobs.owned_rows(on, dpo) == [["precompute_ref_log_probs", "True"]]
    assert knobs.owned_rows(off, dpo) == [["precompute_ref_log_probs", "False"]]
    assert knobs.owned_rows(on, get_trainer("sft")) == [] and knobs.owned_rows(on, get_trainer("reward")) == []
    assert "precompute_ref_log_probs" in knobs.ordered_names()
    assert memory_le(on, off) and not memory_le(off, on)
    # emitted from the declaration: DPOConfig gets every one of its own knobs explicitly
    kw = get_trainer("dpo").config_kwargs(on)
    assert {k.key: kw[k.key] for k in knobs.registry() if k.carried and dpo.accepts(k)} == {
        "precompute_ref_log_probs": True, "precompute_ref_batch_size": None, "sync_ref_model": False}


def _values(k: knobs.Knob) -> list:
    if k.kind in (Kind.ENUM, Kind.OPTIONAL_ENUM):
        return [v for v in k.enum if v != k.default]
    return [_other_value(k)]


@pytest.mark.parametrize("k", KNOBS, ids=[k.name for k in KNOBS])
def test_declared_quality_cost_is_what_quality_cost_reports(k):
    """A knob declared quality-neutral never changes Candidate.quality_cost(); one with a quality cost does for
    some value (max_length through the data's truncation, which quality_cost takes as an argument)."""
    if k.name == "max_length":
        assert k.quality and Candidate().quality_cost(truncated_fraction=0.01).describe()
        return
    ctx = _where_active(k, k.default)
    changed = [ctx.replace(**{k.name: v}).quality_cost() != ctx.quality_cost() for v in _values(k)]
    assert any(changed) == bool(k.quality), k.name


def test_canonical_resets_what_the_declarations_call_inactive():
    c = Candidate(activation_checkpointing=False, checkpoint_offload=True, checkpoint_selective=True,
                  use_lora=False, lora_r=4)
    canon = c.canonical()
    assert (canon.checkpoint_offload, canon.checkpoint_selective, canon.lora_r) == (False, False, 16)
    assert Candidate(checkpoint_offload=True).canonical().checkpoint_offload is True


def test_new_knobs_at_default_keep_the_study_keys():
    """Stored studies and baselines were keyed without use_kernels / checkpoint_offload."""
    d = Candidate().to_dict()
    assert "use_kernels" not in d and "checkpoint_offload" not in d
    assert Candidate(use_kernels=True).to_dict()["use_kernels"] is True
    assert Candidate.from_dict(d) == Candidate()


def test_memory_order_of_offloaded_checkpoints():
    """What the ledger bounds with (a failure bounds every candidate that needs at least as much)."""
    plain, off = Candidate(), Candidate(checkpoint_offload=True)
    assert memory_le(off, plain) and not memory_le(plain, off)
    # no checkpointing needs at least what offloaded full checkpointing needs; selective is not below full
    assert memory_le(off, Candidate(activation_checkpointing=False))
    assert not memory_le(Candidate(checkpoint_selective=True, checkpoint_offload=True), plain)
    assert memory_le(Candidate(checkpoint_every_n_layers=2, checkpoint_offload=True),
                     Candidate(checkpoint_every_n_layers=2))
    assert "checkpoint_offload" in knobs.ordered_names() and "use_kernels" not in knobs.ordered_names()


def _parse_like_trl_sft(path):
    from trl.scripts.sft import make_parser

    return make_parser().parse_args_and_config(
        ["--config", str(path), "--use_cpu", "True"], return_remaining_strings=True, separate_remaining_strings=True
    )


def test_new_knobs_through_trl_sft_parser_with_nothing_left(tmp_path):
    cand = Candidate(use_kernels=True, checkpoint_offload=True, checkpoint_every_n_layers=2,
                     base={"model_init_kwargs": {"revision": "main"}})
    data = run_config_dict(cand, model_name_or_path="m")
    # model_init_kwargs reaches the YAML: the knob and the user's own loading key
    assert data["model_init_kwargs"] == {"revision": "main", "use_kernels": True}
    assert data["activation_checkpointing_kwargs"] == {"use_reentrant": False, "every_n_layers": 2, "offload": True}
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(cand, model_name_or_path="m", dataset_name="trl-lib/Capybara"))
    script, training, model, _mixture, config_left, args_left = _parse_like_trl_sft(path)
    assert config_left == [] and args_left == []
    assert training.model_init_kwargs == {"revision": "main", "use_kernels": True}
    assert training.activation_checkpointing_kwargs["offload"] is True
    assert training.activation_checkpointing_kwargs["every_n_layers"] == 2
    assert load_run_config(path).candidate == cand
    # off: written explicitly, read back off
    plain = tmp_path / "plain.yaml"
    plain.write_text(to_yaml(Candidate(), model_name_or_path="m"))
    _s, training, *_rest = _parse_like_trl_sft(plain)
    assert training.model_init_kwargs == {"use_kernels": False}
    assert "offload" not in training.activation_checkpointing_kwargs
    assert load_run_config(plain).candidate == Candidate()


def test_sft_config_keeps_the_offload_key_for_transformers():
    """TRL 1.16 passes activation_checkpointing_kwargs on; transformers' Trainer pops `offload` from it."""
    import inspect

    import transformers

    args = build_config(Candidate(checkpoint_offload=True), output_dir="x", use_cpu=True)
    assert args.activation_checkpointing_kwargs["offload"] is True
    assert 'gc_kwargs.pop("offload", False)' in inspect.getsource(transformers.Trainer)


def test_fix_names_for_the_new_knobs():
    pins = parse_fix({"activation_checkpointing_kwargs.offload": "true", "use_kernels": "true"})
    assert pins.values == {"checkpoint_offload": (True,), "use_kernels": (True,)}
    with pytest.raises(ConfigError, match="--fix use_kernels=maybe: not a boolean"):
        parse_fix({"use_kernels": "maybe"})


def test_offload_on_the_cpu_is_refused(cpu_target, h100_target):
    cand = Candidate(checkpoint_offload=True)
    assert any("pin_memory=True requires a CUDA" in p for p in cand.problems(cpu_target))
    assert cand.problems(h100_target) == []
    assert Candidate(use_kernels=True).requirements() == ("kernels",)


def test_default_space_offers_kernels_only_where_importable(tiny_model, h100_target, tiny_data, monkeypatch):
    from advisor.workload import Method

    wl = Workload(model=tiny_model, gpu=h100_target, dataset=tiny_data, goals=Goals())
    monkeypatch.setattr(knobs, "kernels_available", lambda: False)
    assert "use_kernels" not in build_space(wl, Method.FULL).values
    monkeypatch.setattr(knobs, "kernels_available", lambda: True)
    assert build_space(wl, Method.FULL).values["use_kernels"] == (False, True)
    assert build_space(wl, Method.FULL, {"use_kernels": "false"}).values["use_kernels"] == (False,)
    assert "checkpoint_offload" not in build_space(wl, Method.FULL).values
    cpu = dataclasses.replace(wl, gpu=dataclasses.replace(h100_target, kind="cpu", name="cpu"))
    assert "use_kernels" not in build_space(cpu, Method.FULL).values


# ---- memory and time ---------------------------------------------------------------------------------------------

@pytest.fixture
def long_workload(tiny_model, h100_target, tiny_data):
    """Six tiny layers, long rows: activations dominate the peak, so the modelled savings are not capped."""
    spec = ModelSpec(name="tiny6", config={**tiny_model.config, "num_hidden_layers": 6}, source="local")
    return Workload(model=spec, gpu=h100_target, dataset=tiny_data, goals=Goals())


BASE = dict(max_length=256, per_device_train_batch_size=8, precision="bf16", optim="adamw_torch")


def _layer_inputs(model_spec: ModelSpec, rows: int, seq: int, every_n: int) -> list[int]:
    """Bytes of each checkpointed decoder layer's input hidden states, from a real CPU forward of the model under
    bf16 autocast (an independent count: the tensors as transformers hands them to the layers)."""
    import torch

    from advisor.modeling import build_model

    model = build_model(model_spec, Candidate(**BASE), device="cpu")
    seen: list[int] = []
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if i % every_n == 0:
            layer.register_forward_pre_hook(lambda m, args, kw: seen.append(
                (args[0] if args else kw["hidden_states"]).nbytes), with_kwargs=True)
    ids = torch.randint(3, 1000, (rows, seq))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)
    return seen


def test_offloaded_checkpoints_lower_the_peak_by_the_checkpointed_inputs(long_workload):
    from advisor.simulator import simulate

    plain = simulate(long_workload, Candidate(**BASE))
    off = simulate(long_workload, Candidate(**BASE, checkpoint_offload=True))
    rows, seq = (int(x) for x in off.peak_batch.split(" ")[0::2][:2])
    inputs = _layer_inputs(long_workload.model, rows, seq, every_n=1)
    assert len(inputs) == 6
    # every checkpointed input on the host but the one of the layer being recomputed
    assert plain.peak_bytes - off.peak_bytes == sum(inputs) - inputs[-1]
    assert any("save_on_cpu" in n and "modelled" in n for n in off.notes)
    # its copies run on the compute stream (the tiny model's step is host-bound, so not slower here: see the
    # estimate's test on a real architecture)
    assert off.time_breakdown["offload_copies"] > 0 and "offload_copies" not in plain.time_breakdown
    assert off.step_time_s >= plain.step_time_s


def test_offload_with_every_n_layers_counts_the_checkpointed_layers(long_workload):
    from advisor.simulator import simulate

    plain = simulate(long_workload, Candidate(**BASE, checkpoint_every_n_layers=2))
    off = simulate(long_workload, Candidate(**BASE, checkpoint_every_n_layers=2, checkpoint_offload=True))
    rows, seq = (int(x) for x in off.peak_batch.split(" ")[0::2][:2])
    inputs = _layer_inputs(long_workload.model, rows, seq, every_n=2)
    assert len(inputs) == 3
    assert plain.peak_bytes - off.peak_bytes == sum(inputs) - inputs[-1]


def _rmsnorm_extra_saved_per_element(hidden: int, dtype) -> float:
    """What torch's Qwen2RMSNorm saves beyond its input, its weight and its rstd, per element (saved_tensors_hooks
    on real tensors): the bytes Liger's RMSNorm, which saves (X, W, RSTD) only, does not keep."""
    import torch
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(hidden).to(dtype)
    x = torch.randn(2, 8, hidden, dtype=dtype, requires_grad=True) * 1
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    x_ptr, w_ptr = x.untyped_storage().data_ptr(), norm.weight.untyped_storage().data_ptr()
    extra = sum(n for p, (n, shape) in saved.items() if p not in (x_ptr, w_ptr) and shape[-1] == hidden)
    return extra / x.numel() - (x.element_size() if x_ptr not in saved else 0)


def test_hub_kernels_lower_the_peak_by_torchs_extra_rmsnorm_tensors(long_workload, cpu_target):
    import torch

    from advisor.simulator import simulate

    nockpt = dict(BASE, activation_checkpointing=False, weights_dtype="bfloat16")
    plain = simulate(long_workload, Candidate(**nockpt))
    kern = simulate(long_workload, Candidate(**nockpt, use_kernels=True))
    rows, seq = (int(x) for x in kern.peak_batch.split(" ")[0::2][:2])
    h = long_workload.model.hidden_size
    per_elem = _rmsnorm_extra_saved_per_element(h, torch.bfloat16)
    assert per_elem == 4
    # two RMSNorms a layer, six layers kept (none checkpointed)
    assert plain.peak_bytes - kern.peak_bytes == per_elem * rows * seq * 2 * h * 6
    assert any("use_kernels" in n and "modelled" in n for n in kern.notes)
    # the tiny model's elementwise kernels all sit at their launch floor, so the bytes Liger saves cannot show in
    # its time (never more); the saving on a real architecture is test_estimate_moves_the_same_way's
    assert kern.time_breakdown["memory_bound"] <= plain.time_breakdown["memory_bound"]
    # float32 weights under autocast: the same 4 bytes
    assert _rmsnorm_extra_saved_per_element(h, torch.float32) == 4
    # on the CPU transformers has no training kernel for it: nothing changes
    cpu_wl = dataclasses.replace(long_workload, gpu=cpu_target)
    cpu_nockpt = dict(nockpt, precision="fp32", weights_dtype="float32")
    assert simulate(cpu_wl, Candidate(**cpu_nockpt, use_kernels=True)).peak_bytes == \
        simulate(cpu_wl, Candidate(**cpu_nockpt)).peak_bytes


def test_estimate_moves_the_same_way(h100_target):
    """On a real architecture (Qwen2.5-0.5B's config) the step is device-bound: the times move too."""
    from advisor.data import synthetic
    from advisor.estimator import estimate, memory_parts
    from advisor.profiles import resolve_model

    spec = resolve_model("Qwen/Qwen2.5-0.5B")
    wl = Workload(model=spec, gpu=h100_target, dataset=synthetic(spec.vocab_size, rows=64, median=512, max_len=2048),
                  goals=Goals())
    cand = dict(BASE, max_length=2048)
    plain = estimate(wl, Candidate(**cand))
    off = estimate(wl, Candidate(**cand, checkpoint_offload=True))
    rows, seq = (int(x) for x in off.peak_batch.split("x"))
    saved = memory_parts(wl, Candidate(**cand)).activations - memory_parts(wl, Candidate(**cand,
                                                                                        checkpoint_offload=True)).activations
    assert saved == 23 * rows * seq * spec.hidden_size * 4  # 24 checkpointed inputs, one back for its recompute
    assert off.peak_bytes <= plain.peak_bytes
    assert off.step_time_s > plain.step_time_s
    nockpt = dict(cand, activation_checkpointing=False)
    kern = estimate(wl, Candidate(**nockpt, use_kernels=True))
    base = estimate(wl, Candidate(**nockpt))
    rows, seq = (int(x) for x in kern.peak_batch.split("x"))
    saved = memory_parts(wl, Candidate(**nockpt)).activations - memory_parts(wl, Candidate(**nockpt,
                                                                                          use_kernels=True)).activations
    assert saved == 4 * rows * seq * 2 * spec.hidden_size * 24
    assert kern.peak_bytes <= base.peak_bytes
    assert kern.step_time_s < base.step_time_s
