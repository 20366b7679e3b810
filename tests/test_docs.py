"""Every code block of README.md and docs/*.md runs here or says why it cannot.

A fenced block names its language. A ``python``, ``bash``, ``sh``, ``shell`` or
``console`` block carries a marker on the line right before its fence (an HTML comment,
invisible on GitHub):

- ``<!-- docs-test: run -->``: run at tiny scale on the CPU, in a fresh temporary
  directory. Options: ``ranks=2`` (Python: under ``python -m torch.distributed.run
  --standalone --nproc-per-node 2``), ``setup=NAME`` (a stand-in prelude from ``SETUPS``
  below, giving the names the block assumes: ``model``, ``ds_config``, ...).
- ``<!-- docs-test: skip: REASON -->``: not run, with the reason ("needs 8 GPUs", ...).

A block of another language (``text`` for output and diagrams, ``json``) needs no marker;
a fence without a language fails, so new docs cannot leave a block unchecked. Python blocks
of one ``ranks`` run in one launch (one torch import per rank), each in a fresh namespace
and directory. Shell blocks run under ``bash -e`` with ``flatzero``, ``python`` and
``python3`` on ``PATH`` running this checkout's ``src``; a ``console`` block runs its
``$ `` lines, and the output lines it shows must be lines they printed, in order (``...``
for lines left out). A shell block's setup is Python run first in its directory.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flatzero import ZeroOptimizer
from flatzero.cli import main
from gloo_abort import run_again_after_gloo_abort

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PYTHON_LANGS = frozenset({"python"})
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
TIMEOUT_S = 300
"""Per process (a group of Python blocks, or one shell block), in seconds."""

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([^`\s]*)")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Marker:
    """A block's ``docs-test`` marker: run (with ranks and setup) or skip (with a reason)."""

    run: bool
    ranks: int = 1
    setup: str = ""
    reason: str = ""


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts (1-based line of the fence), language, text."""

    path: str
    line: int
    lang: str
    text: str
    marker: Marker | None
    marker_error: str = ""

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def parse_marker(comment: str) -> Marker:
    """The marker of ``comment``'s body (after ``docs-test:``); ValueError if malformed."""
    if comment.startswith("skip"):
        reason = comment[len("skip") :].lstrip(":").strip()
        if not reason:
            raise ValueError("a skip marker needs a reason: <!-- docs-test: skip: REASON -->")
        return Marker(run=False, reason=reason)
    words = comment.split()
    if not words or words[0] != "run":
        raise ValueError(f"docs-test marker is 'run ...' or 'skip: REASON', not {comment!r}")
    options = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    unknown = [w for w in words[1:] if "=" not in w] + sorted(set(options) - {"ranks", "setup"})
    if unknown:
        raise ValueError(f"unknown docs-test options {unknown} (ranks=N, setup=NAME)")
    return Marker(run=True, ranks=int(options.get("ranks", "1")), setup=options.get("setup", ""))


def parse_blocks(text: str, path: str) -> list[Block]:
    """The fenced blocks of markdown ``text``, each with the marker on the line before it."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence[1])),
            len(lines),
        )
        marker, error = None, ""
        before = _MARKER.match(lines[i - 1]) if i > 0 else None
        if before is not None:
            try:
                marker = parse_marker(before[1])
            except ValueError as e:
                error = str(e)
        blocks.append(Block(path, i + 1, fence[2], "\n".join(lines[i + 1 : end]), marker, error))
        i = end + 1
    return blocks


def problems(block: Block) -> list[str]:
    """What is wrong with ``block``'s language or marker (empty when nothing)."""
    if not block.lang:
        return [f"{block.name}: a fence names its language (`text` for output or diagrams)"]
    if block.marker_error:
        return [f"{block.name}: {block.marker_error}"]
    if block.lang not in PYTHON_LANGS | SHELL_LANGS:
        return []
    if block.marker is None:
        return [
            f"{block.name}: a {block.lang} block needs <!-- docs-test: run --> or "
            "<!-- docs-test: skip: REASON --> on the line before its fence"
        ]
    if block.marker.run and block.marker.setup and block.marker.setup not in SETUPS:
        return [f"{block.name}: setup={block.marker.setup} is not in tests/test_docs.py SETUPS"]
    if block.marker.run and block.lang in SHELL_LANGS and block.marker.ranks != 1:
        return [f"{block.name}: ranks= is for Python blocks; a shell block launches its own"]
    return []


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in parse_blocks(f.read_text(), str(f.relative_to(ROOT)))]


