"""Rank functions of tests/engine/test_transient_model.py: the engine's transient peak, two ways.

``ledger``: the engine's own transient ledger (megatron_lbp.engine.memory), the
peak of the last step. ``storages``: independent of the ledger's arithmetic, the
bytes of the real storages behind every transient buffer the engine holds
(full weight units, full gradient units, reduce-scatter buffers in flight, the
step's 1/O gradients, the receive buffers of gathers in flight), summed at each
point where the engine allocates one, distinct storages once, the persistent
slices excluded.
"""
from __future__ import annotations

import torch

from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, setup_hier, tiny_gpt_config


def build_gpt(tied: bool):
    """The tiny GPT of megatron_lbp.testing.tiny_gpt, with tied or separate output weights."""
    def build(spec: TinyGPTSpec, sharded: bool = False):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from megatron_lbp.integration import megatron_adapter

        config = tiny_gpt_config(spec)

        def provide():
            torch.manual_seed(spec.seed)
            return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                            vocab_size=spec.vocab_size, max_sequence_length=spec.seq_length,
                            position_embedding_type="rope",
                            share_embeddings_and_output_weights=tied)

        model = megatron_adapter.build_sharded(provide, config) if sharded else provide()
        if config.bf16:   # as megatron.training (and tiny_gpt.build_tiny_gpt) wraps it
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        return model, config
    return build


def _tensors_of_pending(pending) -> list[torch.Tensor]:
    finish = getattr(pending, "_finish", None)
    cells = getattr(finish, "__closure__", None) or ()
    out = []
    for c in cells:
        try:
            v = c.cell_contents
        except ValueError:
            continue
        if isinstance(v, torch.Tensor):
            out.append(v)
    return out


def live_transient_bytes(model, extra=()) -> int:
    """Bytes of the distinct storages behind the engine's transient buffers now."""
    persistent = set()
    for b in model.buckets:
        for t in (b.primary, b.secondary, b.grad_shard):
            if t is not None:
                persistent.add(t.untyped_storage().data_ptr())
    tensors = []
    for u in model.units:
        # The reduced 1/O slice is held by the step's communication (engine/step_comm.py).
        step = model.step._units.get(id(u))
        tensors += [u.bucket.full, u.bucket.grad_full, step.grad if step else None]
        if u._pending is not None:
            tensors += _tensors_of_pending(u._pending)
    for r in list(model.schedule._pending_reduces) + list(extra):
        tensors += [r.out, r.send]
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in persistent and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def measure(runs: dict) -> dict:
    """{name: (ledger peak, storage peak, unit numels, config, unit kinds)} of the last of two
    steps."""
    out = {}
    for name, (spec, k, tied, argv) in runs.items():
        trainer = setup_hier(spec, TrainSpec(steps=2, micro_batch_size=1, micro_batches=k),
                             argv, build_model=build_gpt(tied))
        model = trainer.model
        peak = [0]
        ledger_alloc = model.transient.alloc

        def alloc(nbytes, ledger_alloc=ledger_alloc, model=model):
            ledger_alloc(nbytes)
            peak[0] = max(peak[0], live_transient_bytes(model))
        model.transient.alloc = alloc
        for u in model.units:
            start, unshard = u.start_reduce, u.unshard

            def start_reduce(*a, start=start, model=model, **kw):
                r = start(*a, **kw)
                peak[0] = max(peak[0], live_transient_bytes(model, (r,)))
                return r

            # Also once a gather is issued: its receive buffer is allocated before the unit
            # holds the pending gather that reaches it.
            def unshard_(*a, unshard=unshard, model=model, **kw):
                unshard(*a, **kw)
                peak[0] = max(peak[0], live_transient_bytes(model))
            u.start_reduce, u.unshard = start_reduce, unshard_
        trainer.run([0])
        peak[0] = 0
        result = trainer.run([1])
        ledger = result.step_reports[-1]["memory_bytes"]["peak_transient"]
        out[name] = (ledger, peak[0], model.bucket_numels(), trainer.hier.config.as_dict(),
                     [u.kind for u in model.units])
        del trainer, model
    return out
