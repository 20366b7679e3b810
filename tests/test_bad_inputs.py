"""Bad inputs at each entry point get a clear error naming the input, nothing is written or
changed (issue 29): the config reader (one function for dicts, files and base64 strings,
with DeepSpeed's semantics), ``flatzero.initialize``'s arguments, and a checkpoint of
another optimizer class. Single process; the cross-rank cases are in
test_rank_agreement.py, the CLI's in test_cli.py.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import flatzero
from flatzero.engine.config import load_config_dict, parse_config

_GOOD = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# (name, how to write the input under tmp_path -> the config argument, error type, match)
_BAD_CONFIGS: list[tuple[str, Any, type[Exception], str]] = [
    ("duplicate key", lambda d: _write(d, '{"a": 1, "a": 2}'), ValueError,
     r"duplicate keys \['a'\]"),
    ("nested duplicate", lambda d: _write(d, '{"zero_optimization": {"stage": 1, "stage": 2}}'),
     ValueError, r"duplicate keys \['stage'\]"),
    ("directory", lambda d: str(d), ValueError, "is a directory"),
    ("not UTF-8", lambda d: _write(d, b'{"a": "\xff"}'), ValueError, "is not UTF-8 text"),
    ("not JSON", lambda d: _write(d, "{"), ValueError, "is not valid JSON"),
    ("a list", lambda d: _write(d, "[1, 2]"), TypeError, "must hold a JSON object, not list"),
    ("missing file", lambda d: str(d / "nope.json"), ValueError, "nope.json' does not exist"),
    ("base64 with duplicate", lambda d: _b64('{"a": 1, "a": 2}'), ValueError, "does not exist"),
    ("an int", lambda d: 3, TypeError, "config must be a dict, the path"),
]  # fmt: skip


def _write(directory: Path, content: str | bytes) -> str:
    path = directory / "ds.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


@pytest.mark.parametrize(("name", "make", "error", "match"), _BAD_CONFIGS, ids=lambda c: c)
def test_config_reader_refuses(tmp_path: Path, name, make, error, match) -> None:
    config = make(tmp_path)
    before = _files(tmp_path)
    with pytest.raises(error, match=match) as caught:
        load_config_dict(config)
    if isinstance(config, str) and config.startswith(str(tmp_path)):
        assert repr(config) in str(caught.value), caught.value  # names the file
    assert _files(tmp_path) == before


def test_config_reader_reads_what_deepspeed_reads(tmp_path: Path) -> None:
    hjson_text = '{\n  // a comment\n  "train_micro_batch_size_per_gpu": 1,\n}\n'
    strict = json.dumps(_GOOD)
    assert load_config_dict(_write(tmp_path, hjson_text)) == {"train_micro_batch_size_per_gpu": 1}
    assert load_config_dict(_b64(strict)) == _GOOD
    assert load_config_dict(_b64(hjson_text)) == {"train_micro_batch_size_per_gpu": 1}
    assert load_config_dict(Path(_write(tmp_path, strict))) == _GOOD
    assert load_config_dict(_GOOD) == _GOOD


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_config_says_what_the_os_said(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps(_GOOD))
    os.chmod(path, 0)
    with pytest.raises(ValueError, match="Permission denied"):
        load_config_dict(path)


@pytest.mark.parametrize("section", ["zero_optimization", "bf16", "fp16", "optimizer", "scheduler"])
def test_null_section_is_refused(section: str) -> None:
    with pytest.raises(ValueError, match=f"config key '{section}' is None: it must be a JSON"):
        parse_config({**_GOOD, section: None}, world_size=1)


class _Args:
    deepspeed_config = "ds.json"


def _ddp(module: nn.Module) -> nn.Module:
    """A ``DistributedDataParallel`` object without a process group (only its type
    matters to the check)."""
    wrapped = object.__new__(torch.nn.parallel.DistributedDataParallel)
    nn.Module.__init__(wrapped)
    wrapped.module = module
    return wrapped


_BAD_ARGUMENTS: list[tuple[str, Any, str]] = [
    ("two configs", lambda m: {"model": m, "config": _GOOD, "args": _Args()},
     "two DeepSpeed configs: args.deepspeed_config='ds.json' and config="),
    ("DDP", lambda m: {"model": _ddp(m), "config": _GOOD},
     r"DistributedDataParallel.*model\.module"),
    ("torch.compile", lambda m: {"model": torch.compile(m), "config": _GOOD},
     r"OptimizedModule.*model\._orig_mod"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "kwargs", "match"), _BAD_ARGUMENTS, ids=lambda c: c)
def test_initialize_refuses(name: str, kwargs, match: str) -> None:
    model = nn.Linear(4, 4)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((ValueError, TypeError), match=match):
        flatzero.initialize(**kwargs(model))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_optimizer_state_of_another_class_is_refused(tmp_path: Path) -> None:
    from flatzero.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    adamw = flatzero.ZeroOptimizer(model.parameters(), optimizer=torch.optim.AdamW, lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    adamw.step()
    save_checkpoint(tmp_path, adamw, "t", model=model)
    adamw.close()
    other = nn.Linear(4, 4)
    sgd = flatzero.ZeroOptimizer(other.parameters(), optimizer=torch.optim.SGD, lr=1e-3)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(ValueError, match="holds AdamW optimizer state and this optimizer is SGD"):
        load_checkpoint(tmp_path, sgd, "t", model=other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
    assert "betas" not in sgd.param_groups[0]
    load_checkpoint(
        tmp_path,
        sgd,
        "t",
        model=other,
        config=flatzero.checkpoint.LoadConfig(load_optimizer_states=False),
    )


def test_unreadable_rank_file_says_what_the_os_said(tmp_path: Path, monkeypatch) -> None:
    from flatzero.checkpoint import stfile

    path = tmp_path / "rank0.safetensors"
    path.write_bytes(b"\0" * 16)

    def denied(*_args: Any, **_kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(stfile, "open", denied, raising=False)  # root reads a chmod-0 file
    with pytest.raises(ValueError, match=r"cannot read .*rank0.safetensors: Permission denied"):
        stfile.open_safetensors(path)


def test_empty_param_group_is_refused_with_its_index() -> None:
    model = nn.Linear(4, 4)
    groups = [{"params": [model.weight]}, {"params": [], "lr": 0.5}, {"params": [model.bias]}]
    with pytest.raises(ValueError, match=r"param group\(s\) \[1\] have no trainable params"):
        flatzero.ZeroOptimizer(groups, optimizer=torch.optim.SGD, lr=0.1)
    flatzero.ZeroOptimizer([groups[0], groups[2]], optimizer=torch.optim.SGD, lr=0.1).close()
