"""SPMD programs over a mesh: ``ShardedArray``, ``shard_map`` with its replication checks, resharding by planned collectives, ``device_put`` / ``device_get``, sharded initialisation."""
