"""vLLM's memory terms against vLLM's own rules, on hand-worked cases with real configs (profiles/models/) and real
cards (profiles/gpus/). Every expected number below is worked out by hand in the comment above it, from the rule
named in advisor/physics/vllm.py's docstring (vLLM's file and function)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from advisor import physics as costs
from advisor.errors import ConfigError

# vLLM's closed form, exported by the physics package with a vllm_ prefix (advisor/physics/vllm.py)
BLOCK_SIZE = costs.vllm_BLOCK_SIZE
Mode = costs.vllm_Mode
Pool = costs.vllm_Pool
PoolSplit = costs.vllm_PoolSplit
Refusal = costs.vllm_Refusal
Refused = costs.vllm_Refused
Sleep = costs.vllm_Sleep
Started = costs.vllm_Started
asleep = costs.vllm_asleep
derived_max_model_len = costs.vllm_derived_max_model_len
kv_layout = costs.vllm_kv_layout
min_utilization = costs.vllm_min_utilization
start = costs.vllm_start
training_gpu_peak = costs.vllm_training_gpu_peak
vllm_dtype = costs.vllm_dtype

PROFILES = Path(__file__).resolve().parent.parent / "profiles"
GiB = 2**30


def _config(name: str) -> dict:
    return json.loads((PROFILES / "models" / name / "config.json").read_text())


def _total(gpu: str) -> int:
    return int(yaml.safe_load((PROFILES / "gpus" / f"{gpu}.yaml").read_text())["memory"])


H100 = _total("h100-sxm")  # 85,520,809,984 bytes (NVML's 81,559 MiB)
QWEN05 = _config("Qwen/Qwen2.5-0.5B")
# Qwen2.5-0.5B's parameters: embedding 151,936 x 896 = 136,134,656 (tied head); per layer q 896x896+896 = 803,712,
# k and v 896x128+128 = 114,816 each, o 896x896 = 802,816, MLP 3 x 896 x 4,864 = 13,074,432, two norms 1,792:
# 14,912,384 x 24 = 357,897,216; final norm 896. Total 494,032,768, in bf16 (its config's dtype, which vLLM keeps).
QWEN05_WEIGHTS = 494_032_768 * 2
ACT, NON_TORCH = 1 * GiB, GiB // 2  # the profile run's inputs (measured on a device in practice): round numbers


def test_h100_profile_is_what_the_cases_assume():
    assert H100 == 85_520_809_984
    assert QWEN05["num_hidden_layers"] == 24 and QWEN05["num_key_value_heads"] == 2
    assert QWEN05["hidden_size"] // QWEN05["num_attention_heads"] == 64


def test_qwen05_kv_bytes_per_token_and_page():
    layout = kv_layout(QWEN05)
    # 24 layers x 2 KV heads x (64 + 64) x 2 bytes (bf16) = 12,288 bytes a token; a 16-token page of every layer
    assert layout.dtype == "bfloat16"
    assert layout.bytes_per_token == 12_288
    assert layout.page_bytes() == 16 * 12_288 == 196_608
    # vLLM's max_model_len is the model's own (max_position_embeddings 32,768) when TRL's vllm_max_model_length is
    # None: one request is cdiv(32,768, 16) = 2,048 pages = 402,653,184 bytes
    assert derived_max_model_len(QWEN05) == 32_768
    assert layout.sequence_bytes(32_768) == 2_048 * 196_608 == 402_653_184
    # a sequence of 1,000 tokens takes 63 whole pages, not 62.5
    assert layout.sequence_bytes(1_000) == 63 * 196_608


def test_qwen05_on_h100_at_0_3_splits_the_pool():
    pool = Pool(H100, 0.3)
    # requested_memory = 85,520,809,984 x 0.3 = 25,656,242,995.2 -> 25,656,242,996 bytes
    assert pool.requested_bytes == 25_656_242_996
    outcome = start(pool, free_at_startup=H100 - 3 * GiB, weights_bytes=QWEN05_WEIGHTS, activation_bytes=ACT,
                    non_torch_bytes=NON_TORCH, layout=kv_layout(QWEN05), max_model_len=derived_max_model_len(QWEN05))
    assert isinstance(outcome, Started)
    # KV = 25,656,242,996 - 988,065,536 - 1,073,741,824 - 536,870,912 = 23,057,564,724 bytes
    assert outcome.split.kv_cache_bytes == 23_057_564_724
    # 23,057,564,724 // 196,608 = 117,276 pages of 16 tokens: 1,876,416 tokens; 57 full 32,768-token sequences
    assert outcome.kv_blocks == 117_276
    assert outcome.full_length_sequences == 57
    assert outcome.split.pool_bytes == pool.requested_bytes


def test_free_memory_under_the_pool_is_a_typed_refusal():
    # the training process holds Qwen2.5-0.5B in float32 (1,976,131,072 bytes) and a 0.5 GiB CUDA context when vLLM
    # snapshots the device: 83,007,808,000 bytes free; 0.99 asks for ceil(84,665,601,884.16) = 84,665,601,885
    free = H100 - 494_032_768 * 4 - GiB // 2
    outcome = start(Pool(H100, 0.99), free_at_startup=free, weights_bytes=QWEN05_WEIGHTS, activation_bytes=ACT,
                    non_torch_bytes=NON_TORCH, layout=kv_layout(QWEN05), max_model_len=32_768)
    assert isinstance(outcome, Refused)
    assert outcome.cause is Refusal.POOL_EXCEEDS_FREE
    assert (outcome.needed_bytes, outcome.available_bytes) == (84_665_601_885, free)
    assert "Worker.init_device" in outcome.message and "vllm_gpu_memory_utilization" in outcome.message
    # at 0.97 (82,955,185,685 bytes) the same process fits: vLLM starts
    assert isinstance(start(Pool(H100, 0.97), free_at_startup=free, weights_bytes=QWEN05_WEIGHTS,
                            activation_bytes=ACT, non_torch_bytes=NON_TORCH, layout=kv_layout(QWEN05),
                            max_model_len=32_768), Started)


def test_a_pool_that_cannot_hold_one_full_length_sequence_is_a_typed_refusal():
    llama = _config("meta-llama/Llama-3.1-8B")
    layout = kv_layout(llama)
    # 32 layers x 8 KV heads x (128 + 128) x 2 bytes = 131,072 bytes a token; the model's own max_model_len 131,072
    # needs 8,192 pages of 2,097,152 bytes = 17,179,869,184 bytes (16 GiB) for one request
    assert layout.bytes_per_token == 131_072
    assert derived_max_model_len(llama) == 131_072
    one = layout.sequence_bytes(131_072)
    assert one == 16 * GiB
    # at 0.3 of an H100 with 8.03 B bf16 weights (16,060,522,496 bytes), 1 GiB of activations, 0.5 GiB non-torch:
    # KV = 25,656,242,996 - 16,060,522,496 - 1,610,612,736 = 7,985,107,764; less the null block (2,097,152)
    weights = 8_030_261_248 * 2
    outcome = start(Pool(H100, 0.3), free_at_startup=H100 - GiB, weights_bytes=weights, activation_bytes=ACT,
                    non_torch_bytes=NON_TORCH, layout=layout, max_model_len=derived_max_model_len(llama))
    assert isinstance(outcome, Refused) and outcome.cause is Refusal.SEQUENCE_DOES_NOT_FIT
    assert outcome.needed_bytes == one
    assert outcome.available_bytes == 7_985_107_764 - 2_097_152
    assert "max_model_len=131072" in outcome.message and "vllm_max_model_length" in outcome.message
    # TRL's vllm_max_model_length=4096 makes one request 256 pages (536,870,912 bytes): it starts
    fits = start(Pool(H100, 0.3), free_at_startup=H100 - GiB, weights_bytes=weights, activation_bytes=ACT,
                 non_torch_bytes=NON_TORCH, layout=layout, max_model_len=derived_max_model_len(llama, 4096))
    assert isinstance(fits, Started) and fits.sequence_bytes == 256 * 2_097_152


def test_a_pool_smaller_than_its_weights_leaves_no_kv_memory():
    outcome = start(Pool(H100, 0.1), free_at_startup=H100, weights_bytes=8_030_261_248 * 2, activation_bytes=ACT,
                    non_torch_bytes=NON_TORCH, layout=kv_layout(_config("meta-llama/Llama-3.1-8B")),
                    max_model_len=4096)
    assert isinstance(outcome, Refused) and outcome.cause is Refusal.NO_KV_MEMORY
    assert outcome.available_bytes < 0


def test_sliding_window_layers_of_gemma2():
    gemma = _config("google/gemma-2-2b")
    # float32 in its config: vLLM's "auto" downcasts it to bfloat16 where the card has it, and never to float16
    assert vllm_dtype(gemma) == "bfloat16"
    assert vllm_dtype(gemma, supports_bf16=False) == "float32"
    layout = kv_layout(gemma)
    assert sum(layer.sliding_window is not None for layer in layout.layers) == 13  # even layers of 26
    # a layer: 4 KV heads x (256 + 256) x 2 bytes = 4,096 bytes a token, 65,536 a page.
    # max_model_len 8,192: a full layer 512 pages (33,554,432 bytes); a sliding one min(4,095 + 4,096, 8,192) =
    # 8,191 tokens -> 512 + 1 pages (33,619,968). 13 of each: 873,267,200 bytes
    assert layout.sequence_bytes(8_192) == 13 * 33_554_432 + 13 * 33_619_968 == 873_267_200
    # at 2,048 tokens the window does not bind: 128 pages, and 129 for a sliding layer (the window's start)
    assert layout.sequence_bytes(2_048) == 13 * 128 * 65_536 + 13 * 129 * 65_536


def test_tensor_parallel_splits_kv_heads_and_mla_stores_one_latent():
    assert kv_layout(QWEN05, tensor_parallel_size=2).bytes_per_token == 24 * 1 * 128 * 2
    assert kv_layout(QWEN05, tensor_parallel_size=4).bytes_per_token == 24 * 1 * 128 * 2  # at least one head a rank
    mla = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16", "max_position_embeddings": 163840}
    # (512 + 64) x 2 bytes per layer and token, no separate V
    assert kv_layout(mla).bytes_per_token == 61 * 576 * 2


def test_sleep_lowers_the_peak_by_the_smaller_of_pool_and_training_activations():
    split = PoolSplit(pool_bytes=20 * GiB, weights_bytes=GiB, activation_bytes=GiB, non_torch_bytes=0)
    state = 10 * GiB
    for activations in (4 * GiB, 30 * GiB):  # under the pool, and over it
        awake = training_gpu_peak(Mode.COLOCATE, training_state_bytes=state, training_activation_bytes=activations,
                                  split=split, sleep=Sleep.OFF)
        slept = training_gpu_peak(Mode.COLOCATE, training_state_bytes=state, training_activation_bytes=activations,
                                  split=split, sleep=Sleep.LEVEL_2)
        assert awake.peak_bytes == state + split.pool_bytes + activations
        assert awake.peak_bytes - slept.peak_bytes == min(split.pool_bytes, activations)
    # what stays asleep (non-torch memory, CUDA graphs) is not given back: the drop is min(pool - kept, activations)
    kept = PoolSplit(pool_bytes=20 * GiB, weights_bytes=GiB, activation_bytes=GiB, non_torch_bytes=2 * GiB)
    awake = training_gpu_peak(Mode.COLOCATE, training_state_bytes=state, training_activation_bytes=30 * GiB,
                              split=kept)
    slept = training_gpu_peak(Mode.COLOCATE, training_state_bytes=state, training_activation_bytes=30 * GiB,
                              split=kept, sleep=Sleep.LEVEL_2)
    assert awake.peak_bytes - slept.peak_bytes == 18 * GiB
    assert slept.vllm_during_training_bytes == 2 * GiB


def test_sleep_levels_keep_the_weights_on_the_host_or_nowhere():
    split = PoolSplit(pool_bytes=20 * GiB, weights_bytes=3 * GiB, activation_bytes=GiB, non_torch_bytes=GiB // 2)
    one, two = asleep(split, Sleep.LEVEL_1), asleep(split, Sleep.LEVEL_2)
    assert one.device_bytes == two.device_bytes == GiB // 2
    assert one.host_bytes == 3 * GiB and two.host_bytes == 0  # level 1 backs the weights up in CPU memory
    assert one.released_bytes == two.released_bytes == 20 * GiB - GiB // 2
    assert asleep(split, Sleep.OFF).device_bytes == 20 * GiB


def test_server_mode_counts_no_pool_on_the_training_gpus():
    split = PoolSplit(pool_bytes=20 * GiB, weights_bytes=GiB, activation_bytes=GiB, non_torch_bytes=0)
    served = training_gpu_peak(Mode.SERVER, training_state_bytes=10 * GiB, training_activation_bytes=4 * GiB,
                               split=split)
    generated = training_gpu_peak(Mode.GENERATE, training_state_bytes=10 * GiB, training_activation_bytes=4 * GiB)
    assert served.peak_bytes == generated.peak_bytes == 14 * GiB
    assert served.vllm_during_training_bytes == 0
    with pytest.raises(ConfigError, match="colocate"):
        training_gpu_peak(Mode.COLOCATE, training_state_bytes=0, training_activation_bytes=0)


def test_smallest_utilization_holds_the_generation_batch_and_one_lower_does_not():
    layout = kv_layout(QWEN05)
    common = dict(weights_bytes=QWEN05_WEIGHTS, activation_bytes=ACT, non_torch_bytes=NON_TORCH, layout=layout)
    # 64 completions at once (per_device_train_batch_size 8 x steps_per_generation 8) of 512 + 1,024 tokens: each
    # 96 pages (18,874,368 bytes), 1,207,959,552 bytes and the null block; with vllm_max_model_length=2048 one
    # request of 2,048 (25,165,824 bytes) binds less
    need = min_utilization(H100, sequences=64, sequence_length=1_536, max_model_len=2_048, **common)
    assert need.binding == "generation batch"
    assert need.kv_bytes == 64 * 96 * 196_608 + 196_608
    assert need.pool_bytes == QWEN05_WEIGHTS + ACT + NON_TORCH + need.kv_bytes
    # pool 3,806,834,432 bytes = 0.0445 of the card: 0.05 as emitted
    assert need.value == 0.05 and 0.04 < need.exact <= 0.05
    started = start(Pool(H100, need.value), free_at_startup=H100, max_model_len=2_048, **common)
    assert isinstance(started, Started) and started.split.kv_cache_bytes >= need.kv_bytes
    lower = start(Pool(H100, need.value - 0.01), free_at_startup=H100, max_model_len=2_048, **common)
    assert isinstance(lower, Refused) or lower.split.kv_cache_bytes < need.kv_bytes
    # 8 completions (768 pages) without vllm_max_model_length: the model's 32,768-token request (2,048 pages) binds
    wide = min_utilization(H100, sequences=8, sequence_length=1_536, max_model_len=32_768, **common)
    assert wide.binding == "one max_model_len sequence"
    assert wide.kv_bytes == 2_048 * 196_608 + 196_608


def test_bad_inputs_name_the_setting():
    with pytest.raises(ConfigError, match="vllm_gpu_memory_utilization=1.2"):
        Pool(H100, 1.2)
    with pytest.raises(ConfigError, match="vllm_max_model_length=65536 exceeds the model's 32768"):
        derived_max_model_len(QWEN05, 65_536)
    with pytest.raises(ConfigError, match="exceeds vllm_max_model_length=1024"):
        min_utilization(H100, weights_bytes=0, activation_bytes=0, non_torch_bytes=0, layout=kv_layout(QWEN05),
                        sequences=1, sequence_length=2_000, max_model_len=1_024)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        kv_layout({"model_type": "x", "num_attention_heads": 2, "hidden_size": 8})
    assert BLOCK_SIZE == 16


# ---- online RL's step (advisor/physics/online_costs.py) over the same rules ---------------------------------------
def _online_step(**changes):
    layout = kv_layout(QWEN05)
    side = costs.online_VllmSide(weights_bytes=QWEN05_WEIGHTS, layout=layout, max_model_len=2_048,
                                 activation_bytes=ACT, non_torch_bytes=NON_TORCH, context_bytes=GiB // 2)
    base = dict(parameters=494_032_768, trainable=494_032_768, layers=24, hidden=896, intermediate=4_864, kv_heads=2,
                head_dim=64, vocab=151_936, weights_bytes=4 * GiB, gradient_bytes=2 * GiB, optimizer_bytes=8 * GiB,
                kv_dtype_bytes=2, compute_bytes=2, head_weight_bytes=2, prompt_length=512, max_completion_length=1_024,
                per_device_train_batch_size=8, steps_per_generation=8, num_generations=8, card_bytes=H100,
                engine=Mode.COLOCATE, vllm=side)
    base.update(changes)
    return costs.online_OnlineStep(**base)


def test_online_rl_startup_refuses_exactly_where_free_memory_is_under_the_pool():
    # 0.5 of the card asks ceil(42,760,404,992.0) = 42,760,404,992 bytes. The training process holds 0.5 GiB of
    # context and W of weights at vLLM's snapshot: free = 85,520,809,984 - 536,870,912 - W. vLLM refuses when
    # free < requested (Worker.init_device), so W = 42,223,534,080 starts and one byte more does not.
    w = 42_223_534_080
    assert isinstance(costs.online_vllm_terms(_online_step(vllm_gpu_memory_utilization=0.5, weights_bytes=w)),
                      costs.online_VllmTerms)
    refused = costs.online_vllm_terms(_online_step(vllm_gpu_memory_utilization=0.5, weights_bytes=w + 1))
    assert isinstance(refused, costs.online_VllmRefusal) and refused.cause is Refusal.POOL_EXCEEDS_FREE
    assert (refused.refused.needed_bytes, refused.refused.available_bytes) == (42_760_404_992, 42_760_404_991)
    # the optimizer state (created in train(), after vLLM started) does not count against the snapshot
    assert isinstance(costs.online_vllm_terms(_online_step(vllm_gpu_memory_utilization=0.5, weights_bytes=w,
                                                           optimizer_bytes=40 * GiB)), costs.online_VllmTerms)


@pytest.mark.parametrize("sleep", [Sleep.OFF, Sleep.LEVEL_2])
def test_online_rl_phases_agree_with_training_gpu_peak(sleep):
    # the same colocated step counted by vllm.py's two-phase peak and by online_costs.py's per-phase combination
    state, act, extra = 10 * GiB, 7 * GiB, GiB // 4
    terms = costs.online_vllm_terms(_online_step(vllm_gpu_memory_utilization=0.3, sleep=sleep))
    two = training_gpu_peak(Mode.COLOCATE, training_state_bytes=state, training_activation_bytes=act,
                            generation_extra_bytes=extra, split=terms.split, sleep=sleep)
    per_phase = costs.online_device_peak({"generate": state + extra, "train": state + act}, terms)
    assert per_phase.peak_bytes == two.peak_bytes
    assert per_phase.outside_allocator["train"] == two.vllm_during_training_bytes
    # the split: 25,656,242,996 - 988,065,536 - 1 GiB - 0.5 GiB of KV cache, as test_qwen05_on_h100_at_0_3 works out
    assert terms.split.kv_cache_bytes == 23_057_564_724


# ---- the vLLM releases the model follows, and their CUDA graphs (vLLM 0.21+: inside the pool) ----------------------
def test_the_model_follows_the_vllm_releases_trl_supports():
    """The range TRL 1.16 refuses vLLM outside of (trl/import_utils.py is_vllm_available) is the one the closed form
    was checked against; a TRL that moves it fails here until vllm.py is checked against the new ends."""
    import re

    import trl

    text = (Path(trl.__file__).parent / "import_utils.py").read_text()
    low, high = re.search(r'Version\("([\d.]+)"\) <= _vllm_base_version <= Version\("([\d.]+)"\)', text).groups()
    assert costs.vllm_VLLM_CHECKED == (low, high) == ("0.22.0", "0.31.0")
    assert costs.vllm_VLLM_FOLLOWED == high


def test_cuda_graph_capture_sizes_as_vllm_sets_them():
    sizes, graphs = costs.vllm_cudagraph_capture_sizes, costs.vllm_cudagraph_graphs
    # max_num_seqs 16: up to min(2 x 16, 512, 4,096) = 32: 1, 2, 4, then every 8; 16 (the decode size) is one of them
    assert sizes(16) == (1, 2, 4, 8, 16, 24, 32)
    assert graphs(16).full == (1, 2, 4, 8, 16)  # FULL graphs for uniform decode batches: up to max_num_seqs
    assert sizes(1) == (1, 2)
    # 256: 1, 2, 4, 31 multiples of 8 below 256, 17 multiples of 16 from 256 to 512: 51 sizes, 35 of them <= 256
    big = graphs(256)
    assert len(big.piecewise) == 51 and big.piecewise[-1] == 512 and len(big.full) == 35
    # 300 is appended as the decode size (vLLM 0.31.0; 0.22.0 does not); 1,024 sequences stay at 512 tokens
    assert 300 in sizes(300) and len(sizes(300)) == 52 and len(graphs(300).full) == 38
    assert sizes(1_024) == sizes(256)
    # max_num_batched_tokens below the ceiling caps the sizes and is captured itself
    assert sizes(256, max_num_batched_tokens=100) == (1, 2, 4, *range(8, 97, 8), 100)


def test_cuda_graph_estimate_is_vllms_arithmetic():
    g = costs.vllm_cudagraph_graphs(16)  # 7 PIECEWISE + 5 FULL graphs
    MiB = 2**20
    # the first capture once (both modes overlay one pool) + (7 - 1) + (5 - 1) graphs at the per-graph bytes
    assert g.estimate_bytes(10 * MiB, 3 * MiB) == 10 * MiB + 10 * 3 * MiB
    assert g.estimate_bytes(10 * MiB, 0) == 10 * MiB + 10 * costs.vllm_CUDAGRAPH_MIN_GRAPH_BYTES  # vLLM's 1 MiB floor
    # Qwen2.5-0.5B at max_num_seqs 16: the first capture at 32 tokens x (3 x 4,864 + 4 x 896) x 2 bytes = 1,163,264
    modelled = costs.online_vllm_cudagraph_bytes(hidden=896, intermediate=4_864, max_num_seqs=16, dtype_bytes=2)
    assert modelled == 1_163_264 + 10 * MiB
    assert costs.online_vllm_side(QWEN05, parameters=494_032_768, generation_batch=16).cudagraph_bytes == modelled


def test_cuda_graphs_are_inside_the_pool():
    """Since vLLM 0.21 the KV cache is the pool less the non-KV memory less the CUDA-graph estimate
    (Worker.determine_available_memory), so the same utilization holds fewer pages and the smallest pool grows by it."""
    graphs = 50 * 2**20
    common = dict(free_at_startup=H100, weights_bytes=QWEN05_WEIGHTS, activation_bytes=ACT, non_torch_bytes=NON_TORCH,
                  layout=kv_layout(QWEN05), max_model_len=2_048)
    without = start(Pool(H100, 0.3), **common)
    with_graphs = start(Pool(H100, 0.3), cudagraph_bytes=graphs, **common)
    assert without.split.kv_cache_bytes - with_graphs.split.kv_cache_bytes == graphs
    assert with_graphs.split.pool_bytes == without.split.pool_bytes == Pool(H100, 0.3).requested_bytes
    need = dict(weights_bytes=QWEN05_WEIGHTS, activation_bytes=ACT, non_torch_bytes=NON_TORCH, layout=kv_layout(QWEN05),
                sequences=64, sequence_length=1_536, max_model_len=2_048)
    assert min_utilization(H100, cudagraph_bytes=graphs, **need).pool_bytes == \
        min_utilization(H100, **need).pool_bytes + graphs
    # online RL's colocated vLLM takes them from its side: the KV cache of test_qwen05_on_h100_at_0_3 less them
    side = costs.online_VllmSide(weights_bytes=QWEN05_WEIGHTS, layout=kv_layout(QWEN05), max_model_len=2_048,
                                 activation_bytes=ACT, non_torch_bytes=NON_TORCH, cudagraph_bytes=graphs)
    terms = costs.online_colocated_vllm(side, card_bytes=H100, utilization=0.3, sleep=Sleep.LEVEL_2, startup_bytes=0,
                                        generation_batch=64, prompt_length=512, max_completion_length=1_024)
    assert terms.split.kv_cache_bytes == 23_057_564_724 - graphs
    assert terms.held_bytes("train") == NON_TORCH + graphs  # asleep: what is not under the cumem pool stays


def test_what_stays_asleep_is_the_non_torch_memory_and_the_graphs():
    """vLLM PR 11743's measurement (the PR that brought sleep mode): 79.22 GiB card at 0.90 = 71.29 GiB; weights 2.32,
    non-torch 0.67, activations 1.20, KV 67.11 GiB; in use after sleep 0.93 GiB (79.22 - 78.29 free). Sleep releases
    the cumem pool's allocations (weights, KV) and PyTorch's cache; the non-torch memory and the CUDA-graph pool stay
    and with the process's CUDA context make the 0.93 GiB."""
    g = 2**30
    split = PoolSplit(pool_bytes=round(71.29 * g), weights_bytes=round(2.32 * g), activation_bytes=round(1.20 * g),
                      non_torch_bytes=round(0.67 * g), cudagraph_bytes=0)
    assert abs(split.kv_cache_bytes - round(67.11 * g)) < 0.02 * g  # the logged split, to its rounding
    # the graphs of vLLM's default (max_num_seqs 256) for that 1.24 B model (Llama-3.2-1B: hidden 2,048,
    # intermediate 8,192): 512 tokens x 65,536 bytes + (50 + 34) x 1 MiB = 116 MiB, by our model
    graphs = costs.online_vllm_cudagraph_bytes(hidden=2_048, intermediate=8_192, max_num_seqs=256, dtype_bytes=2)
    assert graphs == 512 * 65_536 + 84 * 2**20
    kept = asleep(PoolSplit(split.pool_bytes, split.weights_bytes, split.activation_bytes, split.non_torch_bytes,
                            graphs), Sleep.LEVEL_2)
    assert kept.device_bytes == split.non_torch_bytes + graphs
    # what the model keeps is within what the PR measured in use; the rest (0.15 GiB) is its own CUDA context
    measured = round(79.22 * g) - round(78.29 * g)
    assert 0 < measured - kept.device_bytes < 0.2 * g
