"""Tensor and expert parallelism inside one engine: ranks as processes joined by torch.distributed.

* `group.TensorParallel`: which rank of how many this process is, and the collectives the layers
  call (one all-reduce per sublayer, the logits gathered to rank 0, the sampled tokens broadcast).
* `shard.Shard`: which slice of a checkpoint tensor a rank keeps; the loader reads only that slice.
* `commands`: what the driver (rank 0) tells the other ranks, in order; each rank applies it to its
  own engine, whose scheduler then decides exactly as the driver's does.
* `ranks.Ranks` (driver side, behind a launcher: `local_ranks` starts local processes for the
  offline engine, `actor_ranks` Ray actors in a cluster worker's placement-group bundles) and
  `rank_process.run_rank` (what each other rank runs).
* `heads`, `handoff`, `retained`: a KDA state's heads per rank, and how a request's state (a
  handoff) and a retained prefix (for the store) leave every rank and reach any other width.
"""
