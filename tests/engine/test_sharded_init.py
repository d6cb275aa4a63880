"""Sharded initialization: no rank ever holds the whole model, and the weights are stock's.

The model is built by megatron_adapter.build_sharded (engine/materialize.py):
megatron-core's constructor runs with each module's weights dropped as soon
as the module is built, and again at wrap time to copy each rank's slices.
Checked on real gloo ranks against a plain megatron-core build with the same
seed, for both of Megatron's initialization paths (--use-cpu-initialization
and the device path under the CUDA RNG tracker, mapped to CPU by compat.py).
"""
import contextlib
import dataclasses

import pytest
import torch

from benchmarks.construction import measure_rank
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import (TinyGPTSpec, TrainSpec, build_tiny_gpt,
                                           init_megatron_state, setup_hier, train_stock_megatron)

ZERO3 = ["--hier-preset", "zero3"]
LBP_S2 = ["--hier-param-group-size", "2", "--hier-grad-group-size", "4",
          "--hier-optim-group-size", "4", "--hier-secondary-group-size", "2",
          "--hier-secondary-dtype", "bf16"]


SPECS = {f"{dtype}-{init}": TinyGPTSpec(use_cpu_initialization=init == "cpu-init",
                                         params_dtype={"fp32": torch.float32,
                                                       "bf16": torch.bfloat16}[dtype])
         for dtype in ("fp32", "bf16") for init in ("cpu-init", "device-init")}


def initial_weights_for_each_spec(specs, argv, bucket_size):
    return {label: initial_weights_against_stock(spec, argv, bucket_size)
            for label, spec in specs.items()}


def initial_weights_against_stock(spec, argv, bucket_size):
    """On every rank: a plain build's weights, sliced as the engine slices them, against what
    the sharded build left in each primary slice; and the generators after both builds."""
    from megatron_lbp.integration import megatron_adapter

    init_megatron_state(seed=spec.seed)
    stock, _ = build_tiny_gpt(spec)
    stock_values = {n: p.detach().clone() for n, p in stock.named_parameters()}
    stock_rng = megatron_adapter.RngSnapshot.take()
    del stock

    with _counting_materializations() as runs:
        trainer = setup_hier(spec, TrainSpec(bucket_size=bucket_size), argv)
    rng_equal = stock_rng.equals(megatron_adapter.RngSnapshot.take())
    mismatches, checked = _primary_mismatches(trainer.model, stock_values)
    return {"mismatches": mismatches, "checked": checked, "rng_equal": rng_equal,
            "materialized": len(runs), "dtype": str(trainer.model.buckets[0].dtype)}


@contextlib.contextmanager
def _counting_materializations():
    """How often the sharded construction's second run happened (it is the engine's own method)."""
    from megatron_lbp.engine import materialize

    runs, original = [], materialize.ShardedConstruction.materialize

    def counted(self, write):
        runs.append(1)
        return original(self, write)

    materialize.ShardedConstruction.materialize = counted
    try:
        yield runs
    finally:
        materialize.ShardedConstruction.materialize = original


def _primary_mismatches(ddp, stock_values):
    """Each bucket's primary slice against the same slice of the stock weights laid end to end."""
    mismatches, checked = [], 0
    for b in ddp.buckets:
        flat = torch.zeros(b.layout.padded_numel, dtype=b.dtype)
        for slot in b.slots:
            flat[slot.start:slot.stop] = stock_values[slot.name].reshape(-1)
        want = flat[b.primary_range.slice]
        checked += want.numel()
        if not torch.equal(b.primary, want):
            bad = (b.primary != want).nonzero()[0].item()
            mismatches.append(f"bucket {b.index} element {b.primary_range.start + bad}: "
                              f"{b.primary[bad].item()} vs stock {want[bad].item()}")
    return mismatches, checked