# The stand-ins a block may declare with setup=NAME: Python run before the block in the
# block's namespace (Python blocks) or in its directory (shell blocks).
_TINY_LLAMA = """
import torch
from flatzero.models import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0)
model = LlamaForCausalLM(config)
input_ids = torch.randint(0, 96, (2, 8))
labels = input_ids.clone()
"""

SETUPS: dict[str, str] = {
    "llama": _TINY_LLAMA
    + """
ds_config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
""",
    "module": """
import torch
class MyModel(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
""",
    "zero": _TINY_LLAMA
    + """
from flatzero import ZeroOptimizer
opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
model(input_ids, labels=labels).loss.backward()
opt.step()
sched.step()
epoch = 3
""",
    "door": """
import json
import torch
class Regression(torch.nn.Module):  # forward(batch) -> loss, as the snippet assumes
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
    def forward(self, batch):
        return (self.net(batch[:, :8]).squeeze(-1) - batch[:, 8]).pow(2).mean()
torch.manual_seed(0)
model = Regression()
dataset = torch.utils.data.TensorDataset(torch.randn(8, 9))
dataset = [row for (row,) in dataset]
with open("ds_config.json", "w") as f:
    json.dump({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
               "zero_optimization": {"stage": 2},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, f)
""",
    "checkpoint": _TINY_LLAMA
    + """
import json
from flatzero import ZeroOptimizer
from flatzero.checkpoint import save_checkpoint
opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-3)
model(input_ids, labels=labels).loss.backward()
opt.step()
save_checkpoint("ckpt", opt, model=model)
ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
with open("ds_config.json", "w") as f:
    json.dump(ds_config, f)
""",
}

# Runs Python blocks one after another in one process: argv[1] is a JSON list of
# {"name", "setup", "code"}, argv[2] the directory each block gets a subdirectory of
# (the same on every rank, so collective saves meet). A process group a block made stays
# for the blocks after it: made again under the same launcher it would wait forever.
_DRIVER = """
import json, os, sys, traceback
import torch.distributed as dist
blocks, base = json.loads(open(sys.argv[1]).read()), sys.argv[2]
failed = []
for i, block in enumerate(blocks):
    here = os.path.join(base, str(i))
    os.makedirs(here, exist_ok=True)
    os.chdir(here)
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(block["setup"], "<setup of " + block["name"] + ">", "exec"), namespace)
        exec(compile(block["code"], block["name"], "exec"), namespace)
    except BaseException:
        failed.append(block["name"])
        print("FAILED " + block["name"] + "\\n" + traceback.format_exc(), flush=True)
    if dist.is_initialized():  # kept for the next block: a group is made once per launch
        dist.barrier()
print("docs blocks failed: " + ", ".join(failed) if failed else "docs blocks ok", flush=True)
if dist.is_initialized():  # every rank is done before any tears its group down
    dist.barrier()
    dist.destroy_process_group()
sys.exit(1 if failed else 0)
"""


