"""The imported model's own tokenizer, from its directory, offline, in preprocessing and training flags."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from megatron_lbp.hf.importer import import_model
from megatron_lbp.testing import hf_env
from tests.helpers import hf_models
from tests.helpers.pretrain_runner import REPO

RUN_PREPROCESS = ("import runpy, sys; sys.path.append({extra!r}) if {extra!r} else None; "
                  "runpy.run_module('megatron_lbp.preprocess_data', run_name='__main__', "
                  "alter_sys=True)")


def _preprocess(flags, jsonl, prefix, with_transformers: bool):
    code = RUN_PREPROCESS.format(extra=hf_env.path() if with_transformers else "")
    return subprocess.run([sys.executable, "-c", code, *flags, "--input", str(jsonl),
                           "--output-prefix", str(prefix)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})


def _documents(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix) + "_text_document")
    return [np.asarray(ds[i]).tolist() for i in range(len(ds))]


@pytest.mark.slow   # three preprocessing processes, each importing megatron-core
def test_imported_models_tokenizers_drive_preprocessing(tmp_path):
    import json

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in hf_models.TEXTS))
    for kind, want_type in (("llama_gqa_untied", "HuggingFaceTokenizer"), ("gpt2", "GPT2BPETokenizer")):
        src = tmp_path / f"{kind}-hf"
        hf_models.make(kind, str(src), vocab=320)
        reference = hf_models.make_tokenizer(str(src), vocab=320)
        report = import_model(str(src), str(tmp_path / f"{kind}-mg"))
        tok = report.flags[report.flags.index("--tokenizer-type"):]
        assert tok[1] == want_type, tok
        # GPT-2's two files need no transformers; a tokenizer.json does
        out = _preprocess(tok, jsonl, tmp_path / kind, with_transformers=want_type != "GPT2BPETokenizer")
        assert out.returncode == 0, out.stdout + out.stderr
        want = [reference.encode(t, add_special_tokens=False) + [reference.eos_token_id]
                for t in hf_models.TEXTS]
        assert _documents(tmp_path / kind) == want, kind
    refused = _preprocess(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                              str(tmp_path / "llama_gqa_untied-mg" / "hf")],
                          jsonl, tmp_path / "refused", with_transformers=False)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode != 0 and len(lines) == 1 and "pip install '.[hf]'" in lines[0], refused.stderr
