"""``ray``: the cluster a run joins or starts, and how large its data pools grow."""

from __future__ import annotations

from pydantic import Field

from rayjobs.config.base import Strict


class RayConfig(Strict):
    address: str | None = None
    """Cluster to connect to; default: $RAY_ADDRESS, else an embedded local Ray."""
    num_cpus: float | None = Field(default=None, gt=0)
    """Logical CPUs of the embedded local Ray; default max(4, 2 × cores) (docs/training.md,
    "Resources and CPU vs GPU")."""
    tokenize_concurrency: int | None = Field(default=None, gt=0)
    """Maximum Tokenize actors (the pool grows to it as data waits); default half the cluster's
    CPUs, so adding CPU nodes adds tokenizers."""
    min_actors: int = Field(default=1, gt=0)
    """Actors each data pool (Tokenize, packers) starts with, before it grows."""
    pack_concurrency: int | None = Field(default=None, gt=0)
    """stream: maximum packer actors; default a quarter of the cluster's CPUs (at least 1)."""
    data_label_selector: dict[str, str] = Field(default_factory=dict)
    """Ray node labels every data task and actor (read, tokenize, pack) requires, e.g.
    ``{rayjobs.io/role: data}`` (Ray's label selector syntax: ``"!gpu"``, ``"in(a,b)"``); empty:
    anywhere with free CPUs."""
