"""LoRA adapters on a Hugging Face causal LM, trained by the exact learners.

A LoRA adapter replaces the weight W (out x in) of a linear layer by W + s B A, with
A (r x in), B (out x r) and s = alpha / r; only A and B train, W stays frozen. ``apply_lora``
injects the adapters in place with peft, so the model stays its own ``*ForCausalLM`` class
(``model.base_model`` is the decoder and ``model.get_output_embeddings()`` the head, as
``policy/logprobs.py`` expects; a ``PeftModel`` wrapper would hide both).

Why the streamed update stays exact: every learner differentiates with respect to the
model's trainable parameters only (``streaming/base.py`` collects those with
``requires_grad``), and the identities that make streaming exact (the gradient is linear in
the per-source terms; the adjoints of the prompt's keys/values replayed through the prompt
once) hold for any choice of parameters. Freezing W removes terms from the gradient, never
changes the ones that remain.

Dropout must be 0 for exact streaming: the streamed learners forward a segment (the prompt,
an earlier turn) once and later backpropagate adjoints through it or recompute it, and the
sync learner forwards the same tokens in another arrangement. With dropout each of those
forwards draws its own mask, so the pieces would not be the gradient of any one loss, and the
streamed and sync updates could not agree. ``apply_lora`` therefore refuses dropout > 0
unless ``allow_dropout=True`` (for a learner that makes no exactness claim).

Saved adapters use peft's ``save_pretrained`` layout, which peft and vLLM's LoRA loader read:
``adapter_config.json`` (peft's ``LoraConfig`` fields, ``peft_type: "LORA"``,
``task_type: "CAUSAL_LM"``) and ``adapter_model.safetensors`` with keys
``base_model.model.<module path>.lora_A.weight`` / ``.lora_B.weight`` (the adapter name is
dropped, as peft does). For engines without LoRA support, ``merged_state_dict`` gives the
plain base model's state dict with s B A added to each adapted weight.

Simplifications: one adapter per model (peft's "default"); adapters on linear layers only
(not on the embeddings or the output head, which small models tie); no bias, DoRA or rsLoRA.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

#: peft's name for the one adapter a model carries; saved keys drop it.
ADAPTER = "default"
#: The prefix peft's ``save_pretrained`` gives every saved key (PeftModel -> LoraModel -> model).
SAVED_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


@dataclass(frozen=True)
class LoraSettings:
    """Rank ``r``, scale ``alpha`` (the update is (alpha / r) B A), dropout, and the names
    (last path component) of the linear layers that get an adapter."""

    r: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        # Plain values whatever was passed (alpha=16, a list of targets): equal settings
        # compare and serialise equal.
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoRA r must be an integer >= 1, got {self.r!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA alpha must be a finite number > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules or not all(self.target_modules):
            raise ValueError(f"LoRA targets must be non-empty names, got {self.target_modules!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def parse_lora(text: str) -> LoraSettings:
    """Settings from the command-line form ``r=8,alpha=16[,dropout=0][,targets=q_proj+v_proj]``."""
    fields = _lora_fields(text)
    numbers: dict[str, float] = {}
    for key, kind in (("r", int), ("alpha", float), ("dropout", float)):
        if key in fields:
            try:
                numbers[key] = kind(fields[key])
            except ValueError:
                what = "an integer" if kind is int else "a number"
                raise ValueError(
                    f"--lora {text!r}: {key} must be {what}, got {fields[key]!r}"
                ) from None
    targets = DEFAULT_TARGETS
    if "targets" in fields:
        targets = tuple(name.strip() for name in fields["targets"].split("+"))
        if not all(targets):
            raise ValueError(f"--lora {text!r}: targets has an empty name: {fields['targets']!r}")
    try:
        return LoraSettings(target_modules=targets, **numbers)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"--lora {text!r}: {exc}") from None


def _lora_fields(text: str) -> dict[str, str]:
    """``key=value`` pairs of ``--lora``, each known key at most once, r and alpha present."""
    fields: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"--lora {text!r}: {item.strip()!r} is not key=value")
        if key not in ("r", "alpha", "dropout", "targets"):
            raise ValueError(f"--lora {text!r}: unknown field {key!r} (r, alpha, dropout, targets)")
        if key in fields:
            raise ValueError(f"--lora {text!r}: field {key!r} given twice")
        fields[key] = value
    for required in ("r", "alpha"):
        if required not in fields:
            raise ValueError(f"--lora {text!r}: field {required!r} is required")
    return fields


def apply_lora(
    model: torch.nn.Module,
    settings: LoraSettings,
    *,
    seed: int = 0,
    init_b_std: float = 0.0,
    allow_dropout: bool = False,
) -> torch.nn.Module:
    """Add adapters to ``model`` in place and freeze everything else; returns ``model``.

    A is drawn as peft draws it (Kaiming-uniform, bound 1 / sqrt(in)) from a generator
    seeded with ``seed``, in float64 and then cast, so a float32 and a float64 copy of one
    model get the same adapter up to rounding; B is zero, so the policy starts as the base
    model, unless ``init_b_std`` > 0 draws it normal (for tests: while B is zero, so is the
    gradient with respect to A). Dropout > 0 is refused unless ``allow_dropout`` (see the module
    docstring: the streamed update is then no longer exact).
    """
    if settings.dropout > 0 and not allow_dropout:
        raise ValueError(
            f"LoRA dropout {settings.dropout} > 0: each forward would draw its own mask, so the "
            "streamed update would no longer equal the sync one (pass allow_dropout=True to "
            "accept that)"
        )
    if init_b_std < 0:
        raise ValueError(f"init_b_std must be >= 0, got {init_b_std}")
    if any(True for _ in _lora_layers(model)):
        raise ValueError(f"{type(model).__name__} already carries LoRA adapters")
    _check_targets(model, settings.target_modules)
    config = _peft_config(settings)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in _lora_layers(model):
            a, b = _adapter_weights(layer)
            a_init = torch.empty(a.shape, dtype=torch.float64)
            torch.nn.init.kaiming_uniform_(a_init, a=math.sqrt(5), generator=generator)
            a.copy_(a_init)
            if init_b_std > 0:
                b.copy_(torch.randn(b.shape, generator=generator, dtype=torch.float64) * init_b_std)
            else:
                b.zero_()
    return model


def adapter_settings(model: torch.nn.Module) -> LoraSettings | None:
    """The settings of the adapters ``apply_lora`` put on ``model`` (None: it has none)."""
    configs = getattr(model, "peft_config", None)
    if not configs or ADAPTER not in configs:
        return None
    config = configs[ADAPTER]
    return LoraSettings(
        r=int(config.r),
        alpha=float(config.lora_alpha),
        dropout=float(config.lora_dropout),
        target_modules=tuple(sorted(config.target_modules)),
    )


def saved_key(parameter_name: str) -> str:
    """peft's saved key for an adapter parameter name of the injected model:
    ``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    parts = parameter_name.split(".")
    if len(parts) < 3 or parts[-3] not in ("lora_A", "lora_B") or parts[-2] != ADAPTER:
        raise ValueError(f"{parameter_name!r} is not a LoRA adapter parameter")
    return SAVED_PREFIX + ".".join(parts[:-2] + parts[-1:])


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the adapter tensors only, under peft's saved keys."""
    out = {}
    for name, layer in _lora_layers(model):
        for part, weight in zip(("lora_A", "lora_B"), _adapter_weights(layer), strict=True):
            out[f"{SAVED_PREFIX}{name}.{part}.weight"] = weight.detach().clone()
    if not out:
        raise ValueError(f"{type(model).__name__} carries no LoRA adapters")
    return out


