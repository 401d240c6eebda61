"""The fake run's ops costed as the kernels a GPU runs for them: TimingHook on StorageTracker.on_op, the worst
batch's layout (the package docstring: "Kernels").

Only device traffic is priced: what a kernel reads and writes in device memory, never a buffer it only allocates
and never what crosses the network (the communication model prices that, advisor/physics/ranks_closed.comm_time_s).

op family                                      how it is priced
---------------------------------------------  ----------------------------------------------------------------
views (`is_view`), allocations (`empty*`,      host time of a view: no kernel, no bytes
  `new_empty*`), `detach`, `alias`, `set_`,
  `_unsafe_view`, `resize_`
matmuls (`mm`, `addmm`, `bmm`, `baddbmm`...)   a GEMM (`gemm_s`: roofline with wave quantisation)
attention (FlashAttention, sdpa, efficient)    per query x key tile a sequence computes
gathers (`embedding`, `index_select`...)       the gathered rows read and written, plus the indices
c10d collectives (`_allgather_base_`,          host time of one launch, no memory-bound time: their time is the
  `_reduce_scatter_base_`, `allreduce_`...,    communication model's (ranks_closed.comm_time_s), with its overlap
  fake or real)
`fsdp.all_gather_copy_in`                      its real copy: the shard's all-gather inputs read and written into
                                               their slice of the all-gather buffer (the buffer it is handed is
                                               allocated, not written)
`fsdp.split_with_sizes_copy` (copy-out),       their real copy: the source read, the `out=` tensors written
  `fsdp.chunk_cat` (reduce-scatter copy-in)    (FSDP2's ops: once per micro-step, the FIXED basis)
copies (`copy_`, `_foreach_copy_`,             the source read, the destination written (not read)
  `_to_copy`)
in-place and `out=` ops                        each input read once, each mutated argument written once (and
                                               read, unless write-only: `copy_`, `fill_`, `zero_`, `out=`)
everything else (elementwise, reductions)      the inputs read, the fresh outputs written; an output sharing an
                                               input's storage (a view, an in-place result) is not traffic again
TRL's chunked LM head (CUDA)                   its tile GEMMs in 16-bit, its Triton folds as 1.5 passes per
                                               logits tile (`_lm_head`)
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..physics import (
    _NB,
    _TERMS,
    AttentionKind,
    Basis,
    BatchPoint,
    OpClass,
    OptimizerCost,
    StepCost,
    Term,
    TraceBuilder,
    attention_tile_s,
    attention_units,
    dequant_s,
    gemm_s,
    memory_s,
    op_class,
    time_constants,
)

if TYPE_CHECKING:
    from ..workload import GPUSpec

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addmm_", "addbmm"}
_GATHERS = {"embedding", "index_select", "gather", "index", "take_along_dim"}
_NO_KERNEL = {"empty", "new_empty", "empty_like", "empty_strided", "lift_fresh", "_local_scalar_dense", "detach",
              "alias", "_unsafe_view", "set_", "resize_", "new_empty_strided", "lift_fresh_copy"}
# ops that write their mutated argument without reading it
_WRITE_ONLY = {"copy_", "_foreach_copy_", "fill_", "zero_", "_foreach_zero_", "_foreach_fill_", "normal_", "uniform_",
               "random_", "bernoulli_", "exponential_"}
# the collectives' namespace: priced by the communication model only (advisor/physics/ranks_closed.comm_time_s)
_COLLECTIVES = "c10d"
# ops whose result the host reads (or whose output size depends on the data): the host waits for the device to drain
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                      "unique_consecutive", "unique_dim", "equal", "bincount"})


def is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether dispatching `func` makes the host wait for the device: its value is read (`.item()`, `bool()`,
    `.tolist()`: `_local_scalar_dense`) or its output's size is the data's (nonzero, boolean indexing, unique,
    repeat_interleave without output_size, ...)."""
    import torch  # lazy: loads torch

    name = func._overloadpacket.__name__
    if name == "repeat_interleave":
        return func._overloadname != "self_int" and kwargs.get("output_size") is None
    if name == "index" and len(args) > 1 and isinstance(args[1], (list, tuple)):
        return any(isinstance(i, torch.Tensor) and i.dtype is torch.bool for i in args[1])
    return name in SYNC_OPS


