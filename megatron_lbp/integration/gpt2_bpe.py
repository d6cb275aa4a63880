"""GPT-2's byte-level BPE from its two files, ``vocab.json`` and ``merges.txt``, with no network.

The Hugging Face ``tokenizers`` BPE loaded from the two files in the pipeline
transformers' ``GPT2TokenizerFast`` builds (byte-level pre-tokenizer without a prefix
space, no unknown token, ``<|endoftext|>`` special and also bos/eos/unk; no pad token,
as in Megatron-LM's GPT-2 tokenizer). tests/e2e/test_gpt2_bpe.py checks its ids against
tiktoken's reading of the same files on the shipped corpus. ``GPT2BPE`` has the methods
megatron-core's text tokenizer calls; megatron_adapter.py puts it where megatron-core
would fetch ``GPT2BPETokenizer`` from the hub. Imports nothing from Megatron.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Iterable

EOD_TOKEN = "<|endoftext|>"


class GPT2FilesError(ValueError):
    """vocab.json / merges.txt that cannot make a GPT-2 tokenizer; the message is one line naming the file."""


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise GPT2FilesError("--tokenizer-type GPT2BPETokenizer needs the 'tokenizers' package, "
                             "which is not installed: pip install -r requirements.txt") from None
    return tokenizers


def read_vocab(vocab_file: str) -> dict[str, int]:
    """vocab.json as {token: id}, checked: ids 0..N-1 each once, ``<|endoftext|>`` among them."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except FileNotFoundError:
        raise GPT2FilesError(f"--vocab-file {vocab_file} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise GPT2FilesError(f"--vocab-file {vocab_file} cannot be read ({err})") from None
    except json.JSONDecodeError as err:
        raise GPT2FilesError(f"--vocab-file {vocab_file} is not JSON ({err.msg} at line {err.lineno} "
                             f"column {err.colno}): give GPT-2's vocab.json") from None
    if not isinstance(vocab, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in vocab.items()):
        raise GPT2FilesError(f"--vocab-file {vocab_file} is not a GPT-2 vocab.json (a JSON object "
                             "mapping each token to its integer id)")
    if sorted(vocab.values()) != list(range(len(vocab))):
        # The embedding has one row per id up to the vocabulary size: a gap or a repeat
        # would send some token past it or give two tokens one row.
        raise GPT2FilesError(f"--vocab-file {vocab_file}: the {len(vocab)} ids are not 0..{len(vocab) - 1} "
                             "each once")
    if EOD_TOKEN not in vocab:
        raise GPT2FilesError(f"--vocab-file {vocab_file} has no {EOD_TOKEN} token (GPT-2's end of "
                             "document, which Megatron appends to every document)")
    return vocab


def load(vocab_file: str, merge_file: str):
    """A ``tokenizers.Tokenizer`` for the two files, or GPT2FilesError naming the one at fault."""
    tk = _tokenizers()
    read_vocab(vocab_file)
    if not os.path.isfile(merge_file):
        raise GPT2FilesError(f"--merge-file {merge_file} does not exist")
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

    try:
        bpe = models.BPE.from_file(vocab_file, merge_file, dropout=None, unk_token=None,
                                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    except Exception as err:  # the library's only error type here; vocab.json is already valid
        text = str(err).replace("Error while reading BPE files: ", "").replace(
            "Error while initializing BPE: ", "")
        raise GPT2FilesError(f"--merge-file {merge_file} does not fit GPT-2's merges.txt format "
                             f"with --vocab-file {vocab_file} ({text})") from None
    tok = tk.Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=True)])
    return tok


class GPT2BPE:
    """GPT-2 BPE from local files, with the interface megatron-core's text tokenizer expects of a library."""

    def __init__(self, vocab_file: str, merge_file: str, additional_special_tokens: Iterable[str] = (),
                 include_special_tokens: bool = True):
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self.tokenizer = load(vocab_file, merge_file)
        # transformers' GPT-2 tokenizer: <|endoftext|> is bos, eos and unk.
        self.bos_token = self.eos_token = self.unk_token = EOD_TOKEN
        self.include_special_tokens = include_special_tokens
        self._additional = []
        self.add_special_tokens({"additional_special_tokens": list(additional_special_tokens or [])})
        self._inv_vocab: dict[int, str] = {}

    # --- text <-> ids -----------------------------------------------------------------
    def text_to_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def ids_to_text(self, ids, remove_special_tokens: bool | None = None) -> str:
        if remove_special_tokens is None:
            remove_special_tokens = not self.include_special_tokens
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=remove_special_tokens)

    def text_to_tokens(self, text: str) -> list[str]:
        return self.tokenizer.encode(text).tokens

    def tokens_to_text(self, tokens: list[str]) -> str:
        return self.tokenizer.decoder.decode(list(tokens))

    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return [self.tokenizer.token_to_id(t) for t in tokens]

    def ids_to_tokens(self, ids) -> list[str]:
        return [self.tokenizer.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int:
        return self.tokenizer.token_to_id(token)

    # --- special tokens ---------------------------------------------------------------
    def add_special_tokens(self, special_tokens) -> int:
        """Tokens added as special (new ones get the next ids); a dict as transformers takes it, or a list."""
        if isinstance(special_tokens, dict):
            names = list(special_tokens.get("additional_special_tokens") or [])
            names += [v for k, v in special_tokens.items() if k != "additional_special_tokens" and v]
        else:
            names = list(special_tokens)
        from tokenizers import AddedToken

        added = self.tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=True) for t in names])
        self._additional += [t for t in names if t not in self._additional and t != EOD_TOKEN]
        self._inv_vocab = {}
        return added

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return self.tokens_to_ids(self._additional)

    @property
    def eod(self) -> int:
        return self.tokenizer.token_to_id(EOD_TOKEN)

    eos_id = bos_id = unk_id = eod

    # --- vocabulary -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Every id, added tokens included (what Megatron pads to --make-vocab-size-divisible-by)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> list[str]:
        inv = self.inv_vocab
        return [inv[i] for i in range(len(inv))]

    @property
    def inv_vocab(self) -> dict[int, str]:
        if not self._inv_vocab:
            self._inv_vocab = {i: t for t, i in self.tokenizer.get_vocab(with_added_tokens=True).items()}
        return self._inv_vocab

    def save_pretrained(self, path: str) -> None:
        """The two files, under GPT-2's names (what megatron-core saves for its 'megatron' library)."""
        os.makedirs(path, exist_ok=True)
        shutil.copyfile(self.vocab_file, os.path.join(path, "vocab.json"))
        shutil.copyfile(self.merge_file, os.path.join(path, "merges.txt"))
