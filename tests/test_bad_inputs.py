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
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import flatzero
from flatzero.deepspeed.engine.config import load_config_dict, parse_config

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
    ("empty file", lambda d: _write(d, ""), ValueError, "ds.json' is empty"),
    ("blank file", lambda d: _write(d, " \n "), ValueError, "ds.json' is empty"),
    ("empty string", lambda d: "", ValueError, "config file '' does not exist"),
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


# (a config's change, what the error must name): numbers past what a count can mean
_BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e30}},
     "'zero_optimization.reduce_bucket_size' is 1e+30: it must be <= 9,007,199,254,740,992"),
    ({"fp16": {"enabled": True, "initial_scale_power": 10**6}},
     "'fp16.initial_scale_power' is 1000000: it must be <= 64"),
    ({"flatzero": {"staging_buffers": 10**9}}, "staging_buffers is 1,000,000,000, more than"),
    ({"flatzero": {"bucket_numel": 10**15}}, "bucket_numel is 1,000,000,000,000,000, more than"),
    ({"gradient_accumulation_steps": 2**60}, "'gradient_accumulation_steps' is"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "match"), _BAD_VALUES, ids=lambda c: str(c)[:40])
def test_config_value_out_of_bounds_is_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_config({**_GOOD, **change}, world_size=1)


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
    ("compiled DDP", lambda m: {"model": torch.compile(_ddp(m)), "config": _GOOD},
     r"DistributedDataParallel.*model\.module"),
]  # fmt: skip


def test_deepscale_config_is_read_as_deepspeed_does() -> None:
    from flatzero.deepspeed.engine.initialize import _config_argument

    class Old:
        deepscale_config = "ds.json"

    assert _config_argument(nn.Linear(2, 2), None, None, None, None, Old()) == "ds.json"


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
    from flatzero.storage import tensorfile

    path = tmp_path / "rank0.safetensors"
    path.write_bytes(b"\0" * 16)

    def denied(*_args: Any, **_kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tensorfile, "open", denied, raising=False)  # root reads a chmod-0 file
    with pytest.raises(ValueError, match=r"cannot read .*rank0.safetensors: Permission denied"):
        tensorfile.open_safetensors(path)


def test_empty_param_group_is_refused_with_its_index() -> None:
    model = nn.Linear(4, 4)
    groups = [{"params": [model.weight]}, {"params": [], "lr": 0.5}, {"params": [model.bias]}]
    with pytest.raises(ValueError, match=r"param group\(s\) \[1\] have no trainable params"):
        flatzero.ZeroOptimizer(groups, optimizer=torch.optim.SGD, lr=0.1)
    flatzero.ZeroOptimizer([groups[0], groups[2]], optimizer=torch.optim.SGD, lr=0.1).close()


# --------------------------------------------------------------------- checkpoint loads
# Every field a load reads from a checkpoint is checked before anything changes
# (checkpoint/validate.py). One checkpoint is saved (fp16 loss scaler, StepLR, RNG states,
# a buffer, the engine's counters); each case edits a copy of it and loads it.


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 33).half()
        self.b = nn.Linear(33, 5).half()
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x.half()))).float().pow(2).mean()


def _zero(seed: int) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)
    net = _Net()
    opt = flatzero.ZeroOptimizer(
        net.named_parameters(),
        torch.optim.AdamW,
        flatten_config=flatzero.FlattenConfig(bucket_numel=200, progress=False),
        lr=1e-3,
    )
    return net, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    from flatzero.checkpoint import SaveConfig, save_checkpoint

    root = tmp_path_factory.mktemp("saved")
    net, opt, sched = _zero(0)
    for _ in range(2):
        opt.backward(net(torch.ones(4, 7)))
        opt.step()
        sched.step()
    counters = {"global_steps": 2, "global_samples": 8, "micro_steps": 2, "skipped_steps": 0}
    save_checkpoint(
        root,
        opt,
        "t",
        scheduler=sched,
        model=net,
        extra={"flatzero_engine": counters},
        config=SaveConfig(save_rng=True),
    )
    opt.close()
    return root


def _meta_edit(edit: Any) -> Any:
    """A case that edits ``meta.json``'s dict (the layout digest follows the layout, as a
    careful hand edit would make it)."""

    def apply(ckpt: Path) -> None:
        from flatzero.layout import Layout

        path = ckpt / "t" / "meta.json"
        data = json.loads(path.read_text())
        edit(data)
        try:
            data["layout_digest"] = Layout.from_dict(data["layout"]).digest()
        except Exception:
            data.pop("layout_digest", None)
        path.write_text(json.dumps(data))

    return apply


