"""Where models and target GPUs come from: the hub, local files, or the profiles that ship in profiles/.

GPU profiles are YAML files (profiles/gpus/*.yaml); model profiles are the public config.json files of
well-known checkpoints (profiles/models/<org>/<name>/config.json), so the advisor works offline.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import socket
import sys
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from .errors import ProfileError, UnknownGPUError, UnknownModelError
from .workload import GPUSpec, ModelSpec


def _profiles_dir() -> Path:
    """$ADVISOR_PROFILES_DIR, else the checkout's profiles/, else the copy installed as `advisor._profiles`."""
    if os.environ.get("ADVISOR_PROFILES_DIR"):
        return Path(os.environ["ADVISOR_PROFILES_DIR"])
    checkout = Path(__file__).resolve().parent.parent / "profiles"
    if checkout.is_dir():
        return checkout
    return Path(__file__).resolve().parent / "_profiles"


PROFILES_DIR = _profiles_dir()

_GPU_KEYS_REQUIRED = (
    "name", "kind", "memory", "bf16_tflops", "fp16_tflops", "fp32_tflops", "memory_bandwidth_gbs",
    "supports_bf16", "supports_flash_attention", "compute_capability", "aliases", "description",
)
_GPU_KEYS_OPTIONAL = ("nvml_names", "interconnect")  # interconnect: advisor/physics/ranks_closed.interconnect
_VENDOR_PREFIXES = ("nvidia", "tesla", "geforce")
# Keys every model config must provide for the estimate (read from text_config for multimodal configs).
_MODEL_KEYS_REQUIRED = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "intermediate_size")


def normalize_gpu_name(name: str) -> str:
    """Case-insensitive, separator-free key: 'NVIDIA H100 80GB HBM3' and 'h100-80gb-hbm3' compare equal."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for prefix in _VENDOR_PREFIXES:
        if key.startswith(prefix) and len(key) > len(prefix):
            key = key[len(prefix):]
    return key


def host_memory_bytes() -> int:
    """Physical memory of this host."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# ---- GPUs ------------------------------------------------------------------------------------------------------


def gpu_profile_problems(data: Any) -> list[str]:
    """Every schema or sanity problem of one parsed GPU profile."""
    if not isinstance(data, Mapping):
        return [f"expected a mapping of keys, got {type(data).__name__}"]
    out = [f"missing key {k!r}" for k in _GPU_KEYS_REQUIRED if k not in data]
    out += [
        f"unknown key {k!r}; known: {', '.join(_GPU_KEYS_REQUIRED + _GPU_KEYS_OPTIONAL)}"
        for k in data if k not in _GPU_KEYS_REQUIRED + _GPU_KEYS_OPTIONAL
    ]
    if out:
        return out
    kind = data["kind"]
    if kind not in ("cuda", "cpu"):
        out.append(f"kind={kind!r}: must be cuda or cpu")
    mem = data["memory"]
    if kind == "cpu" and mem == "auto":
        pass
    elif isinstance(mem, bool) or not isinstance(mem, int) or not 2**30 <= mem <= 2**41:
        out.append(f"memory={mem!r}: must be bytes between 1 GiB and 2 TiB (or 'auto' for cpu)")
    for key in ("bf16_tflops", "fp16_tflops", "fp32_tflops", "memory_bandwidth_gbs"):
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 10_000:
            out.append(f"{key}={v!r}: must be a number in [0, 10000]")
    for key in ("fp16_tflops", "fp32_tflops", "memory_bandwidth_gbs"):
        if isinstance(data[key], (int, float)) and data[key] <= 0:
            out.append(f"{key}={data[key]!r}: must be positive")
    for key in ("supports_bf16", "supports_flash_attention"):
        if not isinstance(data[key], bool):
            out.append(f"{key}={data[key]!r}: must be true or false")
    if isinstance(data["bf16_tflops"], (int, float)) and (data["bf16_tflops"] > 0) != bool(data["supports_bf16"]):
        out.append("bf16_tflops must be > 0 exactly when supports_bf16 is true")
    cc = data["compute_capability"]
    if kind != "cpu" and not (isinstance(cc, str) and re.fullmatch(r"\d+\.\d+", cc)):
        out.append(f"compute_capability={cc!r}: must be a string like \"9.0\" for a cuda device")
    if kind != "cpu" and isinstance(cc, str) and re.fullmatch(r"\d+\.\d+", cc):
        if data["supports_flash_attention"] and float(cc) < 8.0:
            out.append(f"supports_flash_attention=true with compute_capability {cc}: FlashAttention 2 needs >= 8.0")
    for key in ("aliases", "nvml_names"):
        v = data.get(key, [])
        if not isinstance(v, list) or not all(isinstance(a, str) and a for a in v):
            out.append(f"{key}={v!r}: must be a list of names")
    if not isinstance(data["name"], str) or not data["name"]:
        out.append(f"name={data['name']!r}: must be a non-empty string")
    if not isinstance(data["description"], str):
        out.append("description: must be a string")
    return out


