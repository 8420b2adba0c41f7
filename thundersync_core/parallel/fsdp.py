"""Where a learner rank keeps its parameters, gradients and optimizer state.

Two layouts, chosen by ``learner_sharding``:

- ``replicated``: every rank holds the full model, the full reduced gradient and the full
  AdamW state, and takes the identical step (the all-reduce gives every rank the same
  gradient bitwise). The comparison baseline. With a lower compute dtype
  (``MixedPrecisionState``, also the one-process learner's) the model the learner runs is a
  bfloat16 replica and a float32 master beside it holds the weights, the gradient and AdamW.
- ``fsdp2``: a *compute replica* (full weights, float32 or bfloat16) runs the streamed
  forward/backward, and a float32 *master* wrapped with ``fully_shard`` holds the
  parameters, the reduced gradients and the optimizer state sharded (dim 0 over the ranks).
  At the barrier each rank takes its shard of the reduced gradient, the norm is clipped
  over the global (DTensor) norm, the sharded optimizer steps, and the replica is refreshed
  from the shards one tensor at a time (an all-gather per tensor).

Limitation of ``fsdp2``: the streaming executor's accumulators (the batch gradient, GRPO's
open-group statistics, OPD's prompt ledgers) and the compute replica stay replicated. Ranks
run sources at independent times, so a per-source forward cannot issue FSDP's all-gathers
(that would force lockstep or deadlock). Against ``replicated`` the sharded layout saves
(W-1)/W of the float32 master and of the two AdamW moments, 12 (W-1)/W bytes per
parameter; it still costs, per rank, the replica (4 or 2 bytes per parameter) plus the
float32 batch accumulator (4 bytes) plus the open groups' statistics.

LoRA (a model carrying peft adapters, ``policy/lora.py``): the optimizer and any separate
master cover the trainable adapters only; the frozen base needs neither (nothing steps it).
Every rank applies the adapters with the same seed before its state is built, so the ranks
start identical. With a lower compute dtype the frozen base is cast to it in place and the
float32 adapters are their own master: peft runs each adapter in its weights' dtype (the
input cast up, the sum cast back to the base's output dtype), so no replica of the adapters
is needed and the learner's float32 accumulator is their gradient as it is. ``fsdp2``
shards the adapters' float32 master and AdamW state; the frozen base stays whole on every
rank (in the compute replica, which the streamed forward needs anyway), and the master
module lists it by name beside the sharded adapters (FSDP ignores it), so a checkpoint
holds the base and the adapters. Publication merges the adapters (W + s B A, in W's dtype)
from the replica, whose float32 adapters equal the master: no gather.

Publication: rank 0 writes the safetensors file one tensor at a time
(``write_safetensors_streamed``). When the replica is float32 it already equals the gathered
master and rank 0 writes it directly (no collective); with a bfloat16 replica each master
tensor is gathered in turn (every rank calls) and written, so no rank ever holds a second
full copy of the weights, only one extra tensor.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

if TYPE_CHECKING:
    from thundersync_core.policy.lora import LoraSettings

Sharding = Literal["replicated", "fsdp2"]

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
}


class TrainState(Protocol):
    """What a learner rank steps: set up around ``model``, the replica the learner runs on.

    ``clip`` takes the barrier's float32 gradient by parameter name (``grads``, times
    ``sign``: the learner's ``grad_objective`` and -1 for a maximised objective) where the
    replica's own ``.grad`` is rounded to a lower compute dtype."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def clip(
        self,
        max_grad_norm: float,
        grads: Mapping[str, torch.Tensor] | None = None,
        sign: float = 1.0,
    ) -> float: ...
    def apply(self) -> None: ...
    def write_weights(self, path: Path, dtype: torch.dtype | None = None) -> None: ...
    def checkpoint_module(self) -> torch.nn.Module: ...
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...
    def refresh_replica(self) -> None: ...
    def state_bytes(self) -> dict[str, int]: ...


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _nbytes(
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters an optimizer steps (all of them, or a LoRA model's adapters), by name."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _carries_adapters(model: torch.nn.Module) -> bool:
    from thundersync_core.policy.lora import adapter_settings  # noqa: PLC0415

    return adapter_settings(model) is not None


def _base_in_compute_dtype(model: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """A LoRA model at a lower compute dtype: its frozen base is cast to it in place (it
    needs no float32 master: nothing steps it); the float32 adapters stay their own master."""
    wrong = sorted({n for n, p in trainable_parameters(model) if p.dtype != torch.float32})
    if wrong:
        raise ValueError(
            f"the LoRA adapters must be float32 (their own master), got {wrong[:3]}; apply "
            "them to the float32 model before the base is cast to the compute dtype"
        )
    for p in model.parameters():
        if not p.requires_grad and p.dtype != compute_dtype:
            p.data = p.data.to(compute_dtype)


def _adapter_master(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """The sharded master of a model with frozen parameters (LoRA): a module with the
    model's parameter names (tied ones under each name) whose trainable parameters are float32
    copies sharded by FSDP2, and whose frozen ones are the model's own tensors, left whole
    (FSDP ignores them). Its state dict is the base and the adapters, as a checkpoint needs."""
    master = torch.nn.Module()
    copies: dict[int, torch.nn.Parameter] = {}
    frozen: set[torch.nn.Parameter] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        *path, leaf = name.split(".")
        owner = master
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        if p.requires_grad:
            if id(p) not in copies:
                copies[id(p)] = torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
            owner.register_parameter(leaf, copies[id(p)])
        else:
            owner.register_parameter(leaf, p)
            frozen.add(p)
    fully_shard(master, mesh=mesh, ignored_params=frozen)
    return master


class _WholeMaster:
    """A float32 master held whole on every rank (``self.master``) with its AdamW; the
    learner computes on ``self.model``, the master itself or a replica refreshed from it."""

    master: torch.nn.Module
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def apply(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.refresh_replica()

    def refresh_replica(self) -> None:
        """The model is the master: nothing to refresh."""

    def write_weights(self, path: Path, dtype: torch.dtype | None = None) -> None:
        """The float32 master is what a checkpoint and an engine load (cast to ``dtype``
        for a checkpoint's export)."""
        if _rank() == 0:
            write_safetensors_streamed(path, cast_named(self.named_weights(), dtype))

    def checkpoint_module(self) -> torch.nn.Module:
        return self.master

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights a publication carries, one tensor at a time (LoRA adapters merged
        into their weights: engines load the plain model)."""
        from thundersync_core.policy.lora import published_weights  # noqa: PLC0415

        return published_weights(self.master)


class ReplicatedState(_WholeMaster):
    """Full model, gradient and optimizer on every rank; identical steps. The optimizer
    steps the trainable parameters (a LoRA model's adapters, float32 over a base that may
    be in a lower compute dtype)."""

    def __init__(self, model: torch.nn.Module, *, lr: float) -> None:
        self.model = self.master = model
        self.params = [p for _, p in trainable_parameters(model)]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr)

    def clip(
        self,
        max_grad_norm: float,
        grads: Mapping[str, torch.Tensor] | None = None,
        sign: float = 1.0,
    ) -> float:
        """The trainable parameters are float32: their ``.grad`` is the barrier's gradient."""
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm))

    def state_bytes(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {
            "params": _nbytes(params),
            "grads": _nbytes(p.grad for p in params),
            "optimizer": _optimizer_bytes(self.optimizer),
        }


def _pair_bytes(
    model: torch.nn.Module,
    pairs: Sequence[tuple[str, torch.nn.Parameter, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
) -> dict[str, int]:
    """Bytes of the replica ``model`` (frozen parameters included) beside the master of its
    trainable ones (weights and gradients of both) and the AdamW."""
    replica = [r for _, r, _ in pairs]
    master = [m for _, _, m in pairs]
    return {
        "params": _nbytes(master) + _nbytes(model.parameters()),
        "grads": _nbytes(p.grad for p in master) + _nbytes(r.grad for r in replica),
        "optimizer": _optimizer_bytes(optimizer),
    }


def _float32_grad(
    name: str,
    replica_p: torch.nn.Parameter,
    grads: Mapping[str, torch.Tensor] | None,
    sign: float,
) -> torch.Tensor:
    """The barrier's gradient of one parameter in float32: from ``grads`` (the learner's
    float32 accumulator, before the replica's rounding) when given, else the replica's."""
    if grads is not None and name in grads:
        return (sign * grads[name]).to(torch.float32)
    if replica_p.grad is None:
        raise RuntimeError(f"rank {_rank()}: parameter {name!r} has no reduced gradient")
    return replica_p.grad.to(torch.float32)


class MixedPrecisionState(_WholeMaster):
    """A compute replica in ``compute_dtype`` (what the learner runs) and the float32 master
    it is refreshed from: weights, gradient and AdamW stay in float32. The master is the
    loaded model; the replica is cast from it, one tensor at a time. Several ranks each hold
    it whole and take the identical step, as ``ReplicatedState`` does."""

    def __init__(self, model: torch.nn.Module, *, lr: float, compute_dtype: torch.dtype) -> None:
        wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if wrong:
            raise ValueError(
                f"the master weights must be loaded in float32, got {wrong}; the compute "
                f"replica is cast to {compute_dtype} from them"
            )
        self.master = model
        self.model = cast_parameters(copy.deepcopy(model), compute_dtype)
        replica = dict(self.model.named_parameters())
        self.pairs = [(name, replica[name], p) for name, p in trainable_parameters(model)]
        self.optimizer = torch.optim.AdamW([p for _, _, p in self.pairs], lr=lr)

    def clip(
        self,
        max_grad_norm: float,
        grads: Mapping[str, torch.Tensor] | None = None,
        sign: float = 1.0,
    ) -> float:
        for name, replica_p, master_p in self.pairs:
            master_p.grad = _float32_grad(name, replica_p, grads, sign)
            replica_p.grad = None
        masters = [p for _, _, p in self.pairs]
        return float(torch.nn.utils.clip_grad_norm_(masters, max_grad_norm))

    def refresh_replica(self) -> None:
        with torch.no_grad():
            for _, replica_p, master_p in self.pairs:
                replica_p.copy_(master_p.to(replica_p.dtype))

    def state_bytes(self) -> dict[str, int]:
        return _pair_bytes(self.model, self.pairs, self.optimizer)


class ShardedState:
    """A compute replica for streaming, and an FSDP2-sharded float32 master with the optimizer
    (of the trainable parameters: with LoRA the adapters, beside the whole frozen base)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        mesh: DeviceMesh,
        compute_dtype: torch.dtype | None = None,
        master: torch.nn.Module | None = None,
    ) -> None:
        """``master``: an FSDP2-sharded float32 master already holding ``model``'s values
        (``load_sharded_state``); otherwise it is made here from ``model``."""
        self.model = model
        self.mesh = mesh
        trainable = trainable_parameters(model)
        if master is None and len(trainable) < len(list(model.parameters())):
            if compute_dtype is not None:
                _base_in_compute_dtype(model, compute_dtype)
            master = _adapter_master(model, mesh)
        elif master is None:
            # The deep copy briefly holds a second full copy; fully_shard frees all but the
            # shard. It is taken before the replica is cast: the master keeps the values.
            master = copy.deepcopy(model).to(torch.float32)
            if compute_dtype is not None:
                cast_parameters(model, compute_dtype)
            fully_shard(master, mesh=mesh)
        self.master = master
        replica = dict(model.named_parameters())
        self.pairs = [
            (name, replica[name], p) for name, p in master.named_parameters() if p.requires_grad
        ]
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            [p for _, _, p in self.pairs], lr=lr
        )
        if len(self.pairs) != len(trainable):
            raise RuntimeError(
                f"rank {_rank()}: the sharded master has {len(self.pairs)} trainable "
                f"parameters, the replica {len(trainable)}"
            )

    def clip(
        self,
        max_grad_norm: float,
        grads: Mapping[str, torch.Tensor] | None = None,
        sign: float = 1.0,
    ) -> float:
        """Move this rank's shard of the reduced gradient to the master; clip globally."""
        for name, replica_p, master_p in self.pairs:
            full = _float32_grad(name, replica_p, grads, sign)
            assert isinstance(master_p, DTensor)
            # Every rank holds the same reduced gradient: each keeps its own slice, no traffic.
            shard = distribute_tensor(
                full,
                self.mesh,
                master_p.placements,
                src_data_rank=None,
            )
            if shard.to_local().shape != master_p.to_local().shape:
                raise RuntimeError(
                    f"rank {_rank()}: gradient shard of {name!r} is {tuple(shard.to_local().shape)}"
                    f", the parameter shard {tuple(master_p.to_local().shape)}"
                )
            master_p.grad = shard
            replica_p.grad = None
        return self._clip_masters(max_grad_norm)

    def clip_shards(
        self, max_grad_norm: float, shards: Mapping[str, torch.Tensor], sign: float = 1.0
    ) -> float:
        """As ``clip``, from a sharded batch gradient: this rank's rows of each reduced
        gradient (``parallel.data_parallel.ShardedGradient``) are its master shards' own."""
        for name, replica_p, master_p in self.pairs:
            assert isinstance(master_p, DTensor)
            local = shards[name]
            if local.shape != master_p.to_local().shape:
                raise RuntimeError(
                    f"rank {_rank()}: gradient shard of {name!r} is {tuple(local.shape)}, the "
                    f"parameter shard {tuple(master_p.to_local().shape)}"
                )
            master_p.grad = DTensor.from_local(
                (sign * local).to(torch.float32),
                self.mesh,
                master_p.placements,
                shape=master_p.shape,
                stride=master_p.stride(),
            )
            replica_p.grad = None
        return self._clip_masters(max_grad_norm)

    def _clip_masters(self, max_grad_norm: float) -> float:
        masters = [p for _, _, p in self.pairs]
        norm = torch.nn.utils.clip_grad_norm_(masters, max_grad_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def apply(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.refresh_replica()

    def refresh_replica(self) -> None:
        """Copy the master into the replica, gathering one tensor at a time (every rank)."""
        with torch.no_grad():
            for _, replica_p, master_p in self.pairs:
                assert isinstance(master_p, DTensor)
                replica_p.copy_(master_p.full_tensor().to(replica_p.dtype))

    def write_weights(self, path: Path, dtype: torch.dtype | None = None) -> None:
        """Rank 0 writes what a publication carries; every rank walks it (a gather)."""
        weights = cast_named(self.named_weights(), dtype)
        write_safetensors_streamed(path, weights, write=_rank() == 0)

    def _gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, _, master_p in self.pairs:
            assert isinstance(master_p, DTensor)
            with torch.no_grad():
                full = master_p.full_tensor()
            yield name, full

    def checkpoint_module(self) -> torch.nn.Module:
        return self.master

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights a publication carries: the replica as it is when its trainable
        parameters are float32 (they equal the master; LoRA adapters merged, the base in
        its dtype), or else each master tensor gathered in turn (every rank iterates)."""
        from thundersync_core.policy.lora import published_weights  # noqa: PLC0415

        if all(r.dtype == torch.float32 for _, r, _ in self.pairs):
            return published_weights(self.model)
        return self._gathered()

    def state_bytes(self) -> dict[str, int]:
        return _pair_bytes(self.model, self.pairs, self.optimizer)


def build_train_state(
    model: torch.nn.Module,
    *,
    sharding: Sharding,
    lr: float,
    device_type: str = "cpu",
    compute_dtype: torch.dtype | None = None,
) -> TrainState:
    """The rank's train state around ``model``; the learner runs on ``state.model``.

    ``compute_dtype`` (bfloat16, say) other than the model's: ``model`` holds the float32
    master values and the state's replica computes in that dtype; a LoRA model instead
    computes on itself, its frozen base cast to that dtype in place and its float32 adapters
    the master. ``fsdp2`` needs the process group to be initialised."""
    lower = compute_dtype is not None and any(p.dtype != compute_dtype for p in model.parameters())
    if lower and _carries_adapters(model):
        assert compute_dtype is not None
        _base_in_compute_dtype(model, compute_dtype)
        lower = False
    if sharding == "replicated":
        if lower:
            assert compute_dtype is not None
            return MixedPrecisionState(model, lr=lr, compute_dtype=compute_dtype)
        return ReplicatedState(model, lr=lr)
    if sharding == "fsdp2":
        world = dist.get_world_size() if dist.is_initialized() else 1
        mesh = init_device_mesh(device_type, (world,))
        return ShardedState(model, lr=lr, mesh=mesh, compute_dtype=compute_dtype if lower else None)
    raise ValueError(f"learner_sharding must be 'replicated' or 'fsdp2', got {sharding!r}")


def load_sharded_state(
    model_dir: Path,
    *,
    lr: float,
    device: str = "cpu",
    compute_dtype: torch.dtype | None = None,
    lora: LoraSettings | None = None,
    lora_seed: int = 0,
) -> ShardedState:
    """An FSDP2 rank's state from a Hugging Face folder that only rank 0 reads.

    Every rank builds the compute replica from the config without initialising it (in
    ``compute_dtype``, float32 by default) and the float32 master on the meta device,
    sharded before it takes memory; then rank 0 reads the weights one tensor at a time and
    broadcasts each (in float32: a float32 checkpoint keeps its bits in the master), and
    every rank copies it into its replica and keeps its own slice in its master shard. A
    rank holds its replica, its master shard and one tensor in flight: never a whole float32
    copy of the model (``build_train_state`` from a loaded model holds two, briefly).

    ``lora``: every rank applies the adapters (seeded by ``lora_seed``, so the ranks agree)
    to a float32 replica once its base is read, then casts the frozen base to
    ``compute_dtype``; the master is the adapters' (``ShardedState``). The float32 replica
    is the one whole float32 copy a rank holds, briefly when the compute dtype is lower.
    """
    from transformers import AutoConfig  # noqa: PLC0415

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = init_device_mesh(device, (world,))
    if lora is not None:
        replica = _empty_model(config, torch.float32, device)
        _read_into(model_dir, replica, None, mesh, device)
        from thundersync_core.policy.lora import apply_lora  # noqa: PLC0415

        apply_lora(replica, lora, seed=lora_seed)
        return ShardedState(replica, lr=lr, mesh=mesh, compute_dtype=compute_dtype)
    replica = _empty_model(config, compute_dtype or torch.float32, device)
    master = _empty_model(config, torch.float32, "meta")
    fully_shard(master, mesh=mesh)
    master.to_empty(device=device)
    _read_into(model_dir, replica, dict(master.named_parameters()), mesh, device)
    return ShardedState(replica, lr=lr, mesh=mesh, master=master)


def _empty_model(config: object, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A model of ``config`` as ``load_model`` prepares one (eval mode, every parameter
    trainable, float32-keeping norms), its weights not initialised (on "meta": no memory)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from thundersync_core.policy.norm import widen_rms_norms  # noqa: PLC0415

    if device == "meta":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        with _uninitialised():
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation="sdpa"
            )
        model.tie_weights()  # skipped with the initialisation (tied embeddings share one tensor)
    widen_rms_norms(model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return model.to(device) if device != "meta" else model


def _read_into(
    model_dir: Path,
    replica: torch.nn.Module,
    shards: Mapping[str, torch.nn.Parameter] | None,
    mesh: DeviceMesh,
    device: str,
) -> None:
    """Rank 0 reads each weight and broadcasts it (float32); every rank copies it into its
    replica and (unless ``shards`` is None) its slice into the master shard of that name."""
    reader = _WeightReader(model_dir) if _rank() == 0 else None
    with torch.no_grad():
        for name, replica_p in replica.named_parameters():
            full = (
                reader.read(name).to(device=device, dtype=torch.float32)
                if reader is not None
                else torch.empty(replica_p.shape, dtype=torch.float32, device=device)
            )
            if dist.is_initialized():
                dist.broadcast(full, src=0)
            replica_p.copy_(full)
            if shards is not None:
                shard = shards[name]
                assert isinstance(shard, DTensor)
                mine = distribute_tensor(full, mesh, shard.placements, src_data_rank=None)
                shard.to_local().copy_(mine.to_local())


class _WeightReader:
    """Tensors of a Hugging Face folder's safetensors files by name, read one at a time."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open  # noqa: PLC0415

        self.files = [safe_open(str(f), "pt") for f in sorted(model_dir.glob("*.safetensors"))]
        self.where = {key: f for f in self.files for key in f.keys()}  # noqa: SIM118
        if not self.where:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")

    def read(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise KeyError(f"the model's weights have no tensor {name!r}")
        return self.where[name].get_tensor(name)


def _uninitialised() -> contextlib.AbstractContextManager[None]:
    """Build a model without its (discarded) random initialisation."""
    try:
        from transformers.initialization import no_init_weights  # noqa: PLC0415
    except ImportError:  # another transformers: initialise, and overwrite after
        return contextlib.nullcontext()
    return no_init_weights()


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast the parameters, not the buffers: rotary frequencies stay in float32, as a model
    loaded in ``dtype`` by ``from_pretrained`` (and the inference engines) keeps them."""
    for param in model.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def cast_named(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` with each tensor in ``dtype`` (as it is for None), one at a time."""
    for name, tensor in named:
        yield name, tensor if dtype is None else tensor.to(dtype)


def named_detached(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters by name, detached, one at a time."""
    for name, p in model.named_parameters():
        yield name, p.detach()


def write_safetensors_streamed(
    path: Path, tensors: Iterable[tuple[str, torch.Tensor]], *, write: bool = True
) -> None:
    """Write a safetensors file one tensor at a time (memory: one tensor, not the model).

    The header (names, shapes, offsets) precedes the data but is known only once every
    tensor has been seen, and a gather yields tensors one by one; so the data is streamed to
    a body file and the header is written in front of it at the end. ``write=False``
    consumes the iterator without writing (the other ranks of a gather). The file lands
    under a temporary name and is renamed when complete.
    """
    items = iter(tensors)
    if not write:
        for _ in items:
            pass
        return
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    header: dict[str, object] = {}
    offset = 0
    body = tmp.with_name(tmp.name + ".body")
    with body.open("wb") as handle:
        for name, tensor in items:
            data = tensor.detach().contiguous().cpu()
            if data.dtype not in _SAFETENSORS_DTYPES:
                raise TypeError(f"{path}: tensor {name!r} has dtype {data.dtype}")
            size = data.numel() * data.element_size()
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[data.dtype],
                "shape": list(data.shape),
                "data_offsets": [offset, offset + size],
            }
            if size:
                handle.write(data.view(torch.uint8).reshape(-1).numpy().tobytes())
            offset += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    # The data section starts 8-byte aligned: pad the header with spaces.
    encoded += b" " * (math.ceil(len(encoded) / 8) * 8 - len(encoded))
    with tmp.open("wb") as out, body.open("rb") as data_in:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        while chunk := data_in.read(1 << 24):
            out.write(chunk)
    body.unlink()
    tmp.replace(path)


__all__ = [
    "MixedPrecisionState",
    "ReplicatedState",
    "ShardedState",
    "Sharding",
    "TrainState",
    "build_train_state",
    "write_safetensors_streamed",
]
