"""Bucket-by-bucket flattening of parameters into flat, sharded buffers."""

from .api import flatten_parameters
from .buffers import FlatGroup, FlatParams
from .driver import BucketFillError
from .faults import inject_oom

__all__ = ["BucketFillError", "FlatGroup", "FlatParams", "flatten_parameters", "inject_oom"]
