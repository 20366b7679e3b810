"""The benchmark harness of ``flatzero bench``: one subpackage per benchmark (``init``,
``step``, ``load``, ``checkpoint``, ``doors``, ``plan``, ``device_memory``, ``offload``)
and ``common`` for what they share (settings, trials, results, the machine, DeepSpeed's
timed initialize). It is no part of the product: ``flatzero.harness`` finds it."""
