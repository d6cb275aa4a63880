"""Hugging Face models in and out: import -> Megatron logits, import -> export bit-identical, refusals."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_lbp.hf.arch import UnsupportedModel, arch_from_config, megatron_flags
from megatron_lbp.hf.dcp_read import CheckpointReader
from megatron_lbp.hf.exporter import export_model
from megatron_lbp.hf.importer import ARGS_FILE, TOKENIZER_ARGS_FILE, import_model
from megatron_lbp.testing.hf_models import checkpoint_logits_many
from megatron_lbp.testing.multirank import run_single
from tests.helpers import hf_models

KINDS = ("gpt2", "llama_gqa_untied", "llama_tied", "qwen2")
# fp32, same maths in another order (fused qkv, other matmul shapes): measured 8.3e-7 (gpt2) and
# 6.0e-7 (the Llama family) on logits up to 2.2 (pytest -s prints them); a layout error (a head or
# gate/up swapped, a bias dropped) is ~1e-2.
LOGIT_ATOL = 1e-5


def _tensors(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, name)))
    return out


@pytest.mark.slow
def test_import_matches_transformers_logits_and_export_is_bit_identical(tmp_path):
    tokens = torch.randint(0, hf_models.VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    models, jobs = {}, []
    for kind in KINDS:
        models[kind] = hf_models.make(kind, str(tmp_path / kind / "hf"))
        report = import_model(str(tmp_path / kind / "hf"), str(tmp_path / kind / "mg"))
        with open(tmp_path / kind / "mg" / ARGS_FILE) as f:
            assert f.read().split() == report.flags
        tok = (tmp_path / kind / "mg" / TOKENIZER_ARGS_FILE).read_text().split()
        assert tok[0] == "--tokenizer-type" and report.flags[-len(tok):] == tok
        # streaming: the most tensor bytes alive at once is one output tensor and its inputs
        assert report.peak_tensor_bytes < report.total_bytes / 2, (kind, report)
        jobs.append((report.flags, str(tmp_path / kind / "mg" / "release")))
    got = run_single(checkpoint_logits_many, jobs, tokens, hf_models.VOCAB, timeout=600)
    for kind, logits in zip(KINDS, got):
        ref = hf_models.hf_logits(models[kind], tokens)
        diff = (logits[..., :hf_models.VOCAB] - ref).abs().max().item()
        print(f"{kind}: Megatron's logits vs transformers' max |difference| {diff:.3g} "
              f"(largest |logit| {ref.abs().max().item():.3g})")
        assert logits.shape[-1] == hf_models.VOCAB, (kind, logits.shape)
        assert diff <= LOGIT_ATOL, f"{kind}: Megatron's logits differ from transformers' by {diff:.3g}"

    tf = hf_models.hf_env.transformers()
    for kind in KINDS:
        out = tmp_path / kind / "out"
        export_model(str(tmp_path / kind / "mg"), str(tmp_path / kind / "mg" / "hf"), str(out))
        orig, back = _tensors(str(tmp_path / kind / "hf")), _tensors(str(out))
        assert sorted(orig) == sorted(back), (kind, set(orig) ^ set(back))
        for name in orig:
            assert orig[name].dtype == back[name].dtype and torch.equal(orig[name], back[name]), \
                f"{kind}: exported {name} differs from the imported model's"
        reloaded = tf.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
        assert torch.equal(hf_models.hf_logits(reloaded, tokens),
                           hf_models.hf_logits(models[kind], tokens)), kind


def test_import_reads_sharded_safetensors_and_pytorch_bins(tmp_path):
    model = hf_models.make("llama_gqa_untied", str(tmp_path / "one"))
    hf_models.make("llama_gqa_untied", str(tmp_path / "sharded"), max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    names = sorted(state)
    half = {n: state[n] for n in names[: len(names) // 2]}, {n: state[n] for n in names[len(names) // 2:]}
    weight_map = {}
    for i, part in enumerate(half):
        torch.save(part, bins / f"pytorch_model-{i + 1:05d}-of-00002.bin")
        weight_map.update({n: f"pytorch_model-{i + 1:05d}-of-00002.bin" for n in part})
    (bins / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    readers = {}
    for name in ("one", "sharded", "bins"):
        import_model(str(tmp_path / name), str(tmp_path / f"{name}.mg"))
        readers[name] = CheckpointReader(str(tmp_path / f"{name}.mg" / "release"))
    for key in readers["one"].tensors:
        want = readers["one"].read(key)
        for name in ("sharded", "bins"):
            assert torch.equal(readers[name].read(key), want), f"{name}: {key} differs from the single file's"


@pytest.mark.parametrize("cfg, field", [
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window"),
    ({"model_type": "mixtral"}, "model_type 'mixtral'"),
    ({"model_type": "llama", "num_local_experts": 8}, "num_local_experts"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}, "sliding_window"),
    ({"model_type": "gpt2", "activation_function": "relu"}, "activation_function"),
    ({"model_type": "gpt2", "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"model_type": "llama", "rope_theta": 10000.5}, "rope_theta"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
])
def test_refuses_what_megatron_cannot_express_in_one_line(cfg, field):
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96,
            "vocab_size": 96, "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 64}
    with pytest.raises(UnsupportedModel) as err:
        arch_from_config({**base, **cfg})
    msg = str(err.value)
    assert field in msg and "\n" not in msg, msg


def test_flags_describe_the_config():
    arch = arch_from_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "num_hidden_layers": 3, "intermediate_size": 96,
                             "vocab_size": 100, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
                             "rope_theta": 500000.0, "head_dim": 32})
    flags = megatron_flags(arch)
    pairs = {f: v for f, v in zip(flags, flags[1:] + [""]) if f.startswith("--") and not v.startswith("--")}
    assert pairs["--num-layers"] == "3" and pairs["--num-query-groups"] == "2"
    assert pairs["--kv-channels"] == "32" and pairs["--rotary-base"] == "500000"
    assert pairs["--make-vocab-size-divisible-by"] == "100"     # padded vocabulary = the model's rows
    assert "--untie-embeddings-and-output-weights" in flags and "--swiglu" in flags


def test_cli_refuses_in_one_line_before_writing(tmp_path):
    import subprocess
    import sys

    src = tmp_path / "mistral"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "mistral", "sliding_window": 4096,
                                                 "hidden_size": 64, "num_attention_heads": 4}))
    out = subprocess.run([sys.executable, "-m", "megatron_lbp.hf", "import", str(src), str(tmp_path / "mg")],
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "sliding_window" in lines[0], out.stderr
    assert not (tmp_path / "mg").exists()