def _env(bin_dir: Path) -> dict[str, str]:
    """This checkout's src first on PYTHONPATH; shims for flatzero/python first on PATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="module")
def shim_env(tmp_path_factory) -> dict[str, str]:
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, target in {
        "flatzero": f'exec "{sys.executable}" -m flatzero "$@"',
        "python": f'exec "{sys.executable}" "$@"',
        "python3": f'exec "{sys.executable}" "$@"',
    }.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{target}\n")
        (bin_dir / name).chmod(0o755)
    return _env(bin_dir)


def _runs(langs: frozenset[str]) -> Iterator[Block]:
    return (b for b in all_blocks() if b.lang in langs and b.marker and b.marker.run)


def _python_groups() -> dict[int, list[Block]]:
    """The Python blocks to run by their number of ranks: one launch each."""
    groups: dict[int, list[Block]] = {}
    for block in _runs(PYTHON_LANGS):
        assert block.marker is not None
        groups.setdefault(block.marker.ranks, []).append(block)
    return groups


def _run(
    command: list[str],
    cwd: Path,
    env: dict[str, str],
    what: str,
    before_again: Callable[[], None] | None = None,
) -> str:
    """Run ``command`` (again after gloo's connect-time abort, ``before_again()`` first) and
    return its stdout; fail naming ``what`` with its output if it fails or times out."""
    try:
        proc = run_again_after_gloo_abort(
            lambda: subprocess.run(
                command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
            ),
            before_again,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what} ran past {TIMEOUT_S} s:\n{e.stdout}{e.stderr}")
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def test_every_block_names_its_language_and_is_run_or_skipped_with_a_reason():
    found = [p for b in all_blocks() for p in problems(b)]
    assert not found, "\n".join(found)


def test_an_unmarked_or_unnamed_block_is_refused():
    text = (
        "```python\nprint(1)\n```\n\n<!-- docs-test: skip -->\n```bash\nls\n```\n\n"
        "```\nplain\n```\n\n<!-- docs-test: run setup=nope -->\n```python\nx\n```\n\n"
        "<!-- docs-test: skip: needs 8 GPUs -->\n```bash\ntorchrun\n```\n\n"
        "```json\n{}\n```\n"
    )
    found = [p for b in parse_blocks(text, "x.md") for p in problems(b)]
    assert [p.split(":")[1] for p in found] == ["1", "6", "10", "15"], found
    assert "needs <!-- docs-test: run -->" in found[0]
    assert "needs a reason" in found[1]
    assert "names its language" in found[2]
    assert "setup=nope" in found[3]


def _expand(pattern: str) -> list[str]:
    """``a{1,2}b*`` as the shell expands it: braces to each choice, ``*`` kept for glob."""
    brace = re.search(r"\{([^{}]*)\}", pattern)
    if brace is None:
        return [pattern]
    return [
        name
        for choice in brace[1].split(",")
        for name in _expand(pattern[: brace.start()] + choice + pattern[brace.end() :])
    ]


def _prose(text: str) -> str:
    """``text`` without its fenced blocks (a block may name a file it is about to write)."""
    return re.sub(r"^\s*(`{3,}|~{3,}).*?^\s*\1", "", text, flags=re.S | re.M)


def test_results_files_the_prose_cites_are_committed():
    cited = {
        name.rstrip(".,")
        for f in doc_files()
        for name in re.findall(r"benchmarks/results/[\w.+\-*{},]+", _prose(f.read_text()))
    }
    missing = sorted(
        c for c in cited for n in _expand(c) if not list(ROOT.glob(n.removesuffix("/")))
    )
    assert cited and not missing, f"docs cite results files that are not committed: {missing}"


@pytest.mark.parametrize("ranks", sorted(_python_groups()), ids=lambda r: f"ranks={r}")
def test_python_blocks_run(ranks, tmp_path, shim_env):
    blocks = _python_groups()[ranks]
    payload = [
        {
            "name": b.name,
            "setup": SETUPS.get(b.marker.setup, "") if b.marker else "",
            "code": b.text,
        }
        for b in blocks
    ]
    (tmp_path / "blocks.json").write_text(json.dumps(payload))
    (tmp_path / "driver.py").write_text(_DRIVER)
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command = [*launch, str(tmp_path / "driver.py"), str(tmp_path / "blocks.json"), str(tmp_path)]

    def fresh_block_dirs() -> None:  # a block's files from an aborted launch
        for i in range(len(blocks)):
            shutil.rmtree(tmp_path / str(i), ignore_errors=True)

    _run(command, tmp_path, shim_env, ", ".join(b.name for b in blocks), fresh_block_dirs)


def _shell_script(block: Block) -> str:
    if block.lang != "console":
        return block.text
    return "\n".join(line[2:] for line in block.text.splitlines() if line.startswith("$ "))


def shown_lines_missing(block_text: str, output: str) -> list[str]:
    """The output lines a ``console`` block shows that its commands did not print, in that
    order (``...`` stands for lines left out; trailing spaces do not count)."""
    printed = iter(line.rstrip() for line in output.splitlines())
    shown = [line.rstrip() for line in block_text.splitlines()]
    return [
        line
        for line in shown
        if not line.startswith("$ ") and line != "..." and line not in printed
    ]


@pytest.mark.parametrize("block", list(_runs(SHELL_LANGS)), ids=lambda b: b.name)
def test_shell_blocks_run(block, tmp_path, shim_env):
    assert block.marker is not None
    if block.marker.setup:
        setup = [sys.executable, "-c", SETUPS[block.marker.setup]]
        _run(setup, tmp_path, shim_env, f"setup={block.marker.setup} of {block.name}")
    script = ["bash", "-e", "-o", "pipefail", "-c", _shell_script(block)]
    output = _run(script, tmp_path, shim_env, block.name)
    missing = shown_lines_missing(block.text, output) if block.lang == "console" else []
    assert not missing, f"{block.name} shows lines its command did not print:\n" + "\n".join(
        missing
    )


def test_a_console_block_shows_only_printed_lines_in_order():
    block = "$ cmd\na 1\n...\nc 3  \n"
    assert shown_lines_missing(block, "a 1\nb 2\nc 3\n") == []
    assert shown_lines_missing(block, "c 3\na 1\n") == ["c 3"]
    assert shown_lines_missing(block, "a 1\nc 4\n") == ["c 3"]


class _Regression(torch.nn.Module):
    """``model(micro).loss`` as optimizer.md's loop calls it: the mean squared error of a
    linear fit of column 8 from columns 0-7."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def forward(self, batch: torch.Tensor) -> SimpleNamespace:
        loss = (self.net(batch[:, :8]).squeeze(-1) - batch[:, 8]).pow(2).mean()
        return SimpleNamespace(loss=loss)


def test_optimizer_md_accumulation_loop_steps_on_the_mean_over_each_whole_batch():
    """optimizer.md's block needs GPUs; its loop, taken verbatim from the block, runs here
    with SGD (whose step is proportional to the gradient, so a doubled gradient shows) and
    must step as plain SGD on each whole batch's mean loss."""
    (block,) = [b for b in all_blocks() if b.path == "docs/optimizer.md" and "micro_" in b.text]
    loop = block.text[block.text.index("for batch in loader:") :]
    torch.manual_seed(0)
    model = _Regression()
    ref = copy.deepcopy(model)
    loader = [torch.randn(12, 9) for _ in range(3)]
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    names = {"loader": loader, "micro_batches": 3, "model": model, "opt": opt, "sched": sched}
    exec(compile(loop, block.name, "exec"), names)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for batch in loader:
        ref_opt.zero_grad()
        ref(batch).loss.backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_plan_md_shows_what_its_first_command_prints(capsys):
    """plan.md quotes the whole output of its first command; the plan is computed from
    datasheet rates (``--gpu h100``), the same on every machine, so it must match exactly."""
    blocks = [b for b in all_blocks() if b.path == "docs/plan.md"]
    command, shown = blocks[0], blocks[2]
    assert shown.lang == "text" and "The first command prints:" in (ROOT / shown.path).read_text()
    first = command.text[: command.text.index("\n", command.text.index("--gpu h100"))]
    argv = shlex.split(re.sub(r"#.*$", "", first.replace("\\\n", " "), flags=re.M))
    assert argv[:2] == ["flatzero", "plan"], argv
    assert main(argv[1:]) == 0
    assert capsys.readouterr().out == shown.text + "\n"