def test_initial_weights_equal_a_plain_megatron_build():
    """fp32 and bf16, Megatron's CPU-init and device-init paths, LBP with a secondary copy."""
    ranks = run_on_ranks(initial_weights_for_each_spec, 4, SPECS, LBP_S2, 20000,
                         rank_env=rank_location_env(4))
    for r, by_spec in enumerate(ranks):
        for label, res in by_spec.items():
            assert res["materialized"] == 1, f"rank {r} {label}: the sharded construction did not run"
            assert res["dtype"] == str(SPECS[label].params_dtype), (label, res)
            assert res["checked"] > 0 and not res["mismatches"], (
                f"rank {r} {label}: initial weights differ from stock: {res['mismatches'][:3]}")
            assert res["rng_equal"], (f"rank {r} {label}: the generators after the sharded build "
                                      "differ from a plain build's (dropout and data would draw "
                                      "other numbers)")


TRAINING_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--vocab-size", "128", "--tokenizer-type",
                 "NullTokenizer", "--mock-data", "--bf16", "--transformer-impl", "local",
                 "--no-gradient-accumulation-fusion", "--distributed-backend", "gloo",
                 "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                 "--no-bias-dropout-fusion", "--no-rope-fusion", "--attention-backend", "unfused"]


def through_get_model(extra_argv):
    """megatron.training's get_model (hooked as by python -m megatron_lbp.pretrain_gpt) on a
    model provider, against the same provider called plainly from the same seed."""
    import sys

    from megatron_lbp.integration import training_hooks

    training_hooks.install()
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import arguments, global_vars, training
    from megatron.training.argument_utils import core_transformer_config_from_args

    sys.argv = ["get_model", *TRAINING_ARGS, *extra_argv]
    args = arguments.parse_args()
    arguments.validate_args(args)
    global_vars.set_global_variables(args, build_tokenizer=False)

    def provider(pre_process=True, post_process=True, config=None, pg_collection=None,
                 vp_stage=None):
        return GPTModel(config=core_transformer_config_from_args(args),
                        transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                        max_sequence_length=32, position_embedding_type=args.position_embedding_type,
                        share_embeddings_and_output_weights=True, pre_process=pre_process,
                        post_process=post_process, pg_collection=pg_collection)

    init_megatron_state(seed=args.seed)
    stock = {f"module.{n}": p.detach().bfloat16() for n, p in provider().named_parameters()}
    init_megatron_state(seed=args.seed)
    with _counting_materializations() as runs:
        (ddp,) = training.get_model(provider, ModelType.encoder_or_decoder)
    mismatches, checked = _primary_mismatches(ddp, stock)
    config = core_transformer_config_from_args(args)
    return {"init_methods": [getattr(f, "__name__", repr(f)) for f in
                             (config.init_method, config.output_layer_init_method)],
            "wrapper": f"{type(ddp).__name__}({type(ddp.module).__name__})",
            "mismatches": mismatches, "checked": checked, "materialized": len(runs)}


def test_megatron_get_model_builds_sharded_with_stock_weights():
    """Megatron's default learned absolute positions (initialised after their module is attached,
    issue 25) and --init-method-xavier-uniform (compat.xavier_init_flag), through get_model."""
    ranks = run_on_ranks(through_get_model, 4, ["--use-cpu-initialization", "--hier-partition",
                                                "--hier-gpus-per-node", "4",
                                                "--position-embedding-type", "learned_absolute",
                                                "--init-method-xavier-uniform"],
                         rank_env=rank_location_env(4))
    for r, res in enumerate(ranks):
        assert res["wrapper"] == "HierDataParallel(Float16Module)", res["wrapper"]
        assert res["init_methods"] == ["xavier_uniform_"] * 2, res["init_methods"]
        assert res["materialized"] == 1, f"rank {r}: get_model did not build the model sharded"
        assert res["checked"] and not res["mismatches"], (
            f"rank {r}: weights after get_model differ from the provider's: {res['mismatches'][:3]}")


