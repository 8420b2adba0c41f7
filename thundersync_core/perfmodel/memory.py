"""Per-GPU memory of the GRPO learner, from a model's shape and the learner's layout.

A learner rank holds gradient-sized buffers (weights, gradients, AdamW, the batch gradient,
GRPO's open-group statistics) and the activations of one backward. Which of them are live
together depends on the moment of the step, so the estimate names every term and takes the
largest of the moments (phases) below, each the sum of the terms live in it. The streaming
learner (``streaming/grpo_stream.py``) is the default; ``learner="sync"`` is the sync one
(``streaming/grpo_sync.py``) with one row per backward, the baseline of what streaming adds.

Symbols: P trainable parameters, c the compute dtype's bytes (2 bfloat16, 4 float32),
s the master's shard count (W with fsdp2, else 1), k open groups, T tokens of one backward
(every one scored: the upper bound), T_p prefix tokens (a group's prompt but its last token,
forwarded once per open group), K = 2 L n_kv d T_p the prompt's key/value proxies, X the
largest trained tensor (X' the larger of X and one layer's prompt keys, n_kv d T_p), L
layers, h hidden, f intermediate, n_q / n_kv heads of width d, V vocabulary.

Terms, as the code holds them (``parallel/fsdp.py``, ``parallel/data_parallel.py``,
``streaming/base.py``, ``streaming/grpo_stream.py``):

    base                c P_0      LoRA's frozen base model (below); 0 for full fine-tuning
    replica             c P        the compute copy; 0 when the learner runs on a float32 master
    master              4 P / s    float32 weights (fully_shard splits dim 0 over the ranks)
    optimizer           8 P / s    AdamW's moments, plus a 4-byte step per parameter tensor
    accumulator         4 P        the batch gradient, whole on every rank; with the sharded
                                   gradient (``learner_sharded_gradient``) this rank's Shard(0)
                                   rows, 4 sum_t ceil(r_t / W) n_t (tensor t: r_t rows of n_t)
    pending             4 P        sharded gradient: what closes added since the last flush,
                                   whole and float32 (flushes follow each group's last
                                   trajectory). Live from a close's commit (after its replay)
                                   to the flush; with release="trajectory" also through the
                                   backwards and closes of the held sources a close admits
                                   at once, which run before that flush
    group_statistics    8 k (P+K)  x1 and x2 in float32 per open group (release="trajectory")
    prompt_graphs       k A_p      each open group's prompt forward, kept for its one replay
                                   (one group at a time with release="group")
    held_gradients      c (P+K)    release="group": the running sum of the group's backwards,
                                   added into in place; live during every backward but the
                                   first (group size >= 2) and through the close. With packs
                                   and release="trajectory": the closing pack's gradient,
                                   through the close (not during a backward)
    activations         A          what a backward holds besides its gradient, at its peak
    transient_gradient  c (P+K)    a backward's gradient as autograd returns it, what exists
                                   of it at the backward's peak; the per-trajectory path
                                   frees it once it is in the statistics, before a close
    combination         4 (P+K)    a x1 + b x2 (with release="group": the sum) at a close
    temporaries         8 X'       a x1 and b x2 of the largest tensor while they are summed;
                                   4 X for a float32 cast of a lower-precision gradient
    replay_gradient     c P_r      the prompt replay's gradient (P_r: the parameters the
                                   prompt's keys and values depend on)
    replica_grads       c P        the barrier's p.grad on the replica (4 P, the gradient
                                   itself, when the learner runs on the float32 master; 0
                                   with the sharded gradient: its rows become the master's)
    flush_buffers       (W+1) B    sharded gradient: a flush's send buffer (every rank's
                                   chunk of each tensor in a bucket) and this rank's output,
                                   a bucket at a time; B the largest bucket's float32 chunk
                                   (tensors in order while they fit 16 MiB, a larger one
                                   alone: 4 X / W rounded up)
    grads               4 P / s    the master's float32 gradient at the step
    step_transient      4 P / s    foreach AdamW (CUDA's default) takes sqrt(v) of every
                                   tensor at once; the per-tensor loop (CPU) 8 X / s

Phases (resident = base + replica + master + optimizer; base is LoRA's frozen model):

    begin_batch     resident + accumulator        a reused learner frees the last batch's
                                                  accumulator before it allocates this one's
    backward        resident + accumulator + pending + group_statistics + prompt_graphs
                    + held_gradients + activations + transient_gradient
    group_close     resident + accumulator + pending + group_statistics + prompt_graphs
                    + held_gradients + combination + temporaries
    prompt_replay   the same with replay_gradient (and its float32 cast) for the temporaries:
                    the replay and the commit after it, pending with either release
    flush           resident + accumulator + pending + group_statistics + prompt_graphs
                    + flush_buffers (sharded gradient only)
    barrier         resident + accumulator + replica_grads
    optimizer_step  resident + accumulator + grads + step_transient

Activations of one backward over a row of T tokens that attends to S = T_p + T keys, in
bytes, as autograd saves them for Hugging Face's Qwen3/Llama decoder with SDPA (checked
tensor by tensor in ``tests/unit/test_memory_model.py``):

    per layer   T [2 (4 + 2c) h + 8         two RMSNorms: float32 input, 1/rms, normalised,
                                            output (which the projections keep)
                   + (4 + c)(n_q + n_kv) d  q/k RMSNorm (Qwen3): float32 input, normalised
                   + 2 c n_q d + 4 n_q      rotated queries, attention output, logsumexp
                   + 4 c f]                 gate, SiLU, up and their product
                + 2 c n_kv d S              keys and values (the cache's, or attention's)
                + 2 c n_q d S               those repeated to n_q heads when attention takes a
                                            mask (a prompt cache) and 1 < n_kv < n_q
                + c T S                     the mask made additive, once per layer
    head        T (4 + c) h + N (c h + 4 V) final RMSNorm; the scored hidden states and the
                                            float32 log-softmax over V (N = T scored tokens)
    backward    + 8 V N                     the gathered and log-softmax gradients (float32)

The backward starts with all of these and no parameter gradient, and ends with the gradient
c (P + K), the cache's keys and values, the hidden-state gradient c T h entering the
embedding and (tied embeddings) two more copies of the embedding's gradient before they are
summed. Each layer frees its activations and adds its gradient, so memory is linear in
between and the peak is the larger end.

``sharded_gradient`` is built: pending (whole, float32) replaces the accumulator's other
(W-1)/W while a close waits for its flush, so the sharded gradient lowers the peak by
4 P (W-1)/W only where no phase at that peak holds pending (release="group": its backwards;
release="trajectory" bounds a backward with held sources admitted before a flush).
``shared_groups`` (``learner_shared_groups``, built on the sharded gradient,
``parallel/shared_groups.py``): the k open groups are shared by every rank (k over all
ranks, not per rank), each rank holding its ``Shard(0)`` rows of their statistics. Sharding
each rank's own k groups would leave every rank 1/W of W k groups: the same bytes. Its
terms differ from the above:

    group_statistics    k (8 sum_t ceil(r_t / W) n_t + 8 K)  the statistics' rows, and the
                                   prompt proxies' statistics whole (on the ranks that ran
                                   some of the group: the upper bound counts every rank)
    prompt_graphs       k c K      each open group's prompt keys and values, no graph: the
                                   replay forwards the prompt again (A_p, in temporaries)
    held_gradients      c (P+K)    in flush: a tick's gradient while it is reduce-scattered
                                   into the rows (the tick's collective)
    pending, combination 0         a close adds a x1 + b x2 of its rows in place, straight
                                   into the batch gradient's rows
    temporaries         max(A_p, flush buffers) in prompt_replay: the prompt's forward
                                   again, then its replay's reduce-scatter

Not modelled: allocator caching and fragmentation on the GPU, CUDA context and NCCL
buffers, the load at start-up (the float32 model and its copy), pack rows (a pack of B rows
repeats the prompt's keys B times), ``learner_order="fixed"`` (one gradient per arrived
trajectory), the float32 cast of one lower-precision gradient tensor as it enters the
statistics (4 X, once the backward's activations are freed), gradient checkpointing (the
learner does not use it).

The sync learner (``learner="sync"``) forwards a trajectory's whole row, prompt and
response (T_p + T tokens, no prompt cache: K = 0), one row per backward
(``micro_batch_tokens`` of one row; its default, the whole batch in one forward, holds every
row's activations at once). It has begin_batch, backward, barrier and optimizer_step with
the terms above, pending, group_statistics, prompt_graphs and held_gradients 0: with no
prompt, where the two learners' rows are the same tokens, streaming adds exactly the open
groups' statistics, 8 k P, to the backward's peak (two float32 buffers of the trainable
parameters per open group); with a prompt also the statistics' 8 k K, the prompt graphs
k A_p and a row of T tokens attending to a cache instead of T_p + T tokens.

LoRA (``policy/lora.py``, ``parallel/fsdp.py``) trains P = sum over layers and adapted
projections of r (in + out) parameters (A is r x in, B is out x r), held in float32 at any
compute dtype: replicated they are their own master (replica 0), with fsdp2 the replica
keeps them whole (4 P) beside the sharded float32 master. The terms above are sized by
them, with 4 for c where they hold adapter gradients (transient, held and replay gradients,
the barrier's p.grad; the prompt proxies' part stays c K, and no float32 cast is needed).
The frozen base (P_0 parameters, the adapted weights included) is base = c P_0 on every
rank: no master, gradient or optimizer state (AdamW keeps state only for parameters that
get a gradient). Activations, checked tensor by tensor for the seven projections (with
fewer, the formula is an upper bound: a projection without an adapter keeps its input only
where another needs it), per layer and token:

    + 4 r n_a                   each adapter's r-wide A x, which B's gradient needs
                                (n_a adapted projections per layer)
    - 2 c h - c (n_q + n_kv) d  a frozen norm weight needs no normalised input (the two
                                RMSNorms, and Qwen3's q/k norms)
    + 4 sum_a in_a - c (2 h + f)
                                when c is not 4: peft runs a float32 adapter on a float32
                                copy of its input, one per adapter, while the c-byte norm
                                outputs and MLP product are kept by no frozen projection

and per backward - T (c h + 4 h + 12) - c h N: the final norm's normalised input and the
scored hidden states (frozen head); the first layer's input norm keeps nothing, its input
(the frozen embedding's) needing no gradient, and the token ids are not kept. The backward
ends with no embedding or hidden-state gradient. An open group's prompt graph changes the
same way: every layer but the last as above, the last by its k and v adapters' 4 r (and,
when c is not 4, their inputs' 4 h, less the norm output's c h) less c h + c n_kv d (its
frozen input norm and k norm). A 0-dim float64 scale per adapter (8 bytes) is not counted.

Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

#: Bytes per element of the compute dtypes the learner supports.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
#: Decimal gigabytes, as GPU memory is sold.
GB = 10**9
#: The projections LoRA adapts, by their Hugging Face names.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_RESIDENT = ("base", "replica", "master", "optimizer")
_STREAMING = ("accumulator", "pending", "group_statistics", "prompt_graphs", "held_gradients")
#: The terms live in each phase (module docstring); ``flush`` only with the sharded gradient.
PHASES: dict[str, tuple[str, ...]] = {
    "begin_batch": (*_RESIDENT, "accumulator"),
    "backward": (*_RESIDENT, *_STREAMING, "activations", "transient_gradient"),
    "group_close": (*_RESIDENT, *_STREAMING, "combination", "temporaries"),
    "prompt_replay": (*_RESIDENT, *_STREAMING, "combination", "replay_gradient", "temporaries"),
    "flush": (*_RESIDENT, *_STREAMING, "flush_buffers"),
    "barrier": (*_RESIDENT, "accumulator", "replica_grads"),
    "optimizer_step": (*_RESIDENT, "accumulator", "grads", "step_transient"),
}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Qwen3/Qwen2/Llama-family causal LM that memory depends on."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    #: Qwen3 normalises queries and keys per head (q_norm, k_norm).
    qk_norm: bool = False
    #: Biases on q/k/v (Qwen2, Llama's ``attention_bias``) and on o (Llama's only).
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf_config(cls, source: str | Path | Mapping[str, Any] | Any) -> ModelShape:
        """From a ``config.json`` path, its parsed dict, or a ``transformers`` config object."""
        if isinstance(source, str | Path):
            path = Path(source)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such Hugging Face config file")
            return cls._from_dict(json.loads(path.read_text()), str(path))
        if isinstance(source, Mapping):
            return cls._from_dict(source, "config dict")
        if hasattr(source, "to_dict"):
            return cls._from_dict(source.to_dict(), type(source).__name__)
        raise TypeError(f"expected a config path, dict or config object, got {type(source)}")

    @classmethod
    def _from_dict(cls, config: Mapping[str, Any], where: str) -> ModelShape:
        model_type = str(config.get("model_type", ""))
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"{where}: model_type {model_type!r} is not one of {_MODEL_TYPES}")
        needed = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")
        missing = [key for key in (*needed, "num_attention_heads") if key not in config]
        if missing:
            raise ValueError(f"{where}: missing {missing}")
        heads = int(config["num_attention_heads"])
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            **{key: int(config[key]) for key in needed},
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
        )

    # -- parameters ------------------------------------------------------------------------
    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each attention and MLP projection of one layer."""
        h, f, q, kv = self.hidden_size, self.intermediate_size, self.q_width, self.kv_width
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    def layer_tensor_rows(self) -> dict[str, tuple[int, int]]:
        """(rows, elements per row) of every parameter tensor of one decoder layer, by name:
        a weight is (out, in); a bias or norm weight is a column."""
        rows = {name: (o, i) for name, (i, o) in self.projections().items()}
        h, f, q, kv = self.hidden_size, self.intermediate_size, self.q_width, self.kv_width
        if self.qkv_bias:
            rows |= {"q_proj.bias": (q, 1), "k_proj.bias": (kv, 1), "v_proj.bias": (kv, 1)}
        if self.o_bias:
            rows["o_proj.bias"] = (h, 1)
        if self.mlp_bias:
            rows |= {"gate_proj.bias": (f, 1), "up_proj.bias": (f, 1), "down_proj.bias": (h, 1)}
        if self.qk_norm:
            rows |= {"q_norm": (self.head_dim, 1), "k_norm": (self.head_dim, 1)}
        return rows | {"input_layernorm": (h, 1), "post_attention_layernorm": (h, 1)}

    def layer_tensors(self) -> dict[str, int]:
        """Element count of every parameter tensor of one decoder layer, by name."""
        return {name: r * n for name, (r, n) in self.layer_tensor_rows().items()}

    def parameter_rows(self) -> list[tuple[int, int]]:
        """(rows, elements per row) of every parameter tensor of the model (a tied head
        once): the embedding, the layers, the final norm and the head."""
        embedding = (self.vocab_size, self.hidden_size)
        layers = list(self.layer_tensor_rows().values()) * self.num_hidden_layers
        head = [] if self.tie_word_embeddings else [embedding]
        return [embedding, *layers, (self.hidden_size, 1), *head]

    @property
    def parameter_count(self) -> int:
        """Parameters of the model (a tied head counted once, as ``model.parameters()``)."""
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embedding
        layer = sum(self.layer_tensors().values())
        return embedding + self.num_hidden_layers * layer + self.hidden_size + head

    @property
    def parameter_tensors(self) -> int:
        """Parameter tensors (AdamW keeps a step counter per tensor)."""
        head = 0 if self.tie_word_embeddings else 1
        return 2 + self.num_hidden_layers * len(self.layer_tensors()) + head

    @property
    def largest_tensor(self) -> int:
        return max(self.vocab_size * self.hidden_size, *self.layer_tensors().values())

    def replay_parameter_count(self) -> int:
        """P_r: the parameters the prompt's keys and values depend on: all but the head, the
        final norm and the last layer's queries, output projection, MLP and second norm."""
        kept = ("k_proj", "v_proj", "k_norm", "input_layernorm")
        last = sum(n for name, n in self.layer_tensors().items() if name.split(".")[0] not in kept)
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.parameter_count - last - self.hidden_size - head

    def lora_parameter_count(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters: r (in + out) per adapted projection and layer."""
        sizes = self.projections()
        unknown = sorted(set(targets) - set(sizes))
        if unknown:
            raise ValueError(f"LoRA targets {unknown} are not projections of {sorted(sizes)}")
        return self.num_hidden_layers * sum(rank * sum(sizes[t]) for t in targets)

    def lora_parameter_rows(self, rank: int, targets: tuple[str, ...]) -> list[tuple[int, int]]:
        """(rows, elements per row) of every adapter tensor: A is (r, in), B is (out, r)."""
        sizes = self.projections()
        per_layer = [shape for t in targets for shape in ((rank, sizes[t][0]), (sizes[t][1], rank))]
        return per_layer * self.num_hidden_layers

    def lora_largest_tensor(self, rank: int, targets: tuple[str, ...]) -> int:
        return rank * max(max(self.projections()[t]) for t in targets)

    def _lora_layer_bytes(self, c: int, lora: LoraSpec) -> int:
        """Per token: what LoRA changes in a layer's saved activations (module docstring)."""
        h, f = self.hidden_size, self.intermediate_size
        qk = c * (self.num_attention_heads + self.num_key_value_heads) * self.head_dim
        frozen_norms = 2 * c * h + (qk if self.qk_norm else 0)
        change = 4 * lora.rank * len(lora.targets) - frozen_norms
        if c != 4:
            inputs = self.projections()
            change += 4 * sum(inputs[t][0] for t in lora.targets) - c * (2 * h + f)
        return change

    def prompt_kv_elements(self, prefix_tokens: int) -> int:
        """K: elements of a prompt's keys and values over every layer."""
        return 2 * self.num_hidden_layers * self.kv_width * prefix_tokens

    # -- activations -----------------------------------------------------------------------
    def layer_activation_bytes(
        self, c: int, tokens: int, keys: int, *, masked: bool, lora: LoraSpec | None = None
    ) -> int:
        """Bytes one decoder layer keeps for its backward over ``tokens`` rows attending to
        ``keys`` keys (module docstring); ``masked``: attention takes an explicit mask (a
        prompt cache), so grouped keys and values are repeated to every query head; ``lora``:
        the base frozen, adapters on ``lora.targets``."""
        h, d = self.hidden_size, self.head_dim
        n_q, n_kv = self.num_attention_heads, self.num_key_value_heads
        per_token = 2 * ((4 + 2 * c) * h + 4)
        if self.qk_norm:
            per_token += (4 + c) * (n_q + n_kv) * d + 4 * (n_q + n_kv)
        # SDPA's output is laid out (T, heads, d): o_proj reads that storage, no copy.
        per_token += 2 * c * n_q * d + 4 * n_q
        per_token += 4 * c * self.intermediate_size
        if lora is not None:
            per_token += self._lora_layer_bytes(c, lora)
        kv = 2 * c * n_kv * d * keys
        # repeat_kv reshapes an expanded view: a copy unless a single key head.
        repeated = 2 * c * n_q * d * keys if masked and 1 < n_kv < n_q else 0
        mask = c * tokens * keys if masked else 0
        return tokens * per_token + kv + repeated + mask

    def prompt_graph_bytes(self, c: int, prefix_tokens: int, lora: LoraSpec | None = None) -> int:
        """A_p: what one open group's prompt forward keeps until its replay: every layer but
        the last whole, the last up to its keys and values (its queries, attention and MLP
        feed nothing that is kept); rotary tables and token ids. ``lora``: the base frozen
        (module docstring)."""
        if prefix_tokens <= 0:
            return 0
        t, h, n_kv = prefix_tokens, self.hidden_size, self.num_key_value_heads
        whole = self.layer_activation_bytes(c, t, t, masked=False, lora=lora)
        last = t * ((4 + 2 * c) * h + 4 + 2 * c * self.kv_width)
        if self.qk_norm:
            last += t * ((4 + c) * n_kv * self.head_dim + 4 * n_kv)
        shared = 2 * c * t * self.head_dim + 8 * t
        if lora is not None:
            kv_adapters = sum(target in ("k_proj", "v_proj") for target in lora.targets)
            frozen_norms = c * h + (c * self.kv_width if self.qk_norm else 0)
            last += t * (4 * lora.rank * kv_adapters - frozen_norms)
            if c != 4:
                last += t * (4 * h * kv_adapters - c * h)
            shared -= t * (4 * h + 12)
        return (self.num_hidden_layers - 1) * whole + last + shared

    def saved_activation_bytes(
        self,
        c: int,
        tokens: int,
        prefix_tokens: int,
        *,
        scored_tokens: int | None = None,
        lora: LoraSpec | None = None,
    ) -> int:
        """What one forward over ``tokens`` rows after a cached prompt of ``prefix_tokens``
        keeps for its backward: the layers, the head, rotary tables, token ids and the scored
        mask. ``scored_tokens`` defaults to every row; ``lora``: the base frozen (module
        docstring)."""
        t, h, v = tokens, self.hidden_size, self.vocab_size
        n = t if scored_tokens is None else scored_tokens
        keys, masked = t + prefix_tokens, prefix_tokens > 0
        layer = self.layer_activation_bytes(c, t, keys, masked=masked, lora=lora)
        head = t * ((4 + c) * h + 4) + n * (c * h + 4 * v + 8)
        shared = 2 * c * t * self.head_dim + 9 * t
        if lora is not None:
            # Frozen final norm and head; the first layer's input norm keeps nothing (the
            # frozen embedding's output needs no gradient), nor are the token ids kept.
            head -= c * h * (t + n)
            shared -= t * (4 * h + 12)
        return self.num_hidden_layers * layer + head + shared


@dataclass(frozen=True)
class LoraSpec:
    """Adapters of rank ``rank`` on ``targets`` beside a frozen base: ``policy/lora.py``'s
    ``LoraSettings.r`` and ``target_modules`` (alpha does not change memory)."""

    rank: int = 16
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1 or not self.targets:
            raise ValueError(f"LoRA needs rank >= 1 and at least one target, got {self}")


@dataclass(frozen=True)
class LearnerLayout:
    """How a learner rank is set up: what ``TrainConfig`` and the cluster decide."""

    world_size: int = 1
    sharding: Literal["replicated", "fsdp2"] = "replicated"
    compute_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    #: ``max_open_groups``: groups with live statistics on this rank.
    open_groups: int = 4
    release: Literal["trajectory", "group"] = "trajectory"
    #: Tokens of one backward (a trajectory's row, or a pack); all scored (the upper bound).
    tokens_per_backward: int = 8192
    #: A group's prompt but its last token: forwarded once per open group, kept for replay.
    prefix_tokens: int = 0
    group_size: int = 8
    #: The learner runs packs (``TrainConfig.packs``): a closing pack's gradient is held
    #: through its group's close.
    packs: bool = False
    lora: LoraSpec | None = None
    #: ``learner_sharded_gradient`` (built, fsdp2): the batch gradient held as this rank's
    #: ``Shard(0)`` rows, closes added into a whole pending buffer until the next flush.
    sharded_gradient: bool = False
    #: ``learner_shared_groups`` (built, with the sharded gradient): the statistics held 1/W
    #: per rank too (a close adds its rows straight into the shards); ``open_groups`` are
    #: then groups every rank shares, not each rank's own.
    shared_groups: bool = False
    #: torch's AdamW takes its foreach path on CUDA and a loop over tensors on CPU.
    adamw_foreach: bool = True
    #: ``sync``: the sync learner, one whole row (prompt and response) per backward; it
    #: holds no open group, so ``open_groups``, ``release`` and ``group_size`` do not apply.
    learner: Literal["streaming", "sync"] = "streaming"

    def __post_init__(self) -> None:
        if min(self.world_size, self.open_groups, self.group_size, self.tokens_per_backward) < 1:
            raise ValueError(
                f"world_size, open_groups, group_size, tokens_per_backward must be >= 1: {self}"
            )
        if self.prefix_tokens < 0:
            raise ValueError(f"prefix_tokens must be >= 0, got {self.prefix_tokens}")
        if self.sharding not in ("replicated", "fsdp2"):
            raise ValueError(f"sharding must be 'replicated' or 'fsdp2', got {self.sharding!r}")
        if self.compute_dtype not in DTYPE_BYTES:
            raise ValueError(f"compute_dtype must be one of {sorted(DTYPE_BYTES)}")
        if self.release not in ("trajectory", "group"):
            raise ValueError(f"release must be 'trajectory' or 'group', got {self.release!r}")
        if self.sharded_gradient and self.sharding != "fsdp2":
            raise ValueError("sharded_gradient holds the fsdp2 master's rows: needs fsdp2")
        if self.shared_groups and not (self.sharded_gradient and self.release == "trajectory"):
            raise ValueError("shared_groups needs sharded_gradient and release='trajectory'")
        if self.learner not in ("streaming", "sync"):
            raise ValueError(f"learner must be 'streaming' or 'sync', got {self.learner!r}")
        if self.learner == "sync" and (self.packs or self.sharded_gradient or self.shared_groups):
            raise ValueError("the sync learner is modelled without packs or sharded gradients")

    def describe(self) -> str:
        lora = f" lora r={self.lora.rank}" if self.lora else ""
        packs = " packs" if self.packs else ""
        sharded = " sharded gradient" if self.sharded_gradient else ""
        projected = " shared groups" if self.shared_groups else ""
        groups = f"k={self.open_groups}" if self.release == "trajectory" else "one group"
        learner = f"release={self.release} {groups}"
        if self.learner == "sync":
            learner = "sync learner, one row per backward,"
        return (
            f"W={self.world_size} {self.sharding} {self.compute_dtype} {learner} "
            f"T={self.tokens_per_backward} T_p={self.prefix_tokens}{packs}{lora}"
            f"{sharded}{projected}"
        )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU: each phase's terms; the peak is the largest phase."""

    layout: LearnerLayout
    phases: dict[str, dict[str, int]]
    #: Parameter counts behind the terms, for reports.
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def totals(self) -> dict[str, int]:
        return {name: sum(terms.values()) for name, terms in self.phases.items()}

    @property
    def peak_phase(self) -> str:
        totals = self.totals
        return max(totals, key=lambda name: totals[name])

    @property
    def total_bytes(self) -> int:
        return self.totals[self.peak_phase]

    @property
    def terms(self) -> dict[str, int]:
        """The peak phase's terms (they sum to ``total_bytes``)."""
        return dict(self.phases[self.peak_phase])

    def explain(self, gpu_bytes: int | None = None) -> str:
        """The peak phase term by term in GB, its total, the budget, and the other phases."""
        parts = " + ".join(f"{name} {n / GB:.1f}" for name, n in self.terms.items())
        budget = "" if gpu_bytes is None else f" against {gpu_bytes / GB:.1f} GB per GPU"
        others = ", ".join(f"{p} {t / GB:.1f}" for p, t in self.totals.items())
        return (
            f"{self.layout.describe()}: peak in {self.peak_phase}: {parts} "
            f"= {self.total_bytes / GB:.1f} GB{budget} (every phase, GB: {others})"
        )


@dataclass(frozen=True)
class _Trained:
    """What is trained: the full model or LoRA's adapters."""

    parameters: int
    #: (rows, elements per row) of each trained tensor: a ``Shard(0)`` split is by rows.
    rows: list[tuple[int, int]]
    tensors: int
    replay: int
    largest: int
    base_bytes: int
    tied: bool
    #: Bytes per element of the trained parameters' compute copy and of their gradients:
    #: c, or 4 for LoRA's float32 adapters.
    element_bytes: int


def _trained(shape: ModelShape, layout: LearnerLayout, c: int) -> _Trained:
    lora = layout.lora
    if lora is None:
        return _Trained(
            parameters=shape.parameter_count,
            rows=shape.parameter_rows(),
            tensors=shape.parameter_tensors,
            replay=shape.replay_parameter_count(),
            largest=shape.largest_tensor,
            base_bytes=0,
            tied=shape.tie_word_embeddings,
            element_bytes=c,
        )
    adapters = shape.lora_parameter_count(lora.rank, lora.targets)
    # Of the last layer's adapters only the keys' and values' reach the prompt's.
    unused = tuple(t for t in lora.targets if t not in ("k_proj", "v_proj"))
    last = shape.lora_parameter_count(lora.rank, unused) // shape.num_hidden_layers
    return _Trained(
        parameters=adapters,
        rows=shape.lora_parameter_rows(lora.rank, lora.targets),
        tensors=2 * len(lora.targets) * shape.num_hidden_layers,
        replay=adapters - last,
        largest=shape.lora_largest_tensor(lora.rank, lora.targets),
        base_bytes=c * shape.parameter_count,
        tied=False,
        element_bytes=4,
    )


def _backward(
    shape: ModelShape, layout: LearnerLayout, c: int, gradient_bytes: int, trained: _Trained
) -> dict[str, int]:
    """activations and transient_gradient at the backward's peak, its start or its end."""
    t, tp = layout.tokens_per_backward, layout.prefix_tokens
    scored = t
    if layout.learner == "sync":
        t, tp = tp + t, 0  # the whole row, no prompt cache
    start = shape.saved_activation_bytes(c, t, tp, scored_tokens=scored, lora=layout.lora)
    start += 8 * shape.vocab_size * scored
    cache_kv = 2 * c * shape.num_hidden_layers * shape.kv_width * (t + tp) if tp > 0 else 0
    embedding_copies = 2 * c * shape.vocab_size * shape.hidden_size if trained.tied else 0
    # A frozen embedding takes no gradient, so none flows into the first layer's input.
    hidden = c * t * shape.hidden_size if layout.lora is None else 0
    end = cache_kv + embedding_copies + hidden
    if start >= end + gradient_bytes:
        return {"activations": start, "transient_gradient": 0}
    return {"activations": end, "transient_gradient": gradient_bytes}


def memory_per_gpu(shape: ModelShape, layout: LearnerLayout) -> MemoryEstimate:
    """Bytes one learner rank holds in each phase of a step (module docstring)."""
    c = DTYPE_BYTES[layout.compute_dtype]
    shards = layout.world_size if layout.sharding == "fsdp2" else 1
    trained = _trained(shape, layout, c)
    p, g = trained.parameters, trained.element_bytes
    # Only a replicated float32 learner computes on its master (ReplicatedState).
    replica = 0 if layout.sharding == "replicated" and g == 4 else g * p
    master = _ceil_div(4 * p, shards)
    resident = {
        "base": trained.base_bytes,
        "replica": replica,
        "master": master,
        "optimizer": _ceil_div(8 * p, shards) + 4 * trained.tensors,
    }
    by_rows = layout.sharded_gradient or layout.shared_groups
    accumulator = 4 * _shard_rows_elements(trained.rows, layout.world_size) if by_rows else 4 * p
    phases = {"begin_batch": resident | {"accumulator": accumulator}}
    if layout.learner == "sync":
        idle = dict.fromkeys(_STREAMING[1:], 0)
        phases["backward"] = (
            resident
            | {"accumulator": accumulator}
            | idle
            | _backward(shape, layout, c, g * p, trained)
        )
    else:
        streaming = _shared_phases if layout.shared_groups else _streaming_phases
        phases |= streaming(shape, layout, c, trained, resident=resident, accumulator=accumulator)
    phases["barrier"] = resident | {
        "accumulator": accumulator,
        "replica_grads": 0 if by_rows else (g if replica else 4) * p,
    }
    phases["optimizer_step"] = resident | {
        "accumulator": accumulator,
        "grads": master,
        "step_transient": master
        if layout.adamw_foreach
        else 2 * _ceil_div(4 * trained.largest, shards),
    }
    for name, terms in phases.items():
        if tuple(terms) != PHASES[name]:
            raise AssertionError(f"phase {name}: terms {tuple(terms)} != {PHASES[name]}")
    counts = {"parameters": shape.parameter_count, "trainable_parameters": p}
    return MemoryEstimate(layout=layout, phases=phases, counts=counts)


def _streaming_phases(
    shape: ModelShape,
    layout: LearnerLayout,
    c: int,
    trained: _Trained,
    *,
    resident: dict[str, int],
    accumulator: int,
) -> dict[str, dict[str, int]]:
    """The streaming learner's backward, close, replay and flush (module docstring)."""
    p = trained.parameters
    kv = shape.prompt_kv_elements(layout.prefix_tokens)
    streamed = p + kv
    by_trajectory = layout.release == "trajectory"
    # What a close adds waits, whole and float32, for the next flush (after every group's
    # last trajectory).
    pending = 4 * p if layout.sharded_gradient else 0
    groups = layout.open_groups if by_trajectory else 1
    prompt_graph = shape.prompt_graph_bytes(c, layout.prefix_tokens, layout.lora)
    streaming = {
        "accumulator": accumulator,
        "pending": 0,
        "group_statistics": groups * 8 * streamed if by_trajectory else 0,
        "prompt_graphs": groups * prompt_graph,
    }
    # Per trajectory, a close admits held sources at once: their backwards, and their
    # groups' closes, run before the flush, beside the first close's pending buffer.
    before_flush = streaming | {"pending": pending if by_trajectory else 0}
    transient = trained.element_bytes * p + c * kv
    # release="group" adds each backward's gradient into the first one's, in place.
    held = 0 if by_trajectory or layout.group_size < 2 else transient
    held_at_close = 0 if by_trajectory and not layout.packs else transient
    closing = {"held_gradients": held_at_close, "combination": 4 * streamed}
    # The largest streamed tensor: a trained one, or one layer's prompt keys.
    largest = max(trained.largest, shape.kv_width * layout.prefix_tokens)
    largest_fp32 = 4 * largest
    # A float32 copy of a lower-precision gradient tensor as it is added to float32 sums.
    cast = 4 * trained.largest if trained.element_bytes != 4 else 0
    phases = {
        "backward": resident
        | before_flush
        | {"held_gradients": held}
        | _backward(shape, layout, c, transient, trained),
        "group_close": resident
        | before_flush
        | closing
        | {"temporaries": 2 * largest_fp32 if by_trajectory else cast},
        # The replay, then the commit: the close's parts go into the pending buffer while
        # the replay's gradient is still held.
        "prompt_replay": resident
        | streaming
        | {"pending": pending}
        | closing
        | {"replay_gradient": trained.element_bytes * trained.replay, "temporaries": cast},
    }
    if pending:
        phases["flush"] = (
            resident
            | streaming
            | {
                "pending": pending,
                "held_gradients": 0,
                "flush_buffers": _flush_bytes(trained.rows, layout.world_size),
            }
        )
    return phases


def _shared_phases(
    shape: ModelShape,
    layout: LearnerLayout,
    c: int,
    trained: _Trained,
    *,
    resident: dict[str, int],
    accumulator: int,
) -> dict[str, dict[str, int]]:
    """Shared groups' backward, tick reduction (``flush``), close and replay (module
    docstring): statistics as rows, no prompt graph held, nothing pending."""
    p, k, world = trained.parameters, layout.open_groups, layout.world_size
    kv = shape.prompt_kv_elements(layout.prefix_tokens)
    rows = _shard_rows_elements(trained.rows, world)
    streaming = {
        "accumulator": accumulator,
        "pending": 0,
        "group_statistics": k * (8 * rows + 8 * kv),
        "prompt_graphs": k * c * kv,
        "held_gradients": 0,
    }
    transient = trained.element_bytes * p + c * kv
    flush = _flush_bytes(trained.rows, world)
    prompt_graph = shape.prompt_graph_bytes(c, layout.prefix_tokens, layout.lora)
    closing = {"combination": 0}
    return {
        "backward": resident | streaming | _backward(shape, layout, c, transient, trained),
        "group_close": resident | streaming | closing | {"temporaries": 0},
        "prompt_replay": resident
        | streaming
        | closing
        | {
            "replay_gradient": trained.element_bytes * trained.replay,
            "temporaries": max(prompt_graph, flush),
        },
        "flush": resident | streaming | {"held_gradients": transient, "flush_buffers": flush},
    }


def _shard_rows_elements(rows: list[tuple[int, int]], world: int) -> int:
    """Elements of rank 0's ``Shard(0)`` rows (the most: dim 0 split rounded up)."""
    return sum(_ceil_div(r, world) * n for r, n in rows)


#: ``parallel/data_parallel.BUCKET_BYTES`` (a test keeps them equal): a reduce-scatter's
#: share of each rank; a larger tensor goes alone.
FLUSH_BUCKET_BYTES = 16 << 20


def _flush_bytes(rows: list[tuple[int, int]], world: int) -> int:
    """A flush's buffers at its largest bucket: the padded send buffer (every rank's chunk
    of each tensor in the bucket) and this rank's output (float32), tensors bucketed in
    order while a rank's chunks fit ``FLUSH_BUCKET_BYTES``."""
    largest = size = 0
    for r, n in rows:
        chunk = 4 * _ceil_div(r, world) * n
        size = size + chunk if size and size + chunk <= FLUSH_BUCKET_BYTES else chunk
        largest = max(largest, size)
    return (world + 1) * largest


def check_learner_memory(shape: ModelShape, layout: LearnerLayout, gpu_bytes: int) -> None:
    """Refuse a layout whose peak does not fit ``gpu_bytes``, naming every term in GB."""
    estimate = memory_per_gpu(shape, layout)
    if estimate.total_bytes > gpu_bytes:
        raise ValueError(
            f"the learner does not fit: {estimate.explain(gpu_bytes)}; options: fsdp2, more "
            "learner ranks, a lower max_open_groups, grpo_release: group, shorter backwards"
        )


def layout_of(config: Any) -> LearnerLayout:
    """The layout a GRPO ``TrainConfig`` gives a learner rank: its ranks, sharding, compute
    dtype, open groups, release rule, whether it runs packs, holds the batch gradient
    sharded (``learner_sharded_gradient``) or trains LoRA adapters (``policy.lora``); a
    backward of ``learner_pack_tokens`` or of the longest response
    (``rollout.max_total_tokens``), after a prompt of the rest of the context
    (``rollout.max_model_len``): the longest the run may see."""
    learner = config.resources.learner
    rollout = config.rollout
    lora = config.policy.lora
    return LearnerLayout(
        world_size=learner.ranks,
        sharding=config.learner_sharding if learner.ranks > 1 else "replicated",
        compute_dtype=config.learner_dtype,
        open_groups=config.max_open_groups,
        release=config.grpo_release,
        tokens_per_backward=max(config.learner_pack_tokens, rollout.max_total_tokens),
        prefix_tokens=max(rollout.max_model_len - rollout.max_total_tokens - 1, 0),
        group_size=config.group_size,
        packs=config.packs,
        sharded_gradient=config.learner_sharded_gradient,
        shared_groups=config.learner_shared_groups,
        lora=None if lora is None else LoraSpec(lora.r, tuple(lora.target_modules)),
    )


def check_config_fits(config: Any, model_dir: str | Path) -> None:
    """Refuse at start a GRPO run whose learner does not fit ``resources.learner.
    gpu_memory_gb`` by the model (nothing is checked when that is 0, or for OPD)."""
    budget = config.resources.learner.gpu_memory_gb
    if not budget or config.objective != "grpo":
        return
    shape = ModelShape.from_hf_config(Path(model_dir) / "config.json")
    try:
        check_learner_memory(shape, layout_of(config), int(budget * GB))
    except ValueError as exc:
        raise ValueError(f"resources.learner.gpu_memory_gb {budget:g}: {exc}") from exc


def fits(shape: ModelShape, layout: LearnerLayout, gpu_bytes: int) -> bool:
    return memory_per_gpu(shape, layout).total_bytes <= gpu_bytes


def _ceil_div(n: int, d: int) -> int:
    return -(-n // d)


__all__ = [
    "DTYPE_BYTES",
    "GB",
    "LORA_TARGETS",
    "PHASES",
    "LearnerLayout",
    "LoraSpec",
    "MemoryEstimate",
    "ModelShape",
    "check_config_fits",
    "check_learner_memory",
    "fits",
    "layout_of",
    "memory_per_gpu",
]
