"""What params can say about merges and federated rounds: each method's and algorithm's options
model and inputs (``merge``, ``federated``), and option lists as searches (``search``).

Torch-free on purpose: validating params (``mergeflow validate``, and every run before its heavy
work) imports these modules, never the methods' and algorithms' code, which imports torch.
"""
