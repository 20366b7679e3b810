"""``torch.compile`` through the DeepSpeed door: ``engine.compile()`` and compiled models.

See the note beside ``EngineCompile``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

__all__ = ["EngineCompile", "compile_in_place", "uncompiled"]

logger = logging.getLogger(__name__)

DEFAULT_BACKEND = "inductor"
"""``engine.compile()``'s backend when none is given (DeepSpeed's CPU and CUDA accelerators
default to it)."""


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(module)`` wrapped (``model._orig_mod``), or ``model``."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return model._orig_mod
    return model


def compile_in_place(model: nn.Module, wrapper: nn.Module) -> None:
    """Make ``model``'s own calls run what ``wrapper`` (``torch.compile(model, ...)``) runs:
    the wrapper's dynamo context (backend, mode, options) applied to ``model``'s
    ``_call_impl``, as ``nn.Module.compile`` does, through ``wrap_inline`` as the wrapper
    does, so that a module whose class is torch's own (``nn.Sequential``) is compiled too
    (``model.compile()`` would leave it eager: dynamo skips frames of torch's files)."""
    from torch._dynamo.external_utils import wrap_inline

    ctx = wrapper.dynamo_ctx  # type: ignore[attr-defined]
    model._compiled_call_impl = ctx(wrap_inline(model._call_impl))  # type: ignore[attr-defined]


# [Note: torch.compile through the DeepSpeed door. Both ways DeepSpeed 0.19.8 trains a
# compiled model work:
#
# - ``engine.compile(backend=..., compile_kwargs=...)`` (what Accelerate, and so HF Trainer
#   with ``torch_compile=True``, calls after ``deepspeed.initialize``) compiles
#   ``engine.module`` in place (``module.compile``), as DeepSpeed's does; ``is_compiled``
#   becomes True and a second call does nothing.
# - ``flatzero.initialize(model=torch.compile(model), ...)``: flatzero trains the module the
#   wrapper holds (``model._orig_mod``) and, once the engine is built, compiles it in place
#   with the wrapper's own settings (``compile_in_place``). ``engine.module`` is that
#   module, not the wrapper (DeepSpeed keeps the wrapper): its params, ``state_dict`` and
#   checkpoints keep the names they have without compile (the wrapper prefixes every name
#   with ``_orig_mod.``), so a checkpoint loads whether or not either run compiled.
#
# Nothing of flatzero runs inside the forward: its gradient hooks are on the params
# (``register_post_accumulate_grad_hook`` and the engine's pre-hooks), which autograd runs
# outside the compiled graph, so they cause no graph break. Compiled autograd
# (``compiled_autograd_enabled=True``) is refused: the stage 2 reducer queues an
# end-of-backward callback (``queue_callback``, which torch refuses under compiled autograd
# outside its fullgraph mode) and reads autograd's running graph task
# (``_current_graph_task_id``, ``_will_engine_execute_node``).]
class EngineCompile:
    """``compile`` and ``is_compiled`` of ``Engine`` (a base class of it)."""

    module: nn.Module
    _is_compiled: bool

    @property
    def is_compiled(self) -> bool:
        """Whether the module is compiled (``engine.compile()``, or a compiled model given
        to ``initialize``)."""
        return self._is_compiled

    def compile(
        self,
        backend: str | Any = None,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compile the module in place with ``torch.compile`` (``module.compile``), as
        DeepSpeed's ``engine.compile`` does without DeepCompile; nothing when it is
        compiled already.

        Args:
            backend: ``torch.compile``'s backend (default ``"inductor"``).
            compile_kwargs: other ``torch.compile`` arguments (``mode``, ``dynamic``,
                ``fullgraph``, ``options``); a ``backend`` among them is overridden.
            schedule: DeepCompile's schedule: must be None (DeepCompile is DeepSpeed's).
            compiled_autograd_enabled: must be False (see the note above).

        Raises:
            NotImplementedError: ``schedule`` or ``compiled_autograd_enabled`` given.
        """
        if schedule is not None:
            raise NotImplementedError(
                "engine.compile(schedule=...) is DeepCompile's, which flatzero does not "
                "implement; call engine.compile() without it (plain torch.compile)"
            )
        if compiled_autograd_enabled:
            raise NotImplementedError(
                "engine.compile(compiled_autograd_enabled=True) is not supported by flatzero: "
                "its stage 2 gradient hooks queue an end-of-backward callback and read "
                "autograd's running graph task, which compiled autograd does not support; "
                "call engine.compile() without it (the forward and its backward are still "
                "compiled)"
            )
        if self._is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            logger.warning(
                "engine.compile: the backend in compile_kwargs is overridden by backend="
            )
        kwargs["backend"] = DEFAULT_BACKEND if backend is None else backend
        self.module.compile(**kwargs)
        self._is_compiled = True
