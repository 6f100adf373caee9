"""Auto-parallel search: trace a train step, price every op's sharding strategies, solve an ILP, and lower the plan to one shard_map (see ``cfx.autoshard``)."""
