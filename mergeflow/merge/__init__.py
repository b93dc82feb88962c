"""Merge methods on plain state dicts: ``merge(method, states, **options)``; ``METHODS`` lists them.

Importing this package registers the built-in methods; a new method is one module here
with an ``@merge_method`` function, imported below.
"""

from mergeflow.merge import (  # noqa: F401  (registration)
    average,
    breadcrumbs,
    dare,
    della,
    exact,
    fisher,
    isotropic,  # spectral and geometric merges: isotropic, karcher, tsv
    karcher,
    model_stock,
    regmean,
    slerp,
    soup,
    ssf,
    task_arithmetic,
    ties,
    tsv,
    weighted,
)
from mergeflow.merge.registry import METHODS, MergeMethod, MergeResult, merge, merge_method, run_merge, validate_options

__all__ = ["METHODS", "MergeMethod", "MergeResult", "merge", "merge_method", "run_merge", "validate_options"]