def load_gpu_profile(path: Path) -> tuple[GPUSpec, tuple[str, ...]]:
    """A GPU profile and its NVML names; ProfileError names the file and every problem in it."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ProfileError(f"GPU profile {path}: cannot be read as YAML ({exc}); fix or remove the file") from exc
    problems = gpu_profile_problems(data)
    if problems:
        raise ProfileError(f"GPU profile {path}: " + "; ".join(problems))
    memory = host_memory_bytes() if data["memory"] == "auto" else int(data["memory"])
    spec = GPUSpec(
        name=data["name"],
        kind=data["kind"],
        memory_bytes=memory,
        bf16_tflops=float(data["bf16_tflops"]),
        fp16_tflops=float(data["fp16_tflops"]),
        fp32_tflops=float(data["fp32_tflops"]),
        memory_bandwidth_gbs=float(data["memory_bandwidth_gbs"]),
        supports_bf16=bool(data["supports_bf16"]),
        supports_flash_attention=bool(data["supports_flash_attention"]),
        compute_capability=data["compute_capability"],
        aliases=tuple(data["aliases"]),
        description=data["description"],
    )
    return spec, tuple(data.get("nvml_names") or ())


@lru_cache(maxsize=4)
def _gpu_index(root: Path) -> tuple[dict[str, Path], dict[str, tuple[GPUSpec, tuple[str, ...]]]]:
    """Normalized name/alias/NVML name -> file, and file name -> (spec, nvml names). Memory 'auto' is re-read."""
    keys: dict[str, Path] = {}
    specs: dict[str, tuple[GPUSpec, tuple[str, ...]]] = {}
    for path in sorted((root / "gpus").glob("*.yaml")):
        spec, nvml = load_gpu_profile(path)
        specs[str(path)] = (spec, nvml)
        for label in (spec.name, *spec.aliases, *nvml):
            key = normalize_gpu_name(label)
            other = keys.get(key)
            if other is not None and other != path:
                raise ProfileError(
                    f"GPU profile {path}: name or alias {label!r} is also used by {other}; make it unique"
                )
            keys[key] = path
    return keys, specs


def list_gpus(root: Path | None = None) -> list[str]:
    """Names of the shipped GPU profiles (plus 'cpu')."""
    _, specs = _gpu_index(Path(root or PROFILES_DIR))
    return sorted(spec.name for spec, _ in specs.values())


def resolve_gpu(name: str, root: Path | None = None) -> GPUSpec:
    """A profile by name or alias, case-insensitive, ignoring separators; 'cpu' is the host."""
    root = Path(root or PROFILES_DIR)
    keys, _ = _gpu_index(root)
    path = keys.get(normalize_gpu_name(name))
    if path is None:
        known = list_gpus(root)
        specs = _gpu_index(root)[1]
        labels = {key: specs[str(p)][0].name for key, p in keys.items()}
        near = difflib.get_close_matches(normalize_gpu_name(name), list(labels), n=1, cutoff=0.4)
        hint = f" Did you mean {labels[near[0]]!r}?" if near else ""
        raise UnknownGPUError(
            f"--gpu {name!r}: no such GPU profile.{hint} Known: {', '.join(known)} "
            f"(aliases such as H100-80GB and L4 also work; profiles live in {root / 'gpus'})."
        )
    spec, _ = load_gpu_profile(path)  # re-read so that 'auto' memory is measured now
    return spec


def detect_gpu(root: Path | None = None) -> GPUSpec | None:
    """The local GPU (device 0) through NVML, matched to a profile, with NVML's own memory size.

    Returns None when NVML, the driver or a GPU is missing; never raises for that.
    """
    try:
        import pynvml  # lazy: loads pynvml
    except Exception:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        if pynvml.nvmlDeviceGetCount() < 1:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        raw = pynvml.nvmlDeviceGetName(handle)
        nvml_name = raw.decode() if isinstance(raw, bytes) else str(raw)
        memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        try:
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            cc: str | None = f"{major}.{minor}"
        except Exception:
            cc = None
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return match_gpu(nvml_name, memory, cc, root)


def match_gpu(nvml_name: str, memory_bytes: int, compute_capability: str | None, root: Path | None = None) -> GPUSpec:
    """The profile for an NVML device name, else the closest profile of the same architecture (stated)."""
    keys, specs = _gpu_index(Path(root or PROFILES_DIR))
    path = keys.get(normalize_gpu_name(nvml_name))
    if path is not None:
        spec = specs[str(path)][0]
        return dataclasses.replace(spec, memory_bytes=memory_bytes)
    cuda = [s for s, _ in specs.values() if s.is_cuda]
    same_arch = [s for s in cuda if s.compute_capability == compute_capability] or cuda
    base = min(same_arch, key=lambda s: abs(s.memory_bytes - memory_bytes))
    return dataclasses.replace(
        base,
        name=nvml_name,
        memory_bytes=memory_bytes,
        aliases=(),
        description=f"{nvml_name} (no profile; throughput figures borrowed from {base.name})",
    )


# ---- models ----------------------------------------------------------------------------------------------------


def model_config_problems(data: Any) -> list[str]:
    """What keeps a config.json from describing a causal LM the advisor can estimate."""
    if not isinstance(data, Mapping):
        return [f"expected a JSON object, got {type(data).__name__}"]
    if "model_type" not in data:
        return ["missing key 'model_type'"]
    refused = causal_lm_problem(data)
    if refused:
        return [refused]
    text = data.get("text_config") or data
    out = []
    for key in _MODEL_KEYS_REQUIRED:
        v = text.get(key, data.get(key))
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            out.append(f"{key}={v!r}: must be a positive integer")
    if not out:
        from transformers import AutoConfig  # lazy: loads transformers

        try:
            cfg = dict(data)
            AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        except Exception as exc:  # transformers raises ValueError/KeyError/TypeError for bad configs
            out.append(f"transformers cannot build a config from it: {exc}")
    return out


def causal_lm_problem(data: Mapping[str, Any]) -> str | None:
    """Why a config is not a causal LM that TRL's SFTTrainer trains (AutoModelForCausalLM), or None.

    Read against transformers' own MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: the model_type must have a causal-LM
    class, the model must not be an encoder-decoder, and a config's `architectures` (what the checkpoint was
    saved as) must name a causal-LM class: BERT's model_type has one (BertLMHeadModel), but a BertForMaskedLM
    checkpoint is a masked LM.
    """
    from transformers.models.auto.modeling_auto import (  # lazy: loads transformers
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal,
    )
    from transformers.models.auto.modeling_auto import (  # lazy: loads transformers
        MODEL_FOR_MASKED_LM_MAPPING_NAMES as masked,
    )

    model_type = data.get("model_type")
    fix = ("TRL's SFTTrainer trains decoder-only causal LMs (AutoModelForCausalLM), e.g. Qwen/Qwen2.5-0.5B; "
           "choose such a model")
    archs = data.get("architectures") or []
    shown = f"{model_type!r}" + (f" ({', '.join(map(str, archs))})" if archs else "")
    if data.get("is_encoder_decoder") or model_type in ("encoder-decoder", "t5", "mt5", "umt5"):
        return f"model_type {shown} is an encoder-decoder (sequence-to-sequence) model, not a causal LM; {fix}"
    if model_type not in causal:
        return f"model_type {shown} has no causal-LM class in transformers {_transformers_version()}; {fix}"
    if model_type in masked and not data.get("is_decoder"):
        return (f"model_type {shown} is an encoder (bidirectional attention, trained as a masked LM); its causal "
                f"class {causal[model_type]} needs is_decoder=true and a decoder's pretraining; {fix}")
    classes = set(causal.values())
    if isinstance(archs, list) and archs and not any(
        isinstance(a, str) and (a in classes or a.endswith(("ForCausalLM", "LMHeadModel"))) for a in archs
    ):
        return (f"architectures {archs}: not a causal-LM class (transformers' causal LM for {model_type!r} is "
                f"{causal[model_type]}; this checkpoint was saved as another head, e.g. a masked LM or a "
                f"classifier); {fix}")
    return None


def _transformers_version() -> str:
    import transformers  # lazy: loads transformers

    return transformers.__version__


def load_model_config(path: Path, name: str, source: str, local_dir: Path | None) -> ModelSpec:
    """A ModelSpec from a config.json; ProfileError names the file and every problem in it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"model config {path}: cannot be read as JSON ({exc}); fix the file") from exc
    problems = model_config_problems(data)
    if problems:
        raise ProfileError(f"model config {path}: " + "; ".join(problems))
    return ModelSpec(name=name, config=data, source=source, local_dir=local_dir)  # type: ignore[arg-type]


