"""The train side (GPU nodes; torch): packed rows to masked batches, models, the train loop."""
