"""Online RL's vLLM server mode on several GPUs: how --num-gpus splits into the GPUs that train (accelerate's
num_processes) and those that run `trl vllm-serve`, the rules that need the world size, and the split read back
from a run's files. The knob is `vllm_server_gpus` (online_knobs.py, Home.ACCELERATE): TRL's config has no key for
it (the server is launched apart, and `trl grpo --config` refuses a key it does not know), so the TRL file cannot
carry it; the accelerate config's num_processes does."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..space import Candidate


@dataclasses.dataclass(frozen=True)
class GpuSplit:
    """How --num-gpus split in server mode: the training GPUs (accelerate's num_processes, `train_env` before the
    launch) and the `trl vllm-serve` command on the others."""

    train_gpus: int
    train_env: str  # CUDA_VISIBLE_DEVICES=0,1,...
    server_command: str  # CUDA_VISIBLE_DEVICES=... trl vllm-serve --model ... --tensor-parallel-size ...
    chosen: str


class ServerSplit:
    """The split of --num-gpus in vLLM server mode, for a trainer whose `knobs(candidate)` has `served` and
    `vllm_server_gpus` (OnlineRLTrainer)."""

    def knobs(self, candidate: Candidate) -> Any:  # the trainer's (OnlineRLTrainer.knobs)
        raise NotImplementedError

    def check_world(self, candidate: Candidate, num_gpus: int) -> list[str]:
        """TRL's rules that need the world size: server mode leaves at least one of --num-gpus to train."""
        k = self.knobs(candidate)
        out = []
        if k.served and k.vllm_server_gpus >= num_gpus:
            out.append(f"vllm_mode='server' with vllm_server_gpus={k.vllm_server_gpus} of --num-gpus {num_gpus}: "
                       "no GPU is left to train; give vLLM fewer (--fix vllm_server_gpus=K, K < --num-gpus), add "
                       "GPUs, or set vllm_mode: colocate")
        return out

    def gpu_split(self, candidate: Candidate, model_name_or_path: str, num_gpus: int) -> GpuSplit | None:
        """Server mode: the last `vllm_server_gpus` of --num-gpus run `trl vllm-serve` (tensor-parallel over them),
        the first ones train (accelerate's num_processes); None otherwise (every GPU trains)."""
        import shlex

        k = self.knobs(candidate)
        if not k.served:
            return None
        problems = self.check_world(candidate, num_gpus)
        if problems:
            raise ConfigError(problems, context="num_gpus")
        n = k.vllm_server_gpus
        train = ",".join(str(i) for i in range(num_gpus - n))
        serve = ",".join(str(i) for i in range(num_gpus - n, num_gpus))
        cmd = shlex.join(["trl", "vllm-serve", "--model", model_name_or_path, "--tensor-parallel-size", str(n)])
        return GpuSplit(train_gpus=num_gpus - n, train_env=f"CUDA_VISIBLE_DEVICES={train}",
                        server_command=f"CUDA_VISIBLE_DEVICES={serve} {cmd}",
                        chosen=f"vLLM server on GPU(s) {serve}, training on {train}")

    def training_gpus(self, candidate: Candidate, num_gpus: int) -> int:
        """The ranks that train (accelerate's num_processes): --num-gpus less the server's GPUs in server mode."""
        k = self.knobs(candidate)
        return max(1, num_gpus - k.vllm_server_gpus) if k.served else num_gpus

    def world_from_launch(self, candidate: Candidate, num_gpus: int, processes: int | None = None) -> Candidate:
        """A server-mode run read back from its files on `num_gpus` GPUs: the server's GPUs are those the
        accelerate config does not launch (`processes`, its num_processes: the training ranks, when that file is
        given), else the one split two GPUs allow (one serves, one trains). Other candidates as they are."""
        k = self.knobs(candidate)
        if not k.served:
            return candidate
        if processes is not None:
            served = num_gpus - processes
            if served < 1:
                raise ConfigError([
                    f"vllm_mode='server' on --num-gpus {num_gpus} with num_processes {processes} in the accelerate "
                    "config (--accelerate-config): no GPU is left for `trl vllm-serve`; give --num-gpus the "
                    "training GPUs plus the server's (the suggestion's --num-gpus), or set vllm_mode: colocate"])
        elif k.vllm_server_gpus >= 1:
            return candidate  # set where the candidate was built (the search's)
        elif num_gpus == 2:
            served = 1
        elif num_gpus < 2:
            raise ConfigError([
                f"vllm_mode='server' on --num-gpus {num_gpus}: server mode runs `trl vllm-serve` on GPUs of its own "
                "beside those that train; give --num-gpus N (N >= 2: the training GPUs plus the server's; with "
                "N > 2 also --accelerate-config FILE, which says how many train), or set vllm_mode: colocate"])
        else:
            raise ConfigError([
                f"vllm_mode='server' on --num-gpus {num_gpus}: how many of them run `trl vllm-serve` is not in the "
                "TRL file (TRL has no key for it); give --accelerate-config FILE, the accelerate config `advisor "
                "suggest --accelerate-output FILE` wrote beside it (its num_processes train, the other GPUs of "
                "--num-gpus serve)"])
        from ..space import with_knobs

        return with_knobs(candidate, vllm_server_gpus=served)