def _rank_file_edit(edit: Any) -> Any:
    """A case that rewrites rank 0's file (``edit(tensors, metadata)``), its size recorded."""

    def apply(ckpt: Path) -> None:
        from safetensors import safe_open
        from safetensors.torch import save_file

        path = ckpt / "t" / "rank_00000-of-00001.safetensors"
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            metadata = dict(f.metadata())
        edit(tensors, metadata)
        save_file(tensors, str(path), metadata)
        meta = ckpt / "t" / "meta.json"
        data = json.loads(meta.read_text())
        data["files"][0]["bytes"] = path.stat().st_size
        meta.write_text(json.dumps(data))

    return apply


def _set(*keys: Any, value: Any) -> Any:
    def edit(data: Any) -> None:
        for key in keys[:-1]:
            data = data[key]
        data[keys[-1]] = value

    return edit


def _group0(data: Any) -> Any:
    return data["groups"][0]


def _layout_group0(data: Any) -> Any:
    return data["layout"]["groups"][0]


def _tensor(value: Any, dtype: str = "float32") -> dict[str, Any]:
    return {"__tensor__": value, "dtype": dtype, "shape": []}


# (name, edit of the saved checkpoint, what the error must name)
_BAD_CHECKPOINTS: list[tuple[str, Any, str]] = [
    ("step < 0", _meta_edit(lambda d: _group0(d)["scalars"].update(step=_tensor(-5.0))),
     r"groups\[0\]\.scalars\['step'\]"),
    ("step is text", _meta_edit(lambda d: _group0(d)["scalars"].update(step="abc")),
     r"groups\[0\]\.scalars\['step'\]"),
    ("scalar of no dtype", _meta_edit(lambda d: _group0(d)["scalars"].update(
        step=_tensor(1, "nonsense"))), r"scalars\['step'\] cannot be decoded"),
    ("lr < 0", _meta_edit(lambda d: _group0(d)["hyperparams"].update(lr=-1.0)),
     r"groups\[0\]\.hyperparams are refused by AdamW.*learning rate"),
    ("one beta", _meta_edit(lambda d: _group0(d)["hyperparams"].update(
        betas={"__tuple__": [0.9]})), r"groups\[0\]\.hyperparams are refused by AdamW"),
    ("amsgrad without its state", _meta_edit(lambda d: _group0(d)["hyperparams"].update(
        amsgrad=True)), r"groups\[0\] holds states .*keeps \['exp_avg', 'exp_avg_sq', 'max_exp"),
    ("a state dropped", _meta_edit(lambda d: _group0(d).update(states=["master", "exp_avg"])),
     r"groups\[0\] holds states \['exp_avg'\].*AdamW.*keeps \['exp_avg', 'exp_avg_sq'\]"),
    ("state not listed first", _meta_edit(lambda d: _group0(d).update(states=["exp_avg"])),
     r"groups\[0\]\.states is \['exp_avg'\]; it must start with 'master'"),
    ("loss scale < 0", _meta_edit(_set("loss_scaler", "scale", value=-1.0)),
     r"loss_scaler\.scale is -1\.0"),
    ("loss scale inf", _meta_edit(_set("loss_scaler", "scale", value={"__float__": "inf"})),
     r"loss_scaler\.scale"),
    ("good_steps text", _meta_edit(_set("loss_scaler", "good_steps", value="x")),
     r"loss_scaler\.good_steps is 'x'"),
    ("scheduler epoch text", _meta_edit(_set("scheduler", "last_epoch", value="x")),
     r"scheduler\['last_epoch'\]"),
    ("scheduler lrs short", _meta_edit(_set("scheduler", "base_lrs", value=[])),
     r"scheduler\['base_lrs'\] has another type or length"),
    ("scheduler a list", _meta_edit(_set("scheduler", value=[1, 2])),
     r"scheduler is a list, not a state dict"),
    ("scheduler of another kind", _meta_edit(lambda d: d["scheduler"].pop("step_size")),
     r"missing \['step_size'\].*load_lr_scheduler_states=False"),
    ("stage text", _meta_edit(_set("stage", value="2")), r"stage is '2', not 0, 1, 2"),
    ("bucket order text", _meta_edit(_set("bucket_order", value=["a"])), r"bucket_order is"),
    ("model_rest outside", _meta_edit(_set("model_rest", value="../../etc/passwd")),
     r"model_rest is '\.\./\.\./etc/passwd', not a file name"),
    ("rank file outside", _meta_edit(_set("files", 0, "file", value="../x.safetensors")),
     r"files\[0\]\.file is '\.\./x\.safetensors'"),
    ("tensor shape", _meta_edit(_set("files", 0, "tensors", "g0.master", "shape", value=[5])),
     r"files\[0\]\.tensors\['g0\.master'\]\.shape is \[5\].*shard of"),
    ("tensor dtype", _meta_edit(_set("files", 0, "tensors", "g0.exp_avg", "dtype", value="x")),
     r"files\[0\]\.tensors\['g0\.exp_avg'\]\.dtype"),
    ("saved_at text", _meta_edit(_set("saved_at", value="yesterday")), r"saved_at is 'yesterday'"),
    ("world size 0", _meta_edit(_set("layout", "world_size", value=0)),
     r"files for ranks \[0\] but the checkpoint was written by 0 ranks"),
    ("alignment 0", _meta_edit(_set("layout", "alignment", value=0)), r"layout\.alignment is 0"),
    ("shard offset", _meta_edit(lambda d: _layout_group0(d)["buckets"][-1].update(
        shard_offset=7)), r"buckets\[\d+\]\.shard_offset is 7, expected"),
    ("param past its bucket", _meta_edit(lambda d: _layout_group0(d)["params"][0].update(
        offset=10**6)), r"params\[0\]\.offset is 1000000"),
    ("name twice", _meta_edit(lambda d: _layout_group0(d)["params"][1].update(
        name=_layout_group0(d)["params"][0]["name"])), r"params\[1\]\.name is .*used twice"),
    ("layout dtype", _meta_edit(lambda d: _layout_group0(d).update(dtype="float3")),
     r"layout\.groups\[0\]\.dtype is 'float3'"),
    ("engine step < 0", _meta_edit(_set("extra", "flatzero_engine", "global_steps", value=-1)),
     r"flatzero_engine\.global_steps is -1"),
    ("engine step text", _meta_edit(_set("extra", "flatzero_engine", "micro_steps", value="2")),
     r"flatzero_engine\.micro_steps is '2'"),
    ("python RNG", _rank_file_edit(lambda t, m: m.update({"rng.python": "[3, [1], null]"})),
     r"RNG state 'rng\.python' cannot be restored"),
    ("torch RNG", _rank_file_edit(lambda t, m: t.update({"rng.torch": t["rng.torch"][:9]})),
     r"tensor 'rng\.torch' is torch\.uint8 of shape \[9\], but .*meta\.json records"),
    ("master in float64", _rank_file_edit(lambda t, m: t.update(
        {"g0.master": t["g0.master"].double()})), r"tensor 'g0\.master' is torch\.float64"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "edit", "match"), _BAD_CHECKPOINTS, ids=lambda c: c)
