"""--tokenizer-type GPT2BPETokenizer from vocab.json + merges.txt with no network (issue 16 items 1-2).

The vocabulary is a byte-level BPE built here from the shipped corpus
(megatron_lbp/integration/build_gpt2_bpe.py, GPT-2's file layout). The path under test is
megatron-core's own ``build_tokenizer`` fed by megatron.training's tokenizer
flags, with megatron-lbp's GPT-2 library in place
(``megatron_adapter.install_gpt2_bpe_from_files``, on the Hugging Face
``tokenizers`` library). The reference is tiktoken reading the same two files
with its own loader of GPT-2's files (``data_gym_to_mergeable_bpe_ranks``, what
tiktoken's own ``gpt2`` encoding is made from), GPT-2's split pattern and its
own byte-level BPE: none of it shared with the library under test. The training
run has the hub switched off and empty caches (``offline_env``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import megatron_lbp  # noqa: F401  (typing.override shim before megatron.training)
from megatron_lbp.integration import tokenizer_check
from tests.launch.test_launchers import site  # noqa: F401  (fixture: fake site paths and a recording srun)

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data_src" / "python-docs-3.11.jsonl.gz"
BPE_TOKENS = 1000  # + <|endoftext|> = 1001 ids, which Megatron pads to 1024
EOD = BPE_TOKENS
# Strings the corpus may lack: other scripts, emoji, control and combining characters,
# whitespace runs and line ends, contractions, digits, the EOD token inside text.
EDGE = ["", " ", "  leading and trailing  ", "tabs\tand\r\nCRLF\n\n\nand   runs",
        "I'm we'll they'd it's I'M WE'LL", "12345 6.02e23 0x1F", "naïve café Ωμέγα Привет",
        "日本語のテキスト 中文", "emoji 🤖🚀 and ZWJ 👩‍💻", "e\u0301 combining", "nul\x00byte\x7f",
        "text <|endoftext|> more", "<|endoftext|>", "a" * 3000]


def offline_env(tmp: Path) -> dict:
    """No hub (HF_HUB_OFFLINE) and empty caches: Hugging Face's and Megatron's download cache."""
    for d in ("hf", "torch"):
        (tmp / d).mkdir(exist_ok=True)
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp / "hf"),
            "TORCH_HOME": str(tmp / "torch"), "XDG_CACHE_HOME": str(tmp)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    build = importlib.import_module("megatron_lbp.integration.build_gpt2_bpe")
    vocab, merges = build.build(tmp_path_factory.mktemp("gpt2"), BPE_TOKENS)
    return str(vocab), str(merges)


@pytest.fixture(scope="module")
def docs():
    return importlib.import_module("megatron_lbp.integration.build_gpt2_bpe").corpus_documents(CORPUS)


def megatron_tokenizer(*flags: str, divisible_by: int = 128, tp: int = 1):
    """The tokenizer megatron.training builds from these flags, and its arguments (padded vocabulary set)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
        from megatron.training import global_vars
        from megatron.training.arguments import _add_tokenizer_args

        from megatron_lbp.integration import megatron_adapter
    megatron_adapter.install_gpt2_bpe_from_files()  # what every entry point does at start-up
    assert global_vars.build_tokenizer is build_tokenizer  # the function pretrain_gpt reaches
    parser = argparse.ArgumentParser()
    _add_tokenizer_args(parser)
    args = parser.parse_args(list(flags))
    args.rank, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size = 1, divisible_by, tp
    return build_tokenizer(args), args


def gpt2_flags(files) -> list[str]:
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files[0], "--merge-file", files[1]]


@pytest.fixture(scope="module")
def tok(files):
    return megatron_tokenizer(*gpt2_flags(files))[0]


