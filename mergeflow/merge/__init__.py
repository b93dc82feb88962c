"""Merge methods on plain state dicts: ``merge(method, states, **options)``; ``METHODS`` declares them.

Each method is declared in ``mergeflow.schema.merge`` and implemented in its own module here, which the
engine (``mergeflow.merge.engine``) imports when it runs that method, and no other.
"""

from mergeflow.merge.engine import MergeResult, merge, merge_method, run_merge
from mergeflow.schema.merge import DECLARED as METHODS
from mergeflow.schema.merge import MergeMethod, validate_options

__all__ = ["METHODS", "MergeMethod", "MergeResult", "merge", "merge_method", "run_merge", "validate_options"]
