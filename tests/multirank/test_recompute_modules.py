"""Megatron's selective recomputation modules (``--recompute-modules``) under the hierarchy.

``mlp`` runs each layer's MLP forward again inside the backward, through megatron-core's
checkpoint function: with ``--hier-layer-unit split`` that forward is the MLP unit's own
module, so its forward hooks fire inside the backward (the path full recomputation takes
for whole layers, which split refuses). On 4 gloo ranks (2 nodes of one package of 2), a
Llama-style model (no linear biases) with core_attn and mlp recomputed trains under lbp
with whole layers like stock Megatron, and split bit for bit like whole.

The two module sets megatron-core 0.19.2 cannot run here (``mlp`` with linear biases,
``layernorm`` without Transformer Engine) are refused by
megatron_lbp.integration.capabilities before any process starts
(tests/unit/test_capabilities.py); the first test shows, in stock megatron-core, the
failure each refusal prevents, and that the refusal's probe sees what megatron-core does.
"""
import torch

from megatron_lbp.engine.schedule import in_autograd_backward
from megatron_lbp.testing import tiny_gpt as tg
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from tests.engine.test_engine_equivalence import FP32_REL, assert_same_training

WORLD = 4
TRAIN = tg.TrainSpec(steps=2, micro_batches=2, bucket_size=20000)
LBP = ["--hier-preset", "lbp", "--hier-gpus-per-node", "2", "--hier-gcds-per-package", "2"]
RECOMPUTED = ("core_attn", "mlp")


def _stock_forward(arch: str, modules: tuple[str, ...]) -> dict:
    """One forward of the plain megatron-core model with these modules recomputed."""
    tg.init_megatron_state()
    spec = tg.TinyGPTSpec(**tg.ARCHITECTURES[arch], recompute_modules=modules)
    model, _ = tg.build_tiny_gpt(spec)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_length))
    try:
        tg.forward_loss(model, tokens)
    except Exception as err:  # noqa: BLE001 - what the first forward raised is the answer
        return {"raised": f"{type(err).__name__}: {err}"}
    return {"raised": None, "fc2_bias_is_leaf": model.decoder.layers[0].mlp.linear_fc2.bias.is_leaf}


def _stock_failures() -> dict:
    return {"mlp": _stock_forward("megatron-defaults", RECOMPUTED),
            "layernorm": _stock_forward("llama", ("core_attn", "layernorm"))}


def test_the_refused_module_sets_fail_in_stock_megatron_core_as_the_probe_says():
    from megatron_lbp.integration.capabilities import probe_environment

    env = probe_environment("cpu")
    got = run_on_ranks(_stock_failures, 1, timeout=300)[0]
    mlp, norm = got["mlp"], got["layernorm"]
    assert mlp["raised"] is None, mlp
    # A non-leaf bias is what sends the backward round without end (not run here for that reason).
    assert mlp["fc2_bias_is_leaf"] == (env.mlp_recompute_with_bias is None), \
        f"after a forward with mlp recomputed linear_fc2's bias is_leaf={mlp['fc2_bias_is_leaf']}, " \
        f"the capability probe says {env.mlp_recompute_with_bias!r}"
    if env.te:
        assert norm["raised"] and "FP8GlobalStateManager" in norm["raised"], \
            f"without Transformer Engine ({env.te}) layernorm recomputation gave {norm}"
    else:
        assert norm["raised"] is None, norm


def _train_counting_recomputed_mlps(configs: dict) -> dict:
    """{name: (TrainResult, MLP forwards run inside a backward)}; argv None: stock Megatron."""
    out = {}
    spec = tg.TinyGPTSpec(**tg.ARCHITECTURES["llama"], recompute_modules=RECOMPUTED)
    for name, argv in configs.items():
        trainer = tg.setup_stock(spec, TRAIN) if argv is None else tg.setup_hier(spec, TRAIN, argv)
        inside = [0]
        mlps = [m for n, m in trainer.model.named_modules() if n.endswith(".mlp")]
        for m in mlps:
            m.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] + in_autograd_backward()))
        result = trainer.run(range(TRAIN.steps))
        result.params = trainer.final_params()
        out[name] = (result, inside[0], len(mlps))
    return out


def test_mlp_recomputation_trains_like_stock_with_whole_and_split_layers():
    configs = {"stock": None, "whole": LBP + ["--hier-layer-unit", "whole"],
               "split": LBP + ["--hier-layer-unit", "split"]}
    ranks = run_on_ranks(_train_counting_recomputed_mlps, WORLD, configs,
                         rank_env=rank_location_env(2), timeout=600)
    for rank, runs in enumerate(ranks):
        for name, (_, inside, layers) in runs.items():
            want = layers * TRAIN.steps * TRAIN.micro_batches
            assert inside == want, \
                f"rank {rank}, {name}: {inside} MLP forwards inside the backward, want {want} " \
                "(one recomputation per layer and micro-batch)"
        stock, whole, split = (runs[n][0] for n in ("stock", "whole", "split"))
        assert_same_training(whole, stock, FP32_REL, f"rank {rank}: lbp, whole layers, mlp recomputed")
        assert split.losses == whole.losses, \
            f"rank {rank}: losses split {split.losses}, whole {whole.losses}"
        for name, w in whole.params.items():
            diff = (split.params[name] - w).abs().max().item()
            assert diff == 0, f"rank {rank}: final {name} split differs from whole by {diff:.3g}"