def traffic_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """Bytes a memory-bound kernel reads and writes in device memory (the module docstring's table): inputs read once,
    mutated arguments written once (and read unless write-only), fresh outputs written; outputs that share an
    input's storage (views, in-place results) are not counted again; a collective moves none through the memory-bound
    term; FSDP2's copy-in writes only this rank's slice of the buffer it is handed."""
    from .tracker import tensors_in  # lazy: loads torch

    if getattr(func, "namespace", "") == _COLLECTIVES:
        return 0.0
    name = func._overloadpacket.__name__
    if getattr(func, "namespace", "") == "fsdp" and name == "all_gather_copy_in":
        inputs = tensors_in(args[0] if args else kwargs.get("all_gather_inputs"))
        return 2.0 * float(sum(x.numel() * x.element_size() for x in inputs))
    reads: list = []
    writes: list = []
    schema = func._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    bound = list(zip(positional, args, strict=False)) + [
        (a, kwargs[a.name]) for a in schema.arguments if a.name in kwargs]
    for arg, value in bound:
        ts = tensors_in(value)
        if not ts:
            continue
        if arg.is_out:
            writes.extend(ts)
        elif arg.alias_info is not None and arg.alias_info.is_write:
            writes.extend(ts)
            if name not in _WRITE_ONLY:
                reads.extend(ts)
        else:
            reads.extend(ts)
    seen = {_storage_key(x) for x in reads} | {_storage_key(x) for x in writes}
    for x in tensors_in(out):
        key = _storage_key(x)
        if key not in seen:
            seen.add(key)
            writes.append(x)
    return float(sum(x.numel() * x.element_size() for x in reads) + sum(x.numel() * x.element_size() for x in writes))


def _storage_key(t: Any) -> int:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def _in_trl_kernels(depth: int = 16) -> bool:
    """Called from TRL's chunked log-prob head (its frames sit within a few of the dispatch)."""
    frame = sys._getframe(2)
    while frame is not None and depth:
        if frame.f_globals.get("__name__", "").startswith("trl.kernels"):
            return True
        frame = frame.f_back
        depth -= 1
    return False


@dataclass(frozen=True)
class BatchLayout:
    """The worst batch as the kernels see it: rows x seq positions, its sequences and labelled positions."""

    rows: int
    seq: int
    sequences: tuple[int, ...]  # lengths of the attention sequences (per row, or per packed document)
    trained: int
    flat: bool  # padding-free: one row of concatenated sequences

    @property
    def tokens(self) -> int:
        return self.rows * self.seq


