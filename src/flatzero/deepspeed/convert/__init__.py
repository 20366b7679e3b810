"""A checkpoint across the border: DeepSpeed's ZeRO-1/2 in (``from_deepspeed``), flatzero's
out (``to_deepspeed``), and the two commands that run them (``cli``)."""

from .incoming import from_deepspeed
from .outgoing import DeepSpeedExportResult, to_deepspeed

__all__ = ["DeepSpeedExportResult", "from_deepspeed", "to_deepspeed"]