@pytest.fixture(scope="module")
def reference(files):
    """tiktoken's encoder for the two files: ``encode(text)`` with <|endoftext|> as its special token."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pattern (tiktoken's "gpt2" encoding)

    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # read the files, keep no copy
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=files[1], encoder_json_file=files[0])
    enc = tiktoken.Encoding("gpt2_small", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": EOD})
    return lambda text: enc.encode(text, allowed_special="all")


@pytest.fixture(scope="module")
def our_ids(tok, docs):
    return [tok.tokenize(text) for text in docs + EDGE]


# --- the files ----------------------------------------------------------------------


def test_built_files_have_gpt2s_layout(files, tmp_path):
    vocab = json.loads(Path(files[0]).read_text(encoding="utf-8"))
    merges = Path(files[1]).read_text(encoding="utf-8").splitlines()
    assert merges[0] == "#version: 0.2", merges[0]
    assert len(vocab) == BPE_TOKENS + 1 and vocab["<|endoftext|>"] == EOD
    assert sorted(vocab.values()) == list(range(len(vocab)))
    assert len(merges) - 1 == BPE_TOKENS - 256, "one merge per token beyond the 256 bytes"
    assert all(len(line.split(" ")) == 2 for line in merges[1:])
    build = importlib.import_module("megatron_lbp.integration.build_gpt2_bpe")
    again = build.build(tmp_path, BPE_TOKENS)
    assert [p.read_bytes() for p in again] == [Path(f).read_bytes() for f in files], "not reproducible"


# --- encoding, decoding, EOD, padding -----------------------------------------------


def test_ids_equal_the_reference_on_the_shipped_text(our_ids, reference, docs):
    for i, (text, ours) in enumerate(zip(docs + EDGE, our_ids)):
        ref = reference(text)
        if ours != ref:
            at = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
            raise AssertionError(f"text {i}: ids differ from tiktoken's at token {at}: ours {ours[at:at + 8]} "
                                 f"vs {ref[at:at + 8]} (text {text[:80]!r}...)")


def test_decode_round_trips_and_eod(tok, our_ids, docs):
    for i, (text, ids) in enumerate(zip(docs + EDGE, our_ids)):
        back = tok.detokenize(ids)
        assert back == text, f"text {i}: detokenize(tokenize(x)) != x, first difference at " \
            f"{next((j for j, (a, b) in enumerate(zip(back, text)) if a != b), min(len(back), len(text)))}"
    assert tok.eod == EOD and tok.tokenize("<|endoftext|>") == [EOD]
    assert tok.detokenize([EOD]) == "<|endoftext|>"
    assert tok.detokenize(tok.tokenize("a<|endoftext|>b"), skip_special_tokens=True) == "ab"
    with pytest.raises(AttributeError):
        tok.pad  # noqa: B018  no pad token: Megatron's GPTDataset pads with its own -1


@pytest.mark.parametrize("divisible_by,tp,padded", [(128, 1, 1024), (128, 2, 1024), (64, 1, 1024),
                                                    (100, 1, 1100), (1, 1, 1001)])
def test_vocabulary_pads_as_megatron_pads_it(files, divisible_by, tp, padded):
    tok, args = megatron_tokenizer(*gpt2_flags(files), divisible_by=divisible_by, tp=tp)
    assert tok.vocab_size == BPE_TOKENS + 1
    assert args.padded_vocab_size == padded, (divisible_by, tp, args.padded_vocab_size)
    assert len(tok.vocab) == tok.vocab_size and tok.inv_vocab[EOD] == "<|endoftext|>"


def test_a_gpt2_sized_vocabulary_pads_to_50304(files, tmp_path):
    """GPT-2's own size: 256 bytes + 50000 merges + <|endoftext|> = 50257 ids (its files are not shipped)."""
    base = [t for t, i in sorted(json.loads(Path(files[0]).read_text(encoding="utf-8")).items(),
                                 key=lambda kv: kv[1])][:256]
    merges = [(a, b) for a in base for b in base][:50000]
    vocab = {t: i for i, t in enumerate(base + [a + b for a, b in merges] + ["<|endoftext|>"])}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                         encoding="utf-8")
    tok, args = megatron_tokenizer(*gpt2_flags((str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))))
    assert (tok.vocab_size, tok.eod, args.padded_vocab_size) == (50257, 50256, 50304)