def peaks_and_stock_losses(specs, train, argv):
    """measure_rank (bench construction) per spec, then stock Megatron's first step on the same ranks."""
    out = {}
    for label, spec in specs.items():
        out[label] = measure_rank(spec, train, argv)
        out[label]["stock_losses"] = train_stock_megatron(spec, train).losses
    return out


@pytest.mark.slow
def test_construction_peak_per_rank_is_slices_plus_two_units_on_8_ranks():
    """zero3 on 8 ranks (P = 8: the full weights are 8x a primary slice); the allocator's own
    count of bytes while the model, the engine and the optimizer are built, on every rank,
    on both init paths."""
    # 8 layers: each gather unit (a layer) a small part of the model, as in a real one.
    specs = {label: dataclasses.replace(SPECS[label], num_layers=8)
             for label in ("fp32-cpu-init", "fp32-device-init")}
    train = TrainSpec(steps=1, micro_batches=2, bucket_size=20000)
    ranks = run_on_ranks(peaks_and_stock_losses, 8, specs, train, ZERO3,
                         rank_env=rank_location_env(4))
    for r, by_spec in enumerate(ranks):
        for label, res in by_spec.items():
            got, whole = res["sharded"], res["whole"]
            m = got["memory_bytes"]
            assert got["primary_fraction"] <= 1 / 8, got["primary_fraction"]
            assert got["peak_bytes"] <= got["bound_bytes"], (
                f"rank {r} {label}: construction peaked at {got['peak_bytes']:,} bytes, above "
                f"primary {m['primary']:,} + secondary {m['secondary']:,} + master and optimizer "
                f"{m['optimizer']:,} + 2 x largest unit {got['largest_bucket_bytes']:,} "
                f"= {got['bound_bytes']:,}")
            # The same count for a whole-model build breaks the bound: it is not loose.
            assert whole["peak_bytes"] > got["bound_bytes"], (r, label, whole)
            assert whole["peak_bytes"] >= whole["model_bytes"], (r, label, whole)
            assert got["losses"] == whole["losses"] == res["stock_losses"], (
                f"rank {r} {label}: first-iteration loss sharded {got['losses']}, whole "
                f"{whole['losses']}, stock Megatron {res['stock_losses']}")


def one_bucket_at_a_time(spec, argv, bucket_size):
    """state_dict, a plain load and broadcast_params: the most full-bucket bytes resident at once."""
    trainer = setup_hier(spec, TrainSpec(bucket_size=bucket_size), argv)
    ddp = trainer.model
    out = {"buckets": len(ddp.buckets), "largest": max(b.full_nbytes for b in ddp.buckets),
           "all": sum(b.full_nbytes for b in ddp.buckets)}
    for name, call in (("state_dict", ddp.state_dict), ("broadcast", ddp.broadcast_params)):
        ddp.transient.reset_peak()
        result = call()
        out[name] = ddp.transient.peak
        if name == "state_dict":
            state = result
    ddp.transient.reset_peak()
    ddp.load_state_dict(state)
    out["load"] = ddp.transient.peak
    out["state_keys"] = sorted(state)
    out["round_trip"] = all(torch.equal(state[k], v) for k, v in ddp.state_dict().items()
                            if torch.is_tensor(v))
    return out


def test_state_dict_load_and_broadcast_gather_one_bucket_at_a_time():
    ranks = run_on_ranks(one_bucket_at_a_time, 4, TinyGPTSpec(), ZERO3, 20000,
                         rank_env=rank_location_env(4))
    for r, res in enumerate(ranks):
        assert res["buckets"] >= 3, res
        for name in ("state_dict", "broadcast", "load"):
            assert res[name] <= res["largest"] < res["all"], (
                f"rank {r}: {name} held {res[name]:,} bytes of gathered weights at once; one "
                f"bucket is at most {res['largest']:,}, all of them {res['all']:,}")
        assert res["round_trip"], f"rank {r}: state_dict after load_state_dict(state_dict) differs"
        assert "embedding.word_embeddings.weight" in res["state_keys"], res["state_keys"][:5]
