"""draftsmith: train speculative-decoding draft heads and measure them with tree verification.

Sub-packages: `heads` (draft-head modules and formats), `train` (data -> features -> training),
`inference` (trees, verification, decoding, benchmarks). This package holds what they share:
assets, target loading, conversation readers, config glue and the `draftsmith` CLI.
"""

__version__ = "0.1.0"
