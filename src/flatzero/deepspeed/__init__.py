"""DeepSpeed compatibility, in one room: everything flatzero knows of DeepSpeed.

- ``engine``: the DeepSpeed door, ``flatzero.initialize`` and its engine, config parsing
  included;
- ``patch``: ``flatzero.patch_deepspeed()``, ``deepspeed.initialize`` routed through
  flatzero when it can (``python -m flatzero.run`` applies it to a script);
- DeepSpeed's checkpoint format, read and written without DeepSpeed: ``layout`` (the only
  home of DeepSpeed's padding and partition rule, pure), ``pickle`` (``torch.save``'s zip
  format and DeepSpeed's pickled classes), ``reader``, ``writer``, ``state`` (loss scaler
  and LR schedule both ways), ``target`` (the run an export is for, checked first);
- ``convert``: a checkpoint from DeepSpeed's format to flatzero's and back
  (``flatzero import-deepspeed`` / ``export-deepspeed``).

Importing this package imports nothing: the real ``deepspeed`` package is imported only
where a function needs it (``patch``, ``engine.deepspeed_compat``), never at import time.
"""
