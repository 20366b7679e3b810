"""Two jobs writing one directory, a ``latest`` that cannot be rewritten, and a synchronous
save into a full disk (issue 40 item 8), each with a real fault: the run id of each job in
``meta.json`` (``TORCHELASTIC_RUN_ID`` as torchrun sets it), a directory where ``latest``
must be written, a 4 MiB tmpfs filled by a ballast file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

import pytest
import torch

from flatzero import FlattenConfig
from flatzero.checkpoint import SaveConfig, load_checkpoint, read_latest, save_checkpoint
from flatzero.checkpoint.checkpointer import wait_for_save
from flatzero.optim import ZeroOptimizer


def _optimizer(width: int = 16) -> ZeroOptimizer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
    return ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        flatten_config=FlattenConfig(bucket_numel=4096, progress=False),
    )


def test_replacing_a_tag_of_another_run_warns_naming_both(tmp_path, monkeypatch, caplog):
    opt = _optimizer()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    save_checkpoint(tmp_path, opt, "t")
    assert json.loads((tmp_path / "t" / "meta.json").read_text())["run_id"] == "job-a"
    with caplog.at_level(logging.WARNING, logger="flatzero"):
        save_checkpoint(tmp_path, opt, "t", config=SaveConfig(overwrite=True))  # same run
        assert not [r for r in caplog.records if "written by run" in r.getMessage()]
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
        save_checkpoint(tmp_path, opt, "t", config=SaveConfig(overwrite=True))
    warned = [r.getMessage() for r in caplog.records if "written by run" in r.getMessage()]
    assert len(warned) == 1 and "run job-a" in warned[0] and "run job-b" in warned[0], warned
    assert json.loads((tmp_path / "t" / "meta.json").read_text())["run_id"] == "job-b"


def test_a_run_without_a_launcher_id_makes_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: names no job
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    save_checkpoint(tmp_path, _optimizer(), "t")
    made = json.loads((tmp_path / "t" / "meta.json").read_text())["run_id"]
    assert made.startswith(f"pid{os.getpid()}-")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_latest_that_cannot_be_rewritten_says_the_new_tag_is_published(tmp_path, asynchronous):
    opt = _optimizer()
    save_checkpoint(tmp_path, opt, "old")
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()  # a real fault: rename(2) cannot replace a directory
    (tmp_path / "latest" / "x").touch()
    with pytest.raises(OSError) as raised:
        save_checkpoint(tmp_path, opt, "new", asynchronous=asynchronous)
        wait_for_save(opt)
    text = str(raised.value)
    assert "is complete and published" in text and "tag='new'" in text, text
    assert "not published" not in text, text
    assert load_checkpoint(tmp_path, opt, "new").tag == "new"  # true: it is complete
    (tmp_path / "latest" / "x").unlink()
    (tmp_path / "latest").rmdir()
    save_checkpoint(tmp_path, opt, "next")  # fixed as the message says: saves on
    assert read_latest(tmp_path) == "next"


def test_a_synchronous_save_into_a_full_disk_names_its_file(small_disk):
    opt = _optimizer(width=256)  # ~0.8 MB a file: more than is left
    fd = os.open(small_disk / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with contextlib.suppress(OSError):
            while os.fstatvfs(fd).f_bavail * os.fstatvfs(fd).f_frsize > 256 * 1024:
                os.write(fd, b"\0" * 65536)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as raised:
        save_checkpoint(small_disk / "ckpt", opt, "t")
    assert raised.value.errno == 28, raised.value
    assert "rank_00000-of-00001.safetensors" in str(raised.value), raised.value
    assert not [p for p in (small_disk / "ckpt").iterdir() if p.name.startswith(".tmp-")]
