"""Tiny random Hugging Face models, made and saved by transformers itself (no hub)."""
from __future__ import annotations

import torch

from megatron_lbp.testing import hf_env

VOCAB = 96
SEQ = 64


def make(kind: str, out_dir: str, seed: int = 0, vocab: int = VOCAB, **save_kwargs):
    """Build a tiny ``kind`` model with random weights, save it to ``out_dir``, return it (eval, fp32)."""
    tf = hf_env.transformers()
    VOCAB = vocab  # noqa: N806
    torch.manual_seed(seed)
    if kind == "gpt2":                      # tied, learned positions, biases, tanh GELU
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ,
                            resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
        model = tf.GPT2LMHeadModel(cfg)
    elif kind == "llama_gqa_untied":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                             tie_word_embeddings=False, rope_theta=10000.0)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "gpt2_demo":               # GPT-2 family at the shipped corpus's vocabulary
        cfg = tf.GPT2Config(vocab_size=4096, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ,
                            resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
        model = tf.GPT2LMHeadModel(cfg)
    elif kind == "llama_demo":              # the shipped corpus's vocabulary (tokenizer/lbp_bpe.model)
        cfg = tf.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                             tie_word_embeddings=False, rope_theta=10000.0)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "llama_tied":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                             tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":                   # q/k/v biases, GQA, tied
        cfg = tf.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=SEQ,
                             tie_word_embeddings=True, use_sliding_window=False)
        model = tf.Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model = model.float().eval()
    with torch.no_grad():
        # transformers starts biases at 0 and norms at 1: a mapping that mixed them up would pass.
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out_dir, **save_kwargs)
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


TEXTS = ["The quick brown fox jumps over the lazy dog.", "Continued pretraining on our own documents.",
         "Low-bandwidth partitioning shards weights inside a package and gradients inside a node."]


def make_tokenizer(out_dir: str, vocab: int = 320, texts=None):
    """A byte-level BPE trained by the tokenizers library on ``texts`` (TEXTS by default), saved as
    transformers saves one (tokenizer.json, tokenizer_config.json) plus GPT-2's vocab.json and
    merges.txt; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tf = hf_env.transformers()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(texts) if texts is not None else TEXTS * 4, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                      bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    tok.model.save(out_dir)          # vocab.json, merges.txt
    return fast