def test_extra_special_tokens_take_the_next_ids(files):
    tok, args = megatron_tokenizer(*gpt2_flags(files), "--tokenizer-special-tokens", "<fim_prefix>", "<fim_suffix>")
    assert tok.vocab_size == BPE_TOKENS + 3 and args.padded_vocab_size == 1024
    assert tok.tokenize("x<fim_prefix>y<fim_suffix>") == tok.tokenize("x") + [EOD + 1] + tok.tokenize("y") + [EOD + 2]
    assert tok.additional_special_tokens_ids == [EOD + 1, EOD + 2]


# --- preprocess -> train, offline ---------------------------------------------------


def _preprocess(out: Path, flags: list[str], docs, env: dict | None = None) -> str:
    """python -m megatron_lbp.preprocess_data on ``docs``: in this process, or with ``env`` in a fresh one."""
    src = out / "sample.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    argv = ["--input", str(src), "--output-prefix", str(out / "gpt2"), *flags]
    if env is None:
        import contextlib
        import io

        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = importlib.import_module("megatron_lbp.integration.preprocess_data").main(argv)
        stdout, stderr = stdout.getvalue(), stderr.getvalue()
    else:
        r = subprocess.run([sys.executable, "-m", "megatron_lbp.preprocess_data", *argv],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONWARNINGS": "ignore", **env})
        code, stdout, stderr = r.returncode, r.stdout, r.stderr
    assert code == 0, stderr[-2000:]
    assert "summary:" in stdout and f"eod {EOD} appended" in stdout, stdout
    return str(out / "gpt2_text_document")


def _read(prefix: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return IndexedDataset(prefix)


def test_preprocess_then_train_offline(files, tok, docs, tmp_path):
    """preprocess_data.py writes the library's ids + EOD; pretrain_gpt trains on them with a vocabulary of 1024."""
    from tests.helpers.pretrain_runner import TINY, run_pretrain, why

    env = offline_env(tmp_path)
    sample = docs[::8]
    prefix = _preprocess(tmp_path, gpt2_flags(files), sample)
    ds = _read(prefix)
    assert len(ds) == len(sample)
    for i in (0, len(sample) // 2, len(sample) - 1):
        assert ds[i].tolist() == tok.tokenize(sample[i]) + [EOD], f"document {i} of the dataset"

    sp = TINY.index("--tokenizer-type")
    args = TINY[:sp] + TINY[sp + 4:] + gpt2_flags(files) + [
        "--data-path", prefix, "--train-iters", "3", "--global-batch-size", "2"]
    code, log, losses = run_pretrain(1, args, env=env)
    assert code == 0, why(log)
    assert sorted(losses) == [1, 2, 3], why(log)
    # Near-uniform logits at initialization: the first loss is about ln(padded vocabulary).
    assert abs(losses[1] - math.log(1024)) < 0.3, f"first loss {losses[1]} vs ln 1024 = {math.log(1024):.3f}"


@pytest.mark.slow  # the same tokenizer path as the CI case above; here through the patched tree on 2 ranks
def test_patched_megatron_tree_trains_on_gpt2_bpe(files, tok, docs, tmp_path):
    import shutil

    import megatron

    from tests.helpers.pretrain_runner import TINY, run_pretrain, why

    tree = tmp_path / "megatron-copy"
    shutil.copytree(Path(megatron.__path__[0]), tree / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), str(tree)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    env = offline_env(tmp_path)
    prefix = _preprocess(tmp_path, gpt2_flags(files), docs[::8], env)
    sp = TINY.index("--tokenizer-type")
    args = TINY[:sp] + TINY[sp + 4:] + gpt2_flags(files) + [
        "--data-path", prefix, "--train-iters", "2", "--global-batch-size", "4",
        "--hier-partition", "--hier-gpus-per-node", "2"]
    code, log, losses = run_pretrain(2, args, env={**env, "LBP_RUNTIME_HOOKS": "0", "PYTHONPATH": str(tree)})
    assert code == 0, why(log)
    assert "megatron-lbp hierarchy (lbp): W=2 P=2" in log and sorted(losses) == [1, 2], why(log)
    assert abs(losses[1] - math.log(1024)) < 0.3, losses


@pytest.mark.slow  # why the adapter exists: megatron-core 0.19.2's own GPT-2 path, offline
def test_megatron_cores_own_gpt2_path_fails_offline(files, tmp_path):
    code = ("import megatron_lbp, warnings; warnings.simplefilter('ignore')\n"
            "from megatron.core.tokenizers.text.libraries import MegatronHFTokenizer\n"
            f"MegatronHFTokenizer('GPT2BPETokenizer', {files[0]!r}, {files[1]!r})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **offline_env(tmp_path)})
    assert r.returncode != 0 and "Unable to instantiate HuggingFace AutoTokenizer for gpt2" in r.stderr, r.stderr


# --- item 2: every documented type works offline or is refused in one line -----------


def _ns(**kw):
    return argparse.Namespace(**{"tokenizer_type": None, "tokenizer_model": None, "vocab_file": None,
                                 "merge_file": None, "vocab_size": None, "metadata_path": None, **kw})


def _refused(*needles, **kw):
    with pytest.raises(tokenizer_check.TokenizerInputError) as info:
        tokenizer_check.check(_ns(**kw))
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_check_accepts_what_works_offline(files, tmp_path):
    assert tokenizer_check.check(_ns(tokenizer_type="GPT2BPETokenizer", vocab_file=files[0],
                                     merge_file=files[1])) == BPE_TOKENS + 1
    sp_model = str(REPO / "tokenizer" / "lbp_bpe.model")
    for kind in tokenizer_check.SENTENCEPIECE_TYPES:
        assert tokenizer_check.check(_ns(tokenizer_type=kind, tokenizer_model=sp_model)) == 4096
    # megatron-core's NullTokenizer has --vocab-size ids (its end-of-document id the last of them)
    assert tokenizer_check.check(_ns(tokenizer_type="NullTokenizer", vocab_size=512)) == 512


def test_check_command_accepts_a_training_command_line(files, capsys):
    argv = ["--num-layers", "2", *gpt2_flags(files), "--tokenizer-special-tokens", "<x>", "--bf16"]
    assert tokenizer_check.main(argv) == 0
    assert capsys.readouterr().out == (f"ok: --tokenizer-type GPT2BPETokenizer builds here from local files, "
                                       f"vocabulary {BPE_TOKENS + 2}\n")


def test_check_refuses_gpt2_inputs_that_cannot_work(files, tmp_path):
    gpt2 = "GPT2BPETokenizer"
    _refused("--vocab-file", "--merge-file", "not given", "downloads", tokenizer_type=gpt2)
    _refused("--merge-file not given", tokenizer_type=gpt2, vocab_file=files[0])
    _refused("--vocab-file", "nope.json", "does not exist", tokenizer_type=gpt2,
             vocab_file=str(tmp_path / "nope.json"), merge_file=files[1])
    _refused("--merge-file", "nope.txt", "does not exist", tokenizer_type=gpt2, vocab_file=files[0],
             merge_file=str(tmp_path / "nope.txt"))
    (tmp_path / "bad.json").write_text("{not json")
    _refused("bad.json", "is not JSON", tokenizer_type=gpt2, vocab_file=str(tmp_path / "bad.json"),
             merge_file=files[1])
    (tmp_path / "list.json").write_text('["a", "b"]')
    _refused("list.json", "not a GPT-2 vocab.json", tokenizer_type=gpt2, vocab_file=str(tmp_path / "list.json"),
             merge_file=files[1])
    vocab = json.loads(Path(files[0]).read_text(encoding="utf-8"))
    del vocab["<|endoftext|>"]
    (tmp_path / "noeod.json").write_text(json.dumps(vocab))
    _refused("noeod.json", "<|endoftext|>", tokenizer_type=gpt2, vocab_file=str(tmp_path / "noeod.json"),
             merge_file=files[1])
    vocab["<|endoftext|>"] = len(vocab) + 5
    (tmp_path / "gap.json").write_text(json.dumps(vocab))
    _refused("gap.json", "not 0..1000", tokenizer_type=gpt2, vocab_file=str(tmp_path / "gap.json"),
             merge_file=files[1])
    (tmp_path / "merges.txt").write_text("#version: 0.2\nzzzq qqqz\n")
    _refused("--merge-file", "merges.txt", "out of vocabulary", tokenizer_type=gpt2, vocab_file=files[0],
             merge_file=str(tmp_path / "merges.txt"))


def test_check_refuses_other_types_without_local_files(tmp_path):
    _refused("--tokenizer-type is required")
    for kind in tokenizer_check.SENTENCEPIECE_TYPES:
        _refused(kind, "needs --tokenizer-model", tokenizer_type=kind)
    _refused("lbp_bpe.vocab", "does not load as a SentencePiece model", tokenizer_type="SentencePieceTokenizer",
             tokenizer_model=str(REPO / "tokenizer" / "lbp_bpe.vocab"))
    _refused("--tokenizer-model", "is not a file", tokenizer_type="SentencePieceTokenizer",
             tokenizer_model=str(tmp_path))
    hf = "HuggingFaceTokenizer"
    _refused("needs --tokenizer-model", tokenizer_type=hf)
    _refused("--tokenizer-model gpt2 is not a local directory", "hub", "save_pretrained", tokenizer_type=hf,
             tokenizer_model="gpt2")
    _refused("is a file", tokenizer_type=hf, tokenizer_model=str(REPO / "tokenizer" / "lbp_bpe.model"))
    _refused("NullTokenizer needs --vocab-size", tokenizer_type="NullTokenizer")
    _refused("--tokenizer-metadata", "does not exist", tokenizer_type="NullTokenizer", vocab_size=8,
             metadata_path=str(tmp_path / "meta.json"))
    if importlib.util.find_spec("tiktoken") is None:
        _refused("needs the 'tiktoken' package", tokenizer_type="TikTokenizer", tokenizer_model="x.json")


def test_huggingface_tokenizer_is_refused_without_transformers(tmp_path):
    """transformers is not a requirement: HuggingFaceTokenizer says so instead of megatron-core's NameError."""
    if importlib.util.find_spec("transformers") is not None:
        pytest.skip("transformers is installed here; the refusal is for environments without it")
    (tmp_path / "tokenizer.json").write_text("{}")
    _refused("needs the 'transformers' package", tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


@pytest.mark.slow
def test_frontier_profiles_default_tokenizer_takes_this_path(files, site):  # noqa: F811  (site: fixture)
    """scripts/frontier_gpt20b.sh as shipped (TOKENIZER_TYPE=GPT2BPETokenizer from VOCAB_FILE/MERGE_FILE)."""
    from tests.launch.test_launchers import SCRIPTS, run, training_line

    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=4, VOCAB_FILE=files[0], MERGE_FILE=files[1])
    assert r.returncode == 0, r.stderr + r.stdout
    argv = training_line(r.stdout)[4:]  # after "python -u -m megatron_lbp.pretrain_gpt"
    assert argv[argv.index("--tokenizer-type") + 1] == "GPT2BPETokenizer"
    assert tokenizer_check.main(argv) == 0
    tok, _ = megatron_tokenizer(*gpt2_flags((argv[argv.index("--vocab-file") + 1],
                                             argv[argv.index("--merge-file") + 1])))
    assert tok.eod == EOD
