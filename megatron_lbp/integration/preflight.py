"""Checks of a training command's inputs that cost seconds now instead of an allocation later.

Run by the training entry after Megatron parses its arguments, before any process group
or model; each failure is a ``PreflightError`` with one line naming the input, and nothing
has been written. Checked: every ``--data-path`` prefix has a non-empty ``.bin`` and a
readable ``.idx`` and ``--split`` leaves every split with documents; the tokenizer can be
built offline and the data's token ids fit its vocabulary; a ``--load`` checkpoint was
written for the same model shape.
"""
from __future__ import annotations

import os
from typing import Any

from megatron_lbp.core.errors import one_line

# Arguments that decide tensor shapes: a checkpoint saved with other values cannot load.
SHAPE_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "num_query_groups", "padded_vocab_size", "max_position_embeddings")
SAMPLE_TOKENS = 1 << 20


class PreflightError(ValueError):
    pass


def check(args: Any) -> None:
    _, vocab = _data_and_tokenizer(args)
    _check_checkpoint_shape(args, vocab)


def check_data_and_tokenizer(args: Any) -> dict[str, dict[str, int]]:
    """The --data-path and tokenizer checks (the launcher's dry run runs these too:
    megatron_lbp/launch/contents.py): per prefix {documents, tokens, sampled, top, vocab}."""
    return _data_and_tokenizer(args)[0]


def _data_and_tokenizer(args: Any) -> tuple[dict[str, dict[str, int]], int | None]:
    from megatron_lbp.integration import data_splits

    datasets = _check_data(args)
    # Data from another tokenizer first: no --split makes it trainable.
    found = _check_tokenizer_and_data(args, datasets)
    try:
        data_splits.check(args, {prefix: len(ds) for prefix, ds in datasets.items()}
                          if not _per_split_paths(args) else {})
    except data_splits.SplitError as err:
        raise PreflightError(str(err)) from None
    return found


def _per_split_paths(args) -> bool:
    # --train-data-path and the like: each split is its own dataset, --split does not apply.
    return any(getattr(args, a, None) for a in ("train_data_path", "valid_data_path", "test_data_path"))


def _data_prefixes(args) -> list[str]:
    paths = list(getattr(args, "data_path", None) or [])
    # --data-path takes "prefix" or "weight prefix weight prefix ...".
    prefixes = [p for p in paths if not _is_number(p)]
    for attr in ("train_data_path", "valid_data_path", "test_data_path"):
        prefixes += [p for p in (getattr(args, attr, None) or []) if not _is_number(p)]
    return prefixes


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _check_data(args) -> dict[str, Any]:
    """The opened dataset of every --data-path prefix (the vocabulary check samples them)."""
    if getattr(args, "mock_data", False):
        return {}
    prefixes = _data_prefixes(args)
    if not prefixes and not getattr(args, "data_args_path", None):
        raise PreflightError("--data-path is missing: give the prefix of a preprocessed dataset "
                             "(python -m megatron_lbp.preprocess_data writes <prefix>.bin/.idx) or --mock-data")
    datasets = {}
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            path = prefix + ext
            if not os.path.isfile(path):
                raise PreflightError(f"--data-path {prefix}: {path} does not exist")
            if os.path.getsize(path) == 0:
                raise PreflightError(f"--data-path {prefix}: {path} is empty")
        try:
            ds = _open_indexed(prefix)
            if len(ds) == 0:
                raise PreflightError(f"--data-path {prefix}: the dataset has no documents")
            # A .bin cut short (a copy that stopped) reads as garbage or fails mid-training.
            index = ds.index
            need = int(index.sequence_pointers[-1]) + \
                int(index.sequence_lengths[-1]) * index.dtype_size
            have = os.path.getsize(prefix + ".bin")
            if have != need:
                raise PreflightError(f"--data-path {prefix}: {prefix}.bin has {have} bytes, the "
                                     f"index describes {need}: a truncated or mismatched pair")
        except PreflightError:
            raise
        except Exception as err:  # a torn or foreign file: say which, not Megatron's traceback
            raise PreflightError(f"--data-path {prefix}: cannot read the indexed dataset "
                                 f"({type(err).__name__}: {err})") from None
        datasets[prefix] = ds
    return datasets


