"""The data side (CPU nodes; numpy, pyarrow, Ray Data; never torch): files to packed rows."""
