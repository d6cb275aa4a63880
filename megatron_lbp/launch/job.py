"""The job a launch plans for, typed: resolved once at an edge (the launcher's environment,
job_env.py; the estimate's command line and ``plan --choose``, estimate.py; both by the rules
of job_values.py), then read by the memory fit (candidates.py) and the choice (choose.py).
Fields keep Megatron's and the launcher's names; ``auto`` marks what the planner chooses.
A job is never changed: a variant is ``dataclasses.replace(job, ...)``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_lbp.core.config import DEFAULT_BUCKET_SIZE
from megatron_lbp.core.plan import Model, query_groups


@dataclass(frozen=True, eq=False)
class Job:
    # the machine
    nodes: int = 1
    tasks_per_node: int = 8
    gcds_per_package: int = 2
    gcd_memory_gb: float = 64.0
    reserve_gb: float = 0.0
    # the model (Megatron's flags and defaults)
    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    seq_length: int = 0
    vocab_size: int = 0
    ffn_hidden_size: int = 0                  # 0: 4 * hidden
    position_embedding_type: str = "rope"
    max_position_embeddings: int = 0          # 0: seq_length
    untie_embeddings_and_output_weights: bool = False
    swiglu: bool = False
    group_query_attention: bool = False
    num_query_groups: int | None = None
    kv_channels: int | None = None
    normalization: str = "LayerNorm"
    disable_bias_linear: bool = False
    add_qkv_bias: bool = False
    params_dtype: str = "bf16"
    # the hierarchy: preset "auto" is chosen by projected step time
    preset: str = "lbp"
    hier_secondary_group_size: int = 0
    hier_secondary_dtype: str | None = None   # None: the preset's (int8 for lbp)
    hier_grad_reduce_dtype: str | None = None  # None: the preset's (bf16 for zeropp under bf16)
    bucket_size: int = DEFAULT_BUCKET_SIZE
    # the batch
    global_batch_size: int = 1
    micro_batch_size: Any = "auto"            # "auto" or an int
    recompute: str = "full"                   # "auto", "none", "selective", "full"
    # the transient knobs ("auto" or a setting)
    hier_prefetch_units: Any = "auto"
    hier_max_pending_reduces: Any = "auto"
    hier_embedding_backward_gather: str = "auto"
    hier_layer_unit: str = "auto"
    # timing: the cost model's inputs, or a measured step
    step_seconds: float = 0.0
    mfu: float = 0.35
    peak_tflops: float | None = None
    network_model: str = "per_rank"
    links: dict | None = None                 # measured {class: bytes/s per GCD}, loaded
    survey: Any = None                        # a projection.collectives.CollectiveModel, loaded
    # saving and the run's length
    train_iters: int = 150000
    save_interval: Any = "auto"
    save_minutes: float = 45.0
    milestone_every: int = 0
    write_gbps_per_node: float = 1.0
    save_fixed_s: float = 60.0
    # what to print
    compare: bool = False
    choose: bool = False
    verbose: bool = False

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    def model(self) -> Model:
        """The model as the planner counts it (core.plan.Model)."""
        return Model(self.num_layers, self.hidden_size, self.vocab_size,
                     ffn_hidden_size=self.ffn_hidden_size or None,
                     table_rows=self.max_position_embeddings or self.seq_length,
                     position_embedding_type=self.position_embedding_type,
                     tied=not self.untie_embeddings_and_output_weights, swiglu=self.swiglu,
                     num_attention_heads=self.num_attention_heads,
                     num_query_groups=query_groups(self.group_query_attention,
                                                   self.num_query_groups),
                     kv_channels=self.kv_channels, normalization=self.normalization,
                     add_bias_linear=not self.disable_bias_linear,
                     add_qkv_bias=self.add_qkv_bias)

    def gpt2_architecture(self) -> bool:
        """Whether the layers are GPT-2's (what the committed traces record): Megatron's
        defaults for every architecture flag."""
        return not (self.untie_embeddings_and_output_weights or self.swiglu
                    or self.group_query_attention or self.disable_bias_linear
                    or self.add_qkv_bias or self.num_query_groups or self.kv_channels
                    or self.normalization != "LayerNorm"
                    or self.max_position_embeddings not in (0, self.seq_length))

    @classmethod
    def fields_of(cls, namespace) -> "Job":
        """A job from a parsed namespace's attributes of the same names (the others ignored)."""
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in vars(namespace).items() if k in names})
