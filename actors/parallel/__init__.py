"""Tensor- and pipeline-parallel engines on Ray placement groups.

- `placement`: reserve a placement group with a timeout and an error that names the bundles
  and what the cluster has.
- `plan`: a scheduled step as plain arrays (`StepPlan`), sent once to every worker.
- `tp`: shard a decoder's attention and MLP linears across a torch.distributed group.
- `pp`: split a decoder into stages (embedding first, a slice of layers, norm + LM head last).
- `weights`: build a worker's stage from safetensors, reading only its shard.
- `worker`: the Ray actor in one bundle; owns its shard and its KV tensors.
- `executor`: the engine's runner when tp x pp > 1.
- `pipelined`: an engine that keeps pp steps in flight (virtual engines) so stages overlap.
"""
