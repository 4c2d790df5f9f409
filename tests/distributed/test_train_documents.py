"""``evenpipe train --documents``: documents train the same pipelined (P=2, two replicas) as un-pipelined, each
micro-batch as long as its longest row, and the first step's loss is the whole model's on the same documents with
attention kept inside each."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from harness import run_train

pytestmark = pytest.mark.distributed

SEQ = 16


def _documents(tmp: pathlib.Path) -> pathlib.Path:
    gen = torch.Generator().manual_seed(5)
    path = tmp / "docs.jsonl"
    lines = []
    for _ in range(60):
        n = int(torch.randint(2, SEQ + 2, (1,), generator=gen))
        lines.append(json.dumps({"tokens": torch.randint(0, 256, (n,), generator=gen).tolist()}))
    path.write_text("\n".join(lines + ['{"tokens": []}']) + "\n")  # one empty document: skipped
    return path


def _reference_first_loss(docs: pathlib.Path, policy: str) -> float:
    """Step 0 of the job below, un-pipelined: the mean over its micro-batches of each one's mean token loss."""
    from evenpipe.models import build_model, lm_loss, model_config
    from evenpipe.models.documents import Documents
    from evenpipe.runtime.document_batches import DocumentBatches
    data = DocumentBatches(path=str(docs), seq_len=SEQ, vocab=256, seed=3, policy=policy, num_replicas=2,
                           num_microbatches=4, rows_per_microbatch=1)
    batch = data.batch(0, 8)
    model = build_model(model_config("gpt-tiny", seq_len=SEQ), seed=3)
    if policy == "pad":  # one document a micro-batch: each as long as its document (pack fills rows of 16 here)
        assert len({t.shape[-1] for t in batch.tokens}) > 1, "micro-batches of one length only"
    with torch.no_grad():
        losses = [lm_loss(model(t[:, 0], Documents(t[:, 1])), y) for t, y in zip(batch.tokens, batch.targets)]
    return float(torch.stack(losses).mean())


@pytest.mark.parametrize("policy", ["pad", "balance"])
def test_packed_documents_pipelined_equal_unpipelined(tmp_path: pathlib.Path, policy: str) -> None:
    docs = _documents(tmp_path)
    common = ["--model", "gpt-tiny", "--seq-len", str(SEQ), "--microbatches", "4", "--microbatch-size", "1",
              "--steps", "3", "--seed", "3", "--documents", str(docs), "--microbatching", policy, "--timeout", "60"]
    piped, _ = run_train([*common, "--stages", "2", "--dp", "2", "--schedule", "1f1b"], tmp_path / "p.json",
                         timeout_s=240)
    single, _ = run_train([*common, "--stages", "1", "--dp", "2"], tmp_path / "s.json", timeout_s=240)
    for a, b in zip(piped["losses"], single["losses"]):
        assert abs(a - b) / abs(b) < 1e-5, (piped["losses"], single["losses"])
    assert abs(piped["losses"][0] - _reference_first_loss(docs, policy)) < 1e-5
    assert piped["config"]["data"]["microbatching"] == policy
    assert piped["documents"] == {"documents": 60, "skipped": 1, "cut": 0}  # the empty one skipped, counted
