"""megatron_lbp/deepspeed_baseline/schemes.py: each named scheme's DeepSpeed config, and its refusals (no ranks)."""
import pytest

from megatron_lbp.deepspeed_baseline.schemes import SCHEMES, ds_config

SHAPE = dict(micro_batch_size=2, micro_batches=4, dp_size=16, ranks_per_node=8, clip_grad=1.0)


def test_each_scheme_switches_on_what_its_name_says():
    zero = {s: ds_config(s, **SHAPE)["zero_optimization"] for s in SCHEMES}
    assert all(z["stage"] == 3 for z in zero.values())
    assert "zero_hpz_partition_size" not in zero["ds-zero3"]
    assert zero["ds-hpz"]["zero_hpz_partition_size"] == 8
    assert not any(k.startswith("zero_quantized") for k in zero["ds-hpz"])
    assert (zero["ds-zeropp"]["zero_hpz_partition_size"], zero["ds-zeropp"]["zero_quantized_weights"],
            zero["ds-zeropp"]["zero_quantized_gradients"]) == (8, True, True)
    # small-model settings, so that a tiny model is partitioned and regathered like a large one
    for z in zero.values():
        assert (z["stage3_param_persistence_threshold"], z["stage3_prefetch_bucket_size"],
                z["stage3_max_reuse_distance"]) == (0, 0, 0), z


def test_batch_shape_and_precision():
    c = ds_config("ds-zero3", **SHAPE)
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"],
            c["train_batch_size"], c["gradient_clipping"]) == (2, 4, 128, 1.0)
    assert "bf16" not in c and "fp16" not in c          # fp32
    assert ds_config("ds-zero3", bf16=True, **SHAPE)["bf16"] == {"enabled": True}


@pytest.mark.parametrize("scheme, changes, message", [
    ("ds-zero4", {}, "unknown DeepSpeed scheme 'ds-zero4'"),
    ("ds-hpz", dict(dp_size=8), "needs more than one node"),
    ("ds-zero3", dict(ranks_per_node=3), "ranks_per_node 3 does not divide"),
    ("ds-zero3", dict(micro_batches=0), "micro_batches must be a positive integer"),
])
def test_bad_shapes_are_refused_in_one_line(scheme, changes, message):
    with pytest.raises(ValueError, match=message):
        ds_config(scheme, **{**SHAPE, **changes})
