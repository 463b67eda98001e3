"""The job on top of both sides: the pipeline, its ledger, export, inspection and submission."""