def save_adapter(
    model: torch.nn.Module,
    settings: LoraSettings,
    directory: Path | str,
    *,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` in peft's format.

    ``base_model_name_or_path`` defaults to the model's own ``name_or_path`` (the folder it
    was loaded from)."""
    carried = adapter_settings(model)
    if carried is None:
        raise ValueError(f"{type(model).__name__} carries no LoRA adapters")
    _check_same_settings(carried, settings, f"save_adapter to {directory}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    base = base_model_name_or_path or getattr(model, "name_or_path", None) or None
    config = _peft_config(settings, base_model_name_or_path=base, inference_mode=True)
    config_dict = {
        key: sorted(value) if isinstance(value, set) else value
        for key, value in config.to_dict().items()
    }
    _write_atomic(directory / CONFIG_FILE, lambda tmp: Path(tmp).write_text(
        json.dumps(config_dict, indent=2, sort_keys=True) + "\n"
    ))  # fmt: skip
    tensors = {k: v.contiguous() for k, v in adapter_state_dict(model).items()}
    _write_atomic(
        directory / WEIGHTS_FILE, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"})
    )
    return directory


def load_adapter(
    model: torch.nn.Module, directory: Path | str, *, allow_dropout: bool = False
) -> torch.nn.Module:
    """Load an adapter saved in peft's format into ``model`` (bitwise, when the dtypes match).

    A model without adapters gets them first (``apply_lora`` with the saved settings); one
    with adapters must carry the saved settings. Every saved key must match an adapter
    tensor of the model, and every adapter tensor must be saved. An adapter saved with
    dropout > 0 loads only with ``allow_dropout`` (as in ``apply_lora``)."""
    directory = Path(directory)
    settings = read_adapter_settings(directory)
    carried = adapter_settings(model)
    if carried is None:
        apply_lora(model, settings, allow_dropout=allow_dropout)
    else:
        _check_same_settings(carried, settings, f"load_adapter from {directory}")
    saved = load_file(str(directory / WEIGHTS_FILE))
    params = {saved_key(n): p for n, p in model.named_parameters() if ".lora_" in n}
    missing, unexpected = sorted(params.keys() - saved.keys()), sorted(saved.keys() - params)
    if missing or unexpected:
        raise ValueError(
            f"{directory / WEIGHTS_FILE}: keys do not match the model's adapters "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    with torch.no_grad():
        for key, param in params.items():
            if saved[key].shape != param.shape:
                raise ValueError(
                    f"{directory / WEIGHTS_FILE}: {key} has shape {tuple(saved[key].shape)}, "
                    f"the model's adapter {tuple(param.shape)}"
                )
            param.copy_(saved[key])
    return model


def read_adapter_settings(directory: Path | str) -> LoraSettings:
    """The settings in a saved adapter's ``adapter_config.json``."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no adapter config (not a saved adapter folder)")
    config = json.loads(path.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}, expected 'LORA'")
    for key in ("use_dora", "use_rslora"):
        if config.get(key):
            raise ValueError(f"{path}: {key} is set; only plain LoRA is supported")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise ValueError(f"{path}: target_modules is a pattern ({targets!r}); give names")
    try:
        return LoraSettings(
            r=int(config["r"]),
            alpha=float(config["lora_alpha"]),
            dropout=float(config.get("lora_dropout", 0.0)),
            target_modules=tuple(sorted(targets or ())),
        )
    except KeyError as exc:
        raise ValueError(f"{path}: field {exc.args[0]!r} is missing") from None


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain base model's state dict with each adapter merged: W + (alpha / r) B A.

    Keys are those of the model without adapters (``q_proj.weight``, not
    ``q_proj.base_layer.weight``); the merge is summed in at least float32 and rounded once
    to W's dtype."""
    layers = dict(_lora_layers(model))
    if not layers:
        raise ValueError(f"{type(model).__name__} carries no LoRA adapters")
    out = {}
    for key, tensor in model.state_dict().items():
        module_name, marker, leaf = key.rpartition(".base_layer.")
        if not marker:
            if ".lora_" not in key:
                out[key] = tensor.detach().clone()
            continue
        merged = tensor.detach().clone()
        layer = layers.get(module_name)
        if layer is not None and leaf == "weight":
            merged = _merged_weight(layer, tensor.detach())
        out[f"{module_name}.{leaf}"] = merged
    return out


def _merged_weight(layer: LoraLinear, weight: torch.Tensor) -> torch.Tensor:
    dtype = torch.promote_types(weight.dtype, torch.float32)
    a, b = (w.detach().to(dtype) for w in _adapter_weights(layer))
    return (weight.to(dtype) + layer.scaling[ADAPTER] * (b @ a)).to(weight.dtype)


def _adapter_weights(layer: LoraLinear) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """(A, B) of the layer's one adapter."""
    a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    assert isinstance(a, torch.nn.Parameter)
    assert isinstance(b, torch.nn.Parameter)
    return a, b


def _lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    """(module path, layer) of every adapted layer, in module order."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            if not isinstance(module, LoraLinear) or ADAPTER not in module.lora_A:
                raise ValueError(f"{name}: {type(module).__name__} is not a plain LoRA linear")
            yield name, module


def _check_targets(model: torch.nn.Module, targets: tuple[str, ...]) -> None:
    """Every target names at least one linear layer, none of them an embedding or the head."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embeddings = {id(m) for m in (get_in() if get_in else None, get_out() if get_out else None)}
    found: dict[str, int] = dict.fromkeys(targets, 0)
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf not in found:
            continue
        if id(module) in embeddings:
            raise ValueError(f"LoRA target {leaf!r}: {name} is an embedding or the output head")
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"LoRA target {leaf!r}: {name} is a {type(module).__name__}")
        found[leaf] += 1
    unmatched = [t for t, n in found.items() if n == 0]
    if unmatched:
        raise ValueError(f"LoRA targets {unmatched} match no layer of {type(model).__name__}")


def _check_same_settings(carried: LoraSettings, wanted: LoraSettings, where: str) -> None:
    for field in ("r", "alpha", "dropout"):
        if getattr(carried, field) != getattr(wanted, field):
            raise ValueError(
                f"{where}: {field} is {getattr(wanted, field)!r} but the model's adapters have "
                f"{getattr(carried, field)!r}"
            )
    if sorted(carried.target_modules) != sorted(wanted.target_modules):
        raise ValueError(
            f"{where}: targets {sorted(wanted.target_modules)} but the model's adapters are on "
            f"{sorted(carried.target_modules)}"
        )


def _peft_config(settings: LoraSettings, **extra: object) -> LoraConfig:
    # An integral alpha is written as an integer, as peft's own configs have it.
    alpha = int(settings.alpha) if settings.alpha.is_integer() else settings.alpha
    return LoraConfig(
        r=settings.r,
        lora_alpha=alpha,  # type: ignore[arg-type]
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        **extra,  # type: ignore[arg-type]
    )


def _write_atomic(path: Path, write: Callable[[str], object]) -> None:
    """Write through a temporary sibling and rename, so a failure leaves no half file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


__all__ = [
    "DEFAULT_TARGETS",
    "LoraSettings",
    "adapter_settings",
    "adapter_state_dict",
    "apply_lora",
    "load_adapter",
    "merged_state_dict",
    "parse_lora",
    "read_adapter_settings",
    "save_adapter",
    "saved_key",
]


def published_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What an engine or an evaluation loads: the plain model's parameters by name, each
    adapted weight merged (W + s B A), one at a time; for a model without adapters its
    parameters as they are."""
    layers = dict(_lora_layers(model))
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        module_name, marker, leaf = name.rpartition(".base_layer.")
        if not marker:
            yield name, p.detach()
        elif leaf == "weight" and module_name in layers:
            yield f"{module_name}.weight", _merged_weight(layers[module_name], p.detach())
        else:
            yield f"{module_name}.{leaf}", p.detach()