def layout_of(batch: dict) -> BatchLayout:
    """From the collated (real) batch: the sequences come from the attention mask, or from `position_ids` resets
    (padding-free), as FlashAttention's varlen path derives `cu_seqlens`."""
    import torch  # lazy: loads torch

    ids = batch["input_ids"]
    rows, seq = int(ids.shape[0]), int(ids.shape[1])
    labels = batch["labels"][:, 1:]
    trained = int((labels != -100).sum())
    mask = batch.get("attention_mask")
    if mask is not None:
        seqs = tuple(int(x) for x in mask.sum(-1).tolist())
        return BatchLayout(rows, seq, seqs, trained, False)
    pos = batch.get("position_ids")
    if pos is None:
        return BatchLayout(rows, seq, (seq,) * rows, trained, False)
    seqs: list[int] = []
    for row in pos:
        starts = torch.nonzero(row == 0).flatten().tolist() or [0]
        bounds = [*starts, len(row)]
        seqs.extend(int(b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a)
    return BatchLayout(rows, seq, tuple(seqs), trained, True)


def _is_flash(name: str) -> bool:
    return ("flash_attention" in name or "flash_attn" in name) and "scaled_dot_product" not in name


def _is_attention(name: str) -> bool:
    return _is_flash(name) or "scaled_dot_product" in name or "efficient_attention" in name


class TimingHook:
    """Costs every op of the recorded micro-steps (hook it into StorageTracker.on_op, its syncs into on_sync) as the
    two queues run them: per op its host time (this host's cost per op of its class, plus a kernel launch on CUDA),
    its kernel's device time by term and basis, whether the host waits there; in issue order (an OpTrace per
    micro-step, its ops tagged with the decoder layer running).

    Only the micro-steps of the last optimizer step are recorded (`begin_micro`), each from its `training_step` to the
    next one or to the gradient clipping (`end_micro`): the Trainer's nan check of the loss is in it. The clipping,
    the optimizer and zero_grad are costed analytically (optimizer_cost), because the CPU fake run takes the
    for-loop path whatever the target.
    """

    def __init__(self, gpu: GPUSpec, layout: BatchLayout, attn: str, quantized: str | None = None,
                 model: Any = None) -> None:
        self.tc = time_constants(gpu)
        self.gpu = gpu
        self.layout = layout
        self.attn = attn
        self.quantized = quantized
        self.model = model
        self.recording = False
        self.micro_steps = 0
        self.traces: list = []  # one OpTrace per recorded micro-step
        self._trace: TraceBuilder | None = None
        self._op: int | None = None  # the trace row of the op being costed
        self.ops = 0
        self.launches = 0
        self.views = 0
        self.syncs = 0
        self.tracker: Any = None  # the StorageTracker whose decoder layer tags the ops (bind)
        self._backward_seen = False
        self.kind: AttentionKind | None = None
        self._param_shapes: set[tuple[int, ...]] | None = None
        self._quant_keys: dict[int, int] | None = None
        self._attn_dims = {layout.seq}
        self.memory_bytes: dict[str, float] = {}  # memory-bound bytes by op ("namespace::name"), recorded micro-steps
        # the head's row counts: every position (CPU), or the labelled ones (CUDA), in chunks of 4096
        counts = {layout.trained, layout.tokens, layout.tokens - layout.rows}
        self._head_dims = {d for n in counts if n > 0 for d in (n, min(n, 4096), n % 4096) if d > 0}

    # -- phases --
    def bind(self, tracker: Any) -> None:
        """The tracker whose `layer` (the decoder layer running, advisor/simulator/layers.py) tags each op."""
        self.tracker = tracker

    def begin_micro(self, record: bool) -> None:
        self.end_micro()
        self.recording = record
        self._backward_seen = False
        if record:
            self.micro_steps += 1
            self._trace = TraceBuilder()

    def end_micro(self) -> None:
        """Close the micro-step being recorded (at the next one, or where the optimizer step begins)."""
        if self._trace is not None:
            self.traces.append(self._trace.build(layers=0, sync_s=self.tc.sync_s))
            self._trace = None
        self.recording = False

    @property
    def device(self) -> np.ndarray:
        """(terms, bases): device seconds of the recorded ops at the worst batch (every micro-step's, summed)."""
        traces = list(self.traces)
        if self._trace is not None:
            traces.append(self._trace.build())
        return sum((t.device_matrix() for t in traces), np.zeros((len(_TERMS), _NB)))

    @property
    def host(self) -> float:
        """Host seconds of the recorded ops (the closed micro-steps' and the open one's)."""
        open_ = float(sum(self._trace.host)) if self._trace is not None else 0.0
        return float(sum(t.host_s for t in self.traces)) + open_

    def _layer(self) -> int:
        """The decoder layer of the op being dispatched: the tracker's (set by the layers' forward hooks and by the
        gradient hooks of their outputs), except after the backward, where the tracker keeps the last layer's."""
        import torch  # lazy: loads torch

        if torch._C._current_autograd_node() is not None:
            self._backward_seen = True
        elif self._backward_seen:
            return -1
        layer = getattr(self.tracker, "layer", None)
        return -1 if layer is None else int(layer)

    def _issue(self, cls: OpClass, kernel: bool, host_s: float | None = None) -> None:
        host = self.tc.op_host_s(cls, kernel) if host_s is None else host_s
        self._op = self._trace.op(host, kernel=kernel, floor_s=self.tc.floor_s, layer=self._layer(), cls=int(cls))

    def sync(self, func: Any) -> None:
        """The host waits for the device after this op (StorageTracker.on_sync): `.item()` is answered without an op
        of its own, so its dispatch is one more host op; a data-sized op (nonzero) was issued as a kernel already."""
        if not self.recording or self._trace is None:
            return
        if func._overloadpacket.__name__ == "_local_scalar_dense":
            self.ops += 1
            self.views += 1
            self._issue(op_class(), False)
        self._trace.mark_sync()
        self.syncs += 1

    # -- classification --
    def _weights(self) -> set[tuple[int, ...]]:
        if self._param_shapes is None:
            shapes: set[tuple[int, ...]] = set()
            if self.model is not None:
                for p in self.model.parameters():
                    s = _shape(p)
                    shapes.add(s)
                    shapes.add(s[::-1])
                    local = getattr(p, "_local_tensor", None)
                    if local is not None:  # an FSDP2 shard: its copies into and out of the flat buffers
                        shapes.update({_shape(local), (local.numel(),), (p.numel(),)})
            self._param_shapes = shapes
        return self._param_shapes

    def _quant(self) -> dict[int, int]:
        if self._quant_keys is None:
            import torch  # lazy: loads torch

            keys: dict[int, int] = {}
            if self.quantized and self.model is not None:
                for name, mod in self.model.named_modules():
                    w = getattr(mod, "weight", None)
                    if (isinstance(mod, torch.nn.Linear) and w is not None and not w.requires_grad
                            and "lm_head" not in name):
                        keys[w.untyped_storage()._cdata] = w.numel()
            self._quant_keys = keys
        return self._quant_keys

    def __call__(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if not self.recording:
            return
        from .tracker import tensors_in  # lazy: loads torch

        tc = self.tc
        self.ops += 1
        cls = op_class()
        name = func._overloadpacket.__name__
        if getattr(func, "is_view", False) or name in _NO_KERNEL:
            self.views += 1
            self._issue(cls, False)
            return
        if getattr(func, "namespace", "") == _COLLECTIVES:  # launched on the communication stream: host time only
            self.launches += 1
            self._issue(cls, False, tc.op_host_s(cls, True))
            return
        self.launches += 1
        self._issue(cls, True)
        if _is_attention(name):
            self._attention(name, args, kwargs)
            return
        ins = tensors_in(args) + tensors_in(kwargs)
        outs = tensors_in(out)
        tensors = ins + outs
        if not tensors:
            return
        if _in_trl_kernels():
            self._lm_head(name, args, ins, outs, cls)
            return
        if name in _MATMULS:
            t, extra = self._matmul(name, args, ins)
            basis = self._basis(tensors)
            self._add(Term.ATTENTION if basis is Basis.ATTENTION else Term.MATMUL, basis, t)
            if extra:
                self._add(Term.DEQUANT, Basis.FIXED, extra)
            return
        if name in _GATHERS:  # reads only the rows it gathers (or scatters)
            nbytes = float(sum(2 * x.numel() * x.element_size() for x in outs) + sum(
                x.numel() * x.element_size() for x in ins if not x.is_floating_point()))
        else:
            nbytes = traffic_bytes(func, args, kwargs, out)
            if nbytes <= 0.0:  # a collective: the communication model's time (or nothing to move)
                return
        op = f"{getattr(func, 'namespace', 'aten')}::{name}"
        self.memory_bytes[op] = self.memory_bytes.get(op, 0.0) + nbytes
        t = memory_s(nbytes, tc)
        # FSDP2's copy-in / copy-out / reduce-scatter copy-in move parameters: once per micro-step, not per token
        basis = Basis.FIXED if getattr(func, "namespace", "") == "fsdp" else self._basis(tensors)
        self._add(Term.ATTENTION if basis is Basis.ATTENTION else Term.MEMORY, basis, t)

    def _lm_head(self, name: str, args: tuple, ins: list, outs: list, cls: OpClass) -> None:
        """TRL's chunked log-prob head. On CUDA it runs 16-bit GEMMs with fp32 accumulation (`torch.addmm(...,
        out_dtype=float32)`, which the fake run takes: advisor/simulator/fake_step.real_path_patches) and Triton folds
        (stood in for by no-ops, costed here after each logits tile's GEMM)."""
        tc = self.tc
        tensors = ins + outs
        per_token = any(d in self._head_dims for x in tensors for d in _shape(x))
        basis = (Basis.TRAINED if tc.cuda else Basis.TOKENS) if per_token else Basis.FIXED
        if name in _MATMULS:
            t, _ = self._matmul(name, args, ins)
            self._add(Term.LM_HEAD, basis, t)
            if tc.cuda and name == "mm" and outs:
                # the Triton fold over this logits tile (its own launch through Triton's Python launcher): one read
                # forward, a read and a write backward
                tile = outs[0].numel() * outs[0].element_size()
                self.launches += 1
                self._issue(cls, True, float(tc.raw["host"]["triton_launch_us"]) * 1e-6 + tc.launch_s)
                self._add(Term.LM_HEAD, basis, memory_s(1.5 * tile, tc))
            return
        nbytes = float(sum(x.numel() * x.element_size() for x in tensors))
        self._add(Term.LM_HEAD, basis, memory_s(nbytes, tc))

    def _basis(self, tensors: list) -> Basis:
        weights = self._weights()
        weight_only = True
        for x in tensors:
            s = _shape(x)
            if len(s) >= 2 and s[-1] == s[-2] and s[-1] in self._attn_dims and s not in weights:
                return Basis.ATTENTION
            if x.numel() > 1 and s not in weights:
                weight_only = False
        return Basis.FIXED if weight_only else Basis.TOKENS

    def _matmul(self, name: str, args: tuple, ins: list) -> tuple[float, float]:
        """(GEMM seconds, dequantisation seconds when a quantized weight is read)."""
        tc = self.tc
        mats = [x for x in ins if x.dim() >= 2]
        if name in ("addmm", "addmm_", "baddbmm", "addbmm"):
            mats = [x for x in tensors_of(args[1:3]) if x.dim() >= 2] or mats
        if len(mats) < 2:
            return tc.floor_s, 0.0
        a, b = mats[0], mats[1]
        batch = int(np.prod(a.shape[:-2])) if a.dim() > 2 else 1
        m, k = int(a.shape[-2]), int(a.shape[-1])
        n = int(b.shape[-1])
        dtype, size = a.dtype, a.element_size()
        peak = tc.peak_for(dtype)
        t = gemm_s(m, n, k, size, peak, tc, batch)
        extra = 0.0
        quant = self._quant()
        if quant:
            for x in (a, b):
                numel = quant.get(x.untyped_storage()._cdata)
                if numel:
                    extra += dequant_s(numel, self.quantized, tc) + (t * self._int8_extra())
                    if self._trace is not None:  # bitsandbytes' dequantize: a launch of its own
                        self._trace.host[self._op] += tc.op_host_s(OpClass.NOGRAD, True)
        return t, extra

    def _int8_extra(self) -> float:
        if self.quantized == "8bit":
            return float(self.tc.raw["dequantization"]["int8_matmul_factor"]) - 1.0
        return 0.0

    def _attention(self, name: str, args: tuple, kwargs: dict) -> None:
        tc = self.tc
        backward = "backward" in name
        q = args[1] if backward else args[0]
        layout = self.layout
        if _is_flash(name):
            # aten._flash_attention_forward/backward, or the simulator's FlashAttention stand-ins
            # (advisor/simulator/flash.py: advisor::_flash_attn[_varlen]_forward/backward, same argument order):
            # (T, H, D) varlen with cu_seqlens, or (B, S, H, D)
            heads, head_dim = int(q.shape[-2]), int(q.shape[-1])
            kind = AttentionKind.CAUSAL
            units = attention_units(kind, np.asarray(layout.sequences), layout.rows, layout.seq, tc.attn_block)
        else:
            # sdpa: (B, H, S, D); a mask (attn_mask given) means the whole row, is_causal the causal tiles
            heads, head_dim = int(q.shape[1]), int(q.shape[-1])
            rows, s = int(q.shape[0]), int(q.shape[2])
            k = args[2] if backward else args[1]
            if not backward and int(k.shape[2]) != s:  # a decode step: s new queries against the cached keys
                self._cached_attention(q, k)
                return
            masked = kwargs.get("attn_mask") is not None or any(
                getattr(x, "dim", lambda: 0)() == 4 and x is not q and _shape(x)[-1] == _shape(x)[-2]
                for x in args if hasattr(x, "shape")
            )
            kind = AttentionKind.FULL if masked else AttentionKind.CAUSAL
            units = attention_units(kind, np.full(rows, s), rows, s, tc.attn_block)
        if self.kind is None:
            self.kind = kind
        per_tile = attention_tile_s(heads, head_dim, tc.peak_for(q.dtype), tc, backward)
        self._add(Term.ATTENTION, Basis.ATTENTION, max(units * per_tile, tc.floor_s, tc.attn_floor_s[int(backward)]))

    def _cached_attention(self, q: Any, k: Any) -> None:
        """Queries against a longer KV cache (generate's decode step): its FLOPs at the attention's efficiency or
        its keys and values read, whichever is longer (a decode step reads the whole cache)."""
        tc = self.tc
        rows, heads, s, d = (int(x) for x in q.shape)
        length, kv_heads = int(k.shape[2]), int(k.shape[1])
        flops = 4.0 * rows * heads * s * length * d
        nbytes = 2.0 * rows * kv_heads * length * d * k.element_size()
        t = max(flops / (tc.peak_for(q.dtype) * tc.attn_fwd_eff), nbytes / tc.mem_bw, tc.floor_s)
        self._add(Term.ATTENTION, Basis.FIXED, t)

    def _add(self, term: Term, basis: Basis, seconds: float) -> None:
        self._trace.add_device(self._op, _TERMS.index(term), int(basis), seconds)

    # -- result --
    def cost(self, *, accumulation: int, optimizer: OptimizerCost, flops: tuple[float, float],
             layers: int = 0) -> StepCost:
        """Per micro-step: the recorded ops' traces (the first and the last micro-step, where they differ), their
        device times divided by the worst batch's bases; `layers`: the depth of the run."""
        self.end_micro()
        n = max(1, self.micro_steps)
        lay = self.layout
        kind = self.kind or (AttentionKind.DENSE if self.attn == "eager" else AttentionKind.CAUSAL)
        units = attention_units(kind, np.asarray(lay.sequences), lay.rows, lay.seq, self.tc.attn_block)
        worst = BatchPoint(
            tokens=float(lay.tokens), trained=float(max(lay.trained, 1)), attention=float(max(units, 1.0)),
            rows=float(lay.rows), real=float(sum(lay.sequences)), sq=float(sum(s * s for s in lay.sequences)),
        )
        scale = np.array([worst.tokens, worst.trained, worst.attention, 1.0])
        traces = [dataclasses.replace(t, device=t.device / scale[None, :], layers=layers) for t in self.traces]
        if not traces:
            traces = [TraceBuilder().build(layers=layers, sync_s=self.tc.sync_s)]
        first, last = traces[0], traces[-1]
        ga = max(1, accumulation)
        micro = ((last, ga),) if len(traces) == 1 or len(first) == len(last) else ((first, ga - 1), (last, 1))
        device = sum(t.device_matrix() * c for t, c in micro) / ga
        tc = self.tc
        return StepCost(
            device=device, host_s=self.host / n, serial_host_s=tc.micro_step_s, collate_row_s=tc.collate_row_s,
            optimizer=optimizer, step_host_s=tc.step_s, serial=not tc.cuda, accumulation=accumulation,
            flops_per_token=flops[0], flops_per_sq=flops[1], peak_flops=0.0, worst=worst, attention_kind=kind,
            launches=self.launches / n, micro=micro, views=self.views / n, syncs=self.syncs / n,
        )


def tensors_of(tree: Any) -> list:
    from .tracker import tensors_in  # lazy: loads torch

    return tensors_in(tree)