def test_load_refuses_a_malformed_checkpoint(tmp_path: Path, saved: Path, name, edit, match):
    import shutil

    from flatzero.checkpoint import load_checkpoint
    from flatzero.deepspeed.engine.checkpointing import _check_engine_state

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    edit(ckpt)
    files = _files(ckpt)
    net, opt, sched = _zero(1)
    before = (
        [p.detach().clone() for p in net.parameters()],
        opt.state_dict()["loss_scaler"],
        sched.state_dict(),
        torch.get_rng_state(),
    )
    with pytest.raises(ValueError, match=match) as caught:
        load_checkpoint(ckpt, opt, scheduler=sched, model=net, check_extra=_check_engine_state)
    assert str(ckpt) in str(caught.value)  # names the file
    assert all(torch.equal(a, b) for a, b in zip(before[0], net.parameters(), strict=True))
    assert before[1:3] == (opt.state_dict()["loss_scaler"], sched.state_dict())
    assert torch.equal(before[3], torch.get_rng_state())
    assert _files(ckpt) == files  # nothing written
    opt.close()


def test_the_saved_checkpoint_loads(tmp_path: Path, saved: Path) -> None:
    """The table's checkpoint itself loads (each case fails by its edit alone)."""
    from flatzero.checkpoint import load_checkpoint
    from flatzero.deepspeed.engine.checkpointing import _check_engine_state

    net, opt, sched = _zero(1)
    load_checkpoint(saved, opt, scheduler=sched, model=net, check_extra=_check_engine_state)
    assert sched.state_dict()["last_epoch"] == 2
    opt.close()
