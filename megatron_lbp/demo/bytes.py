"""Bytes per link class of the main job's model under other presets, for the PNG's second panel.

The zero3 and zeropp rows do not need a training run of their own: bytes per
optimizer step are fixed by the model, the topology, the micro-batches and the
preset, not by the data. One multi-rank job (the forkserver of
megatron_lbp.testing.multirank: torch and megatron-core imported once, not per
rank and per launch) builds the main job's GPT with megatron-core on the same
ranks and emulated nodes, runs one optimizer step of each preset through the
engine and returns each one's ledger record, the same record
``--hier-comm-report`` writes. lbp is run too and must give exactly the bytes
the main job's own ``pretrain()`` run reported: that is the check that the two
count the same model and topology.
"""
from __future__ import annotations

import resource
from typing import Any

from megatron_lbp.demo.runs import MICRO_BATCH, MODEL, SAMPLES_PER_RANK

VOCAB = 4096  # the shipped tokenizer's vocabulary (already a multiple of Megatron's padding)


def preset_argv(preset: str, gpus_per_node: int, extra: tuple[str, ...]) -> list[str]:
    return ["--hier-preset", preset, "--hier-gpus-per-node", str(gpus_per_node), *extra]


def _rank_bytes(presets: dict[str, tuple[str, ...]], gpus_per_node: int, bf16: bool):
    import torch

    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, setup_hier

    spec = TinyGPTSpec(num_layers=MODEL["num-layers"], hidden_size=MODEL["hidden-size"],
                       num_attention_heads=MODEL["num-attention-heads"], vocab_size=VOCAB,
                       seq_length=MODEL["seq-length"],
                       params_dtype=torch.bfloat16 if bf16 else torch.float32)
    # One step: every step's record, the first included, counts the same bytes (a step's
    # weight gathers issued under the next forward are charged to it).
    train = TrainSpec(steps=1, micro_batch_size=MICRO_BATCH,
                      micro_batches=SAMPLES_PER_RANK // MICRO_BATCH)
    out = {}
    for preset, extra in presets.items():
        trainer = setup_hier(spec, train, preset_argv(preset, gpus_per_node, extra))
        result = trainer.run(range(train.steps))
        out[preset] = result.step_reports[-1]["traffic_bytes"]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return out, usage.ru_utime + usage.ru_stime


def measure(presets: dict[str, tuple[str, ...]], ranks: int, gpus_per_node: int, bf16: bool,
            timeout: float = 600.0) -> tuple[dict[str, dict[str, Any]], float]:
    """({preset: {"package", "node", "network"}} bytes rank 0 sent in one optimizer step,
    CPU seconds of all ranks together)."""
    from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks

    per_rank = run_on_ranks(_rank_bytes, ranks, presets, gpus_per_node, bf16,
                            rank_env=rank_location_env(gpus_per_node), timeout=timeout)
    return per_rank[0][0], sum(cpu for _, cpu in per_rank)
