"""torch.distributed plumbing shared by the trained roles and their checkpoints: ranks, FSDP2 / DDP sharding, gathers."""