def list_models(root: Path | None = None) -> list[str]:
    """Hub ids whose config.json ships in profiles/models/ (resolvable offline)."""
    base = Path(root or PROFILES_DIR) / "models"
    return sorted(str(p.parent.relative_to(base)) for p in base.glob("*/*/config.json"))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set (by the user, or by `decide_offline` for this run)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


_hub_offline = hub_offline


def _is_local(name: str | None) -> bool:
    return name is None or Path(name).expanduser().exists()


def decide_offline(*names: str | None) -> str | None:
    """Decide once, quickly, whether this run can use the hub; returns a note when it cannot.

    When one of `names` (model, dataset, tokenizer) is not a local path and the hub endpoint does not answer a
    TCP connection within 2 s, HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set for the rest of the process (also in
    huggingface_hub's and datasets' already-imported constants), so huggingface_hub, transformers and datasets
    fail at once from their caches instead of retrying for ~25 s each.
    """
    if _hub_offline() or all(_is_local(n) for n in names) or _hub_reachable():
        return None
    set_offline()
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    return f"the hub ({endpoint}) is not reachable: working offline for this run (HF_HUB_OFFLINE=1)"


def set_offline() -> None:
    """HF_HUB_OFFLINE=1 for this process, including libraries that read it at import time."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    config = sys.modules.get("datasets.config")
    if config is not None:
        config.HF_HUB_OFFLINE = True
        config.HF_DATASETS_OFFLINE = True


@lru_cache(maxsize=1)
def _hub_reachable(timeout_s: float = 2.0) -> bool:
    """A TCP connection to the hub endpoint within `timeout_s`; avoids huggingface_hub's ~25 s of retries."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _from_hub(name: str, local_only: bool) -> ModelSpec | None:
    """The config of a hub id (downloaded, or from the local HF cache); None when unreachable or absent."""
    try:
        from huggingface_hub import hf_hub_download  # lazy: loads huggingface_hub

        path = Path(hf_hub_download(repo_id=name, filename="config.json", local_files_only=local_only))
    except Exception:  # offline, unknown repo, gated repo, bad id: fall back to the shipped profiles
        return None
    if not local_only:
        from transformers import AutoConfig  # lazy: loads transformers

        try:
            AutoConfig.from_pretrained(path.parent)
        except Exception as exc:
            raise ProfileError(f"model config {path} (from the hub, {name}): transformers rejects it: {exc}") from exc
    return load_model_config(path, name, "hub", path.parent)