def _open_indexed(prefix: str):
    """Megatron's IndexedDataset, minus the traceback its __del__ prints when the constructor failed."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    class _Checked(IndexedDataset):
        def __del__(self):
            if hasattr(self, "bin_reader") and hasattr(self, "index"):
                super().__del__()

    return _Checked(prefix, mmap=True)


def _check_tokenizer_and_data(args, datasets: dict[str, Any]) -> tuple[dict[str, dict[str, int]], int | None]:
    """(per prefix {documents, tokens, sampled, top, vocab}, the tokenizer's exact vocabulary)."""
    from megatron_lbp.integration import tokenizer_check

    try:
        exact = tokenizer_check.check(args)
    except tokenizer_check.TokenizerInputError as err:
        raise PreflightError(str(err)) from None
    if getattr(args, "mock_data", False):
        return {}, exact
    vocab = exact or getattr(args, "padded_vocab_size", None)
    if not vocab:
        return {}, exact
    found = {}
    source = getattr(args, "tokenizer_model", None) or getattr(args, "vocab_file", None) or ""
    for prefix, ds in datasets.items():
        seen, top = 0, -1
        for i in range(len(ds)):
            doc = ds[i]
            top = max(top, int(doc.max())) if len(doc) else top
            seen += len(doc)
            if seen >= SAMPLE_TOKENS:
                break
        if top >= vocab:
            raise PreflightError(
                f"--data-path {prefix} holds token id {top} but the tokenizer "
                f"({getattr(args, 'tokenizer_type', '?')} {source}) has a vocabulary of "
                f"{vocab}: the data was tokenized with another tokenizer")
        found[prefix] = {"documents": len(ds), "tokens": int(ds.sequence_lengths.sum()),
                         "sampled": seen, "top": top, "vocab": vocab}
    return found, exact


def _model_checkpoint(args) -> tuple[str, str] | None:
    """(flag, directory) of the checkpoint the run loads its model from, as Megatron picks it:
    --load when it holds one, else --pretrained-checkpoint; None when it starts from scratch."""
    for flag, attr in (("--load", "load"), ("--pretrained-checkpoint", "pretrained_checkpoint")):
        path = getattr(args, attr, None)
        if path and os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")):
            return flag, path
    return None


def _check_checkpoint_shape(args, tokenizer_vocab: int | None = None) -> None:
    from megatron_lbp.integration import schedule_check

    if getattr(args, "finetune", False) and getattr(args, "no_load_optim", False) \
            and not getattr(args, "pretrained_checkpoint", None):
        return
    picked = _model_checkpoint(args)
    if picked is None:
        return
    flag, load = picked
    tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
    common = _saved_common(flag, load, tracker, getattr(args, "ckpt_step", None))
    saved = common.get("args") if common else None
    if saved is None:
        return
    padded = _padded_vocab(args, tokenizer_vocab)
    model_vocab = getattr(saved, "padded_vocab_size", None)
    if padded is not None and model_vocab is not None and padded != model_vocab:
        raise PreflightError(
            f"{flag} {load}: the tokenizer's vocabulary of {tokenizer_vocab} (padded to {padded} by "
            f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by}) does not match the "
            f"model's vocabulary of {model_vocab}: use the tokenizer the model was trained with")
    diffs = []
    for name in SHAPE_ARGS:
        then, now = _effective(saved, name), _effective(args, name)
        if then is not None and now is not None and then != now:
            diffs.append(f"{name.replace('_', '-')} {then} (checkpoint) vs {now} (now)")
    if diffs:
        raise PreflightError(f"{flag} {load}: the checkpoint is for another model shape: "
                             + "; ".join(diffs))
    if flag == "--load":
        conflicts = schedule_check.conflicts(args, common.get("opt_param_scheduler"))
        if conflicts:
            raise PreflightError(schedule_check.message(load, conflicts))


def _padded_vocab(args, vocab: int | None) -> int | None:
    """megatron.training's padded vocabulary for a tokenizer of ``vocab`` (TP = 1 multiple)."""
    multiple = (getattr(args, "make_vocab_size_divisible_by", None) or 0) * \
        (getattr(args, "tensor_model_parallel_size", 1) or 1)
    if not vocab or not multiple:
        return None
    return -(-vocab // multiple) * multiple


def _effective(args, name: str):
    """The value that shapes the tensors (Megatron fills some defaults after parsing)."""
    value = getattr(args, name, None)
    if name == "num_query_groups" and not getattr(args, "group_query_attention", False):
        return getattr(args, "num_attention_heads", None)
    if name == "ffn_hidden_size" and value is None and getattr(args, "hidden_size", None):
        return 4 * args.hidden_size
    return value


def _saved_common(flag: str, load: str, tracker: str, step: int | None) -> dict | None:
    text = open(tracker).read().strip()
    if step is None and text != "release" and not text.isdigit():
        # Megatron would exit (status 0) with "Invalid metadata file" or a traceback.
        raise PreflightError(f"{flag} {load}: {tracker} holds {text[:40]!r}, not an iteration "
                             "number (torn by a kill during a stock-Megatron save?): write the "
                             "iteration of the last complete iter_* directory into it")
    iteration = step if step is not None and flag == "--load" else (None if text == "release" else int(text))
    ckpt = os.path.join(load, "release" if iteration is None else f"iter_{iteration:07d}")
    if not os.path.isfile(os.path.join(ckpt, "metadata.json")):
        raise PreflightError(f"{flag} {load}: {ckpt} has no metadata.json (an incomplete "
                             "checkpoint, or not in the torch_dist format)")
    _check_checkpoint_files(flag, load, ckpt)
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(ckpt)
    except Exception as err:
        raise PreflightError(f"{flag} {load}: cannot read {ckpt} ({one_line(err)})") from None
    return common


def _check_checkpoint_files(flag: str, load: str, ckpt: str) -> None:
    """Every file DCP's .metadata points into exists and is long enough (a copy cut short, a torn write)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(ckpt).read_metadata()
    except Exception as err:
        raise PreflightError(f"{flag} {load}: cannot read {os.path.join(ckpt, '.metadata')} "
                             f"({one_line(err)})") from None
    need: dict[str, int] = {}
    for info in (getattr(meta, "storage_data", None) or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        path = os.path.join(ckpt, rel)
        if not os.path.isfile(path):
            raise PreflightError(f"{flag} {load}: {path} is missing (an incomplete checkpoint)")
        have = os.path.getsize(path)
        if have < size:
            raise PreflightError(f"{flag} {load}: {path} is truncated ({have} of {size} bytes)")
