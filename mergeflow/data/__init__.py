"""Data: loading the sources, splitting, feature encoding, tokenizing, federated partitioning and storage.

Import the module that holds a name (``mergeflow.data.storage``, ``mergeflow.data.split``, …): the package
serves none itself, so a step's code closure holds only the modules it uses, and the light ones
(``mergeflow.data.check``, ``mergeflow.data.errors``) do not import datasets, flwr-datasets, scikit-learn or
matplotlib. Each source's loader is a module of its own (``digits``, ``wine``, ``pinwheel``, ``linreg``,
``table``, ``text``, ``wordnet``: a :class:`mergeflow.data.loader.SourceLoader`), imported only when its
source is read; ``rows`` is the layout they load into.
"""