def resolve_model(name: str, root: Path | None = None, *, flag: str = "--model") -> ModelSpec:
    """A model from a local directory, a config.json, the hub, or offline from profiles/models/. `flag`: the flag
    an error names (--model; --teacher for a distillation teacher)."""
    root = Path(root or PROFILES_DIR)
    path = Path(name).expanduser()
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise UnknownModelError(f"{flag} {name!r}: the directory has no config.json; point at a model directory")
        return load_model_config(cfg, str(path), "local", path.resolve())
    if path.is_file():
        return load_model_config(path, str(path), "local", None)
    looks_like_path = name.endswith(".json") or name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_like_path:
        raise UnknownModelError(f"{flag} {name!r}: no such file or directory; give an existing path or a hub id")

    spec = None if _hub_offline() or not _hub_reachable() else _from_hub(name, local_only=False)
    if spec is None:
        spec = _from_hub(name, local_only=True)
    if spec is not None:
        return spec

    shipped = {m.lower(): m for m in list_models(root)}
    hit = shipped.get(name.lower())
    if hit is not None:
        return load_model_config(root / "models" / hit / "config.json", hit, "profile", None)
    near = difflib.get_close_matches(name, list(shipped.values()), n=1, cutoff=0.5)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    raise UnknownModelError(
        f"{flag} {name!r}: the hub is not reachable (or HF_HUB_OFFLINE is set) and no profile ships for it.{hint} "
        f"Shipped: {', '.join(shipped.values())}. Or point {flag} at a local directory with a config.json, "
        f"or at a config.json file (e.g. {flag} ./my-model/config.json)."
    )


def check_profiles(root: Path | None = None) -> list[str]:
    """Every problem of every file under profiles/ (GPU yaml, model configs, baselines, measurements)."""
    root = Path(root or PROFILES_DIR)
    out: list[str] = []
    for path in sorted((root / "gpus").glob("*")):
        if path.suffix not in (".yaml", ".yml"):
            out.append(f"{path}: not a .yaml file; GPU profiles are profiles/gpus/*.yaml")
            continue
        try:
            load_gpu_profile(path)
        except ProfileError as exc:
            out.append(str(exc))
    try:
        _gpu_index.cache_clear()
        _gpu_index(root)
    except ProfileError as exc:
        out.append(str(exc))
    for path in sorted((root / "models").rglob("*")):
        if path.is_file() and path.name != "config.json":
            out.append(f"{path}: unexpected file; model profiles are profiles/models/<org>/<name>/config.json")
    for path in sorted((root / "models").glob("*/*/config.json")):
        try:
            load_model_config(path, str(path.parent), "profile", None)
        except ProfileError as exc:
            out.append(str(exc))
    for sub in ("baselines", "measurements"):
        for path in sorted((root / sub).glob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                out.append(f"{path}: not valid JSON ({exc})")
                continue
            if not isinstance(data, Mapping) or not ({"schema", "schema_version"} & set(data)):
                out.append(f"{path}: a JSON object with a 'schema' or 'schema_version' key is required")
    return out
