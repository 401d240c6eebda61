"""A real N-process CPU run (gloo, FSDP2 by accelerate's own fsdp2_prepare_model) of TRL's SFTTrainer.train() on a tiny
model; each rank's peak measured from the CPU allocator's own events (torch.profiler, profile_memory=True), plus the
bytes live when train() starts. Run as a script: `python tests/multigpu_worker.py '<json>'`; prints JSON.

The json: {"world": N, "candidate": {...Candidate kwargs}, "parallelism": {...}, "config": {...model config keys},
"steps": 2}.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from collections import deque

HERE = os.path.dirname(os.path.abspath(__file__))


def workload(config: dict | None = None):
    sys.path.insert(0, HERE)
    from conftest import TINY_QWEN2

    from advisor.data import synthetic
    from advisor.workload import Goals, GPUSpec, ModelSpec, Workload

    cpu = GPUSpec(
        name="cpu", kind="cpu", memory_bytes=16 * 2**30, bf16_tflops=0.5, fp16_tflops=0.5, fp32_tflops=0.5,
        memory_bandwidth_gbs=20.0, supports_bf16=True, supports_flash_attention=False,
    )
    model = ModelSpec(name="tiny-qwen2", config={**TINY_QWEN2, **(config or {})}, source="local")
    return Workload(model=model, gpu=cpu,
                    dataset=synthetic(vocab_size=1024, rows=64, seed=0, median=64, max_len=256), goals=Goals())


def _rank(rank: int, world: int, spec: dict, store_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import SFTTrainer

    from advisor.emit import build_config, peft_config
    from advisor.modeling import BatchFeed as _BatchFeed
    from advisor.modeling import build_model, placeholder_tokenizer
    from advisor.parallelism import Parallelism
    from advisor.probing.meters import cpu_peak, memory_profiler
    from advisor.probing.worker import _free_gloo_work_on_this_thread
    from advisor.simulator import (
        prepare_fsdp2,  # the real multi-process probe's (advisor/probing) way in
        worst_batch,
    )
    from advisor.simulator import worst_rows as _worst_rows
    from advisor.space import Candidate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    _free_gloo_work_on_this_thread()  # as the probe of several ranks measures (meters.memory_profiler)
    wl = workload(spec.get("config"))
    cand = Candidate(**spec["candidate"])
    par = Parallelism(**spec.get("parallelism", {}))
    steps = spec.get("steps", 2)

    class RealTrainer(SFTTrainer):
        feed: deque = deque()

        def get_train_dataloader(self):
            return _BatchFeed(self.feed)

    torch.manual_seed(0)
    model = build_model(wl.model, cand, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        args = build_config(
            cand, wl, use_cpu=True, output_dir=tmp, max_steps=steps, report_to="none", save_strategy="no",
            logging_strategy="no", disable_tqdm=True, dataset_num_proc=None, seed=0, model_init_kwargs=None,
        )
        trainer = RealTrainer(
            model=model, args=args, train_dataset=wl.dataset.to_hf(_worst_rows(wl, cand)),
            processing_class=placeholder_tokenizer(wl.model), peft_config=peft_config(cand, wl.model),
        )
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        prepare_fsdp2(trainer.model, mesh, par, cand.precision.value)
        batch = worst_batch(trainer, cand.per_device_train_batch_size)
        n = steps * cand.gradient_accumulation_steps
        trainer.feed = deque(
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()} for _ in range(n)
        )
        trainer.train_dataset = list(range(n))
        live = {}
        tensors = [getattr(t, "_local_tensor", t) for t in list(trainer.model.parameters())
                   + list(trainer.model.buffers())]
        tensors += [v for b in trainer.feed for v in b.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t.untyped_storage().nbytes():
                live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        gc.collect()
        dist.barrier()
        prof = memory_profiler(user_scopes=False)  # gloo's collectives unrecorded (see its docstring)
        try:
            trainer.train()
        finally:
            prof.__exit__(None, None, None)
        # every thread's events, with the frees gloo's worker threads made unseen replayed (its docstring)
        peak = cpu_peak(prof, backend_frees=True).peak_bytes
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"rank": rank, "peak": sum(live.values()) + peak, "before": sum(live.values())}, f)
    dist.barrier()
    dist.destroy_process_group()


def main(spec: dict) -> list[dict]:
    import torch.multiprocessing as mp

    world = spec["world"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peak")
        mp.start_processes(_rank, args=(world, spec, os.path.join(tmp, "store"), out), nprocs=world,
                           start_method="spawn")
        results = []
        for r in range(world):
            with open(f"{out}.{r}") as f:
                results.append(json.load(f))
    return results


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
