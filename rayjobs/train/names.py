"""The names a run writes and reads, shared by the job and the train workers (no torch here)."""

TRAIN_STATE = "train_state.pt"
"""The file of a periodic checkpoint that holds what resuming needs: the model's and the
optimizer's full state dicts, the LR schedule's state and the ``TrainState``."""


FINAL_SUMMARY = "summary.json"
"""The run summary's file in a finished run's final checkpoint (``train``): ``--resume latest``
passes over runs that hold one (there is nothing left to resume)."""


EVAL_DATASET = "eval_rank_"
"""The trainer's held-out datasets: ``eval_rank_<r>``, rank r's share of the eval packs
(``pipeline.held_out``)."""
