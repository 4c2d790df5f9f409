"""``evenpipe train --documents``: bad documents and options are one line and exit code 2 before any process
starts; good ones reach the launcher with the policy parsed."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from evenpipe.cli import main

pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    launched: list[object] = []
    import evenpipe.training.launch as launch

    def fake(options: object, *, nproc: int) -> int:
        launched.append(options)
        return 0
    monkeypatch.setattr(launch, "launch_local", fake)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return launched


def _files(tmp: pathlib.Path) -> dict[str, str]:
    ok = tmp / "ok.jsonl"
    ok.write_text("".join(json.dumps({"tokens": [1, 2, 3, 4]}) + "\n" for _ in range(20)) + '{"tokens": []}\n')
    long = tmp / "long.jsonl"
    long.write_text(json.dumps({"tokens": list(range(100))}) + "\n")
    text = tmp / "text.jsonl"
    text.write_text(json.dumps({"text": "hello"}) + "\n")
    np.arange(10, dtype="uint16").tofile(tmp / "t.bin")
    np.asarray([0, 4, 12], dtype="<i8").tofile(tmp / "t.idx")
    return {"ok": str(ok), "long": str(long), "text": str(text), "bin": str(tmp / "t.bin")}


BAD = {
    "policy without documents": (["--microbatching", "pack"], "--microbatching applies to documents only"),
    "unknown policy": (["--documents", "{ok}", "--microbatching", "fifo"], "unknown micro-batching policy 'fifo'"),
    "missing file": (["--documents", "/nope/d.jsonl"], "does not exist"),
    "long document": (["--documents", "{long}", "--seq-len", "32"], "--split-long-documents"),
    "missing tokenizer": (["--documents", "{text}", "--tokenizer", "/nope/tokenizer.json"], "does not exist"),
    "offsets": (["--documents", "{bin}"], "do not match the token file: the last offset is 12"),
    "held-out split": (["--documents", "{ok}", "--eval-every", "2"], "--eval-every is not supported"),
}


@pytest.mark.parametrize("argv,needle", list(BAD.values()), ids=list(BAD))
def test_bad_documents_exit_2_with_one_line(tmp_path: pathlib.Path, argv: list[str], needle: str,
                                            capsys: pytest.CaptureFixture[str], no_launch: list[object]) -> None:
    files = _files(tmp_path)
    assert main(["train", "--seq-len", "16", *[a.format(**files) for a in argv]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not no_launch


def test_good_documents_reach_the_launcher(tmp_path: pathlib.Path, no_launch: list[object]) -> None:
    files = _files(tmp_path)
    long_ok = ["--documents", files["long"], "--split-long-documents", "--microbatching", "balance"]
    assert main(["train", "--seq-len", "16", "--stages", "2", *long_ok]) == 0
    config = no_launch[0]
    assert config.data.microbatching == "balance" and config.data.split_long_documents  # type: ignore[attr-defined]


def test_documents_exclude_the_other_sources(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _files(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--documents", files["ok"], "--tokens", files["bin"]])
    assert exit_.value.code == 2 and "not allowed with argument --documents" in capsys.readouterr().err
